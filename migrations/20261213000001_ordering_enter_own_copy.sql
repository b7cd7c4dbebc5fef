-- A duplicate's own waiting copy only (docs/DESIGN.md, "Owned order"): the gate's entry
-- of a delivery whose record decides it (a duplicate of a completed message), or whose
-- turn it holds, deleted every waiting row of its key. A message of another payload
-- parked under that key (acked when it parked) was then gone without a trace when a
-- copy of the key's first message arrived after that message completed. A row is the
-- delivery's own copy when its payload is this delivery's (its fingerprint, or one of
-- the fingerprints it also answers to); a row of another payload stays, meets the
-- record when its turn comes and is dead-lettered `fingerprint_conflict`, as the moves
-- of 20261212000001_ordering_own_rows.sql leave it. Otherwise the function of
-- 20261211000001_ordering_parks_together.sql, unchanged.

CREATE OR REPLACE FUNCTION idem_ordering_enter(
    p_scope text[], p_key text[], p_seq bigint[], p_first bigint[], p_operation text[],
    p_idem text[], p_fp text[], p_also text[], p_queue text[], p_body bytea[],
    p_props bytea[])
    RETURNS TABLE (item integer, verdict text, seq bigint)
    LANGUAGE plpgsql
    SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off
    AS $$
DECLARE
    i integer;
    r record;
    pos ordering_positions%ROWTYPE;
    n bigint;
    parked boolean := false;
    early integer[];
BEGIN
    -- Every entity of the batch has its position, created in one statement, and all
    -- are locked in one, in order (so that no two batches wait for each other: both
    -- create in order, then lock in order, and a position being created is waited for
    -- at its creation).
    INSERT INTO ordering_positions (scope, ordering_key, next_seq, last_seq)
    SELECT t.s, t.k, min(t.f), min(t.f) - 1
      FROM unnest(p_scope, p_key, p_first) AS t(s, k, f)
     GROUP BY t.s, t.k
     ORDER BY t.s, t.k
    ON CONFLICT DO NOTHING;
    PERFORM 1 FROM ordering_positions p
      JOIN (SELECT DISTINCT t.s, t.k FROM unnest(p_scope, p_key) AS t(s, k)) t
        ON p.scope = t.s AND p.ordering_key = t.k
     ORDER BY p.scope, p.ordering_key
       FOR UPDATE OF p;
    -- The entries plainly early are parked together: a sequence number two or more past
    -- the position (a completed holder's move, made below, takes it one step), no
    -- waiting copy, no record that decides. What one statement parks is answered
    -- `wait`; a second entry of the batch with the same key or number goes through the
    -- loop, and finds the first parked (inserted in the batch's order, so that the first
    -- to arrive holds the number, as in the loop).
    WITH e AS (
        SELECT t.*
          FROM unnest(p_scope, p_key, p_seq, p_operation, p_idem, p_fp, p_queue, p_body,
                      p_props) WITH ORDINALITY
               AS t(s, k, n, op, idem, fp, q, body, props, i)
         WHERE t.n IS NOT NULL),
    plain AS (
        SELECT DISTINCT ON (e.s, e.op, e.idem) e.*
          FROM e
          JOIN ordering_positions p ON p.scope = e.s AND p.ordering_key = e.k
         WHERE e.n > p.next_seq + 1
           AND NOT EXISTS (
               SELECT 1 FROM ordering_waiting w
                WHERE w.scope = e.s AND w.operation = e.op AND w.idempotency_key = e.idem)
           AND NOT EXISTS (
               SELECT 1 FROM processed_operations o
                WHERE o.scope = e.s AND o.operation = e.op AND o.idempotency_key = e.idem
                  AND (o.status = 'completed' OR (o.status = 'failed' AND NOT o.retryable)))
         ORDER BY e.s, e.op, e.idem, e.i),
    parked_rows AS (
        INSERT INTO ordering_waiting (scope, ordering_key, seq, operation,
            idempotency_key, payload_sha256, queue, body, properties)
        SELECT x.s, x.k, x.n, x.op, x.idem, x.fp, x.q, x.body, x.props
          FROM plain x ORDER BY x.s, x.k, x.n, x.i
        ON CONFLICT DO NOTHING
        RETURNING ordering_waiting.scope, ordering_waiting.ordering_key,
                  ordering_waiting.seq, ordering_waiting.operation,
                  ordering_waiting.idempotency_key),
    grown AS (
        UPDATE ordering_positions p SET last_seq = m.top
          FROM (SELECT pr.scope, pr.ordering_key, max(pr.seq) AS top
                  FROM parked_rows pr GROUP BY pr.scope, pr.ordering_key) m
         WHERE p.scope = m.scope AND p.ordering_key = m.ordering_key AND p.last_seq < m.top)
    SELECT array_agg(x.i) INTO early
      FROM plain x
      JOIN parked_rows pr ON pr.scope = x.s AND pr.operation = x.op
                         AND pr.idempotency_key = x.idem AND pr.seq = x.n;
    IF early IS NOT NULL THEN
        parked := true;
        RETURN QUERY
            SELECT t.i::integer, 'wait'::text, t.n
              FROM unnest(p_seq) WITH ORDINALITY AS t(n, i)
             WHERE t.i = ANY(early);
    END IF;
    FOR i IN SELECT t.i FROM unnest(p_scope, p_key) WITH ORDINALITY AS t(s, k, i)
              WHERE early IS NULL OR t.i <> ALL(early)
              ORDER BY t.s, t.k, t.i
    LOOP
        item := i;
        seq := NULL;
        LOOP
            SELECT p AS pos,
                   p.holder_key IS NOT NULL AND EXISTS (
                       SELECT 1 FROM processed_operations h
                        WHERE h.scope = p.scope AND h.operation = p.holder_operation
                          AND h.idempotency_key = p.holder_key AND h.status = 'completed')
                       AS holder_done,
                   EXISTS (
                       SELECT 1 FROM processed_operations o
                        WHERE o.scope = p_scope[i] AND o.operation = p_operation[i]
                          AND o.idempotency_key = p_idem[i]
                          AND (o.status = 'completed' OR (o.status = 'failed' AND NOT o.retryable)))
                       AS decided,
                   w.seq AS w_seq, w.ordering_key AS w_key, w.payload_sha256 AS w_fp
              INTO r
              FROM ordering_positions p
              LEFT JOIN ordering_waiting w
                     ON w.scope = p_scope[i] AND w.operation = p_operation[i]
                    AND w.idempotency_key = p_idem[i]
             WHERE p.scope = p_scope[i] AND p.ordering_key = p_key[i]
               FOR UPDATE OF p;
            EXIT WHEN FOUND;
            -- Only when gc deleted the idle position between the two statements above
            -- (it skips locked rows, and this one was not locked yet): created again.
            INSERT INTO ordering_positions (scope, ordering_key, next_seq, last_seq)
            VALUES (p_scope[i], p_key[i], p_first[i], p_first[i] - 1)
            ON CONFLICT DO NOTHING;
        END LOOP;
        pos := r.pos;
        IF r.holder_done THEN
            pos := idem_ordering_move_on(pos);
        END IF;
        -- Its turn, or a record that decides without a turn: completed (a duplicate) or
        -- failed for good (acked as such; a replay makes it retryable first).
        IF r.decided OR (pos.holder_operation = p_operation[i] AND pos.holder_key = p_idem[i]) THEN
            -- A copy of it that waited is done with: this delivery, from the broker, is
            -- acked only once its outcome, retry copy or dead letter is safe (a delivery
            -- handed over in its releasing process does not enter, and keeps its row).
            -- The copy was read under the position's lock, which every park takes. A
            -- row of another payload under its key is not a copy of it, and stays.
            IF r.w_seq IS NOT NULL
               AND (r.w_fp = p_fp[i]
                    OR COALESCE(r.w_fp = ANY(string_to_array(p_also[i], ',')), false)) THEN
                DELETE FROM ordering_waiting
                 WHERE scope = p_scope[i] AND operation = p_operation[i]
                   AND idempotency_key = p_idem[i]
                   AND ordering_key = r.w_key AND ordering_waiting.seq = r.w_seq;
            END IF;
            verdict := 'run';
            RETURN NEXT;
            CONTINUE;
        END IF;
        IF r.w_seq IS NOT NULL THEN
            seq := r.w_seq;
            IF NOT (r.w_fp = p_fp[i]
                    OR COALESCE(r.w_fp = ANY(string_to_array(p_also[i], ',')), false)) THEN
                verdict := 'conflict';
            ELSIF r.w_key = pos.ordering_key AND r.w_seq < pos.next_seq THEN
                -- Its turn was skipped while it waited (or was on its way).
                DELETE FROM ordering_waiting
                 WHERE scope = pos.scope AND ordering_key = pos.ordering_key
                   AND ordering_waiting.seq = r.w_seq;
                verdict := 'passed';
            ELSIF r.w_key = pos.ordering_key AND r.w_seq = pos.next_seq AND pos.holder_key IS NULL THEN
                DELETE FROM ordering_waiting
                 WHERE scope = pos.scope AND ordering_key = pos.ordering_key
                   AND ordering_waiting.seq = r.w_seq;
                UPDATE ordering_positions
                   SET holder_operation = p_operation[i], holder_key = p_idem[i], held_since = now()
                 WHERE scope = pos.scope AND ordering_key = pos.ordering_key;
                verdict := 'run';
            ELSE
                verdict := 'waiting';
            END IF;
        ELSIF p_seq[i] IS NULL THEN
            IF pos.holder_key IS NULL AND pos.last_seq < pos.next_seq THEN
                seq := pos.next_seq;
                UPDATE ordering_positions
                   SET holder_operation = p_operation[i], holder_key = p_idem[i],
                       held_since = now(), last_seq = pos.next_seq
                 WHERE scope = pos.scope AND ordering_key = pos.ordering_key;
                verdict := 'run';
            ELSE
                n := greatest(pos.last_seq, pos.next_seq) + 1;
                INSERT INTO ordering_waiting (scope, ordering_key, seq, operation,
                    idempotency_key, payload_sha256, queue, body, properties)
                VALUES (p_scope[i], p_key[i], n, p_operation[i], p_idem[i], p_fp[i],
                        p_queue[i], p_body[i], p_props[i])
                ON CONFLICT DO NOTHING;
                IF NOT FOUND THEN
                    RAISE EXCEPTION 'ordering: entity % / % has a waiting row past its last number %',
                        p_scope[i], p_key[i], n;
                END IF;
                UPDATE ordering_positions SET last_seq = n
                 WHERE scope = pos.scope AND ordering_key = pos.ordering_key;
                seq := n;
                verdict := 'wait';
            END IF;
        ELSE
            seq := p_seq[i];
            IF p_seq[i] < pos.next_seq THEN
                verdict := 'passed';
            ELSIF p_seq[i] = pos.next_seq THEN
                IF pos.holder_key IS NOT NULL THEN
                    verdict := 'taken';
                ELSIF EXISTS (
                    SELECT 1 FROM ordering_waiting x
                     WHERE x.scope = pos.scope AND x.ordering_key = pos.ordering_key
                       AND x.seq = pos.next_seq)
                THEN
                    verdict := 'taken';
                ELSE
                    UPDATE ordering_positions
                       SET holder_operation = p_operation[i], holder_key = p_idem[i],
                           held_since = now(), last_seq = greatest(last_seq, p_seq[i])
                     WHERE scope = pos.scope AND ordering_key = pos.ordering_key;
                    verdict := 'run';
                END IF;
            ELSE
                -- Parked in one statement: its row and, when its number is the entity's
                -- highest yet, last_seq (a parked row's number is past next_seq, so
                -- last_seq >= next_seq already keeps gc off the position).
                WITH parked_row AS (
                    INSERT INTO ordering_waiting (scope, ordering_key, seq, operation,
                        idempotency_key, payload_sha256, queue, body, properties)
                    VALUES (p_scope[i], p_key[i], p_seq[i], p_operation[i], p_idem[i], p_fp[i],
                            p_queue[i], p_body[i], p_props[i])
                    ON CONFLICT DO NOTHING
                    RETURNING 1),
                grown AS (
                    UPDATE ordering_positions p SET last_seq = p_seq[i]
                     WHERE p.scope = pos.scope AND p.ordering_key = pos.ordering_key
                       AND p.last_seq < p_seq[i] AND EXISTS (SELECT 1 FROM parked_row))
                SELECT count(*) INTO n FROM parked_row;
                IF n > 0 THEN
                    verdict := 'wait';
                ELSE
                    verdict := 'taken';
                END IF;
            END IF;
        END IF;
        -- Its record, read afresh: the first statement's snapshot predates the wait
        -- for the position's lock, during which a copy of it may have completed and
        -- moved the entity past it. A duplicate is acked as such, not dead-lettered.
        -- (Two IFs: a condition of a variable and a subquery is planned at every call.)
        IF verdict IN ('passed', 'taken', 'conflict') THEN
            IF EXISTS (
                SELECT 1 FROM processed_operations o
                 WHERE o.scope = p_scope[i] AND o.operation = p_operation[i]
                   AND o.idempotency_key = p_idem[i]
                   AND (o.status = 'completed' OR (o.status = 'failed' AND NOT o.retryable)))
            THEN
                -- Its own copy only (one of another payload stays), read afresh too.
                DELETE FROM ordering_waiting
                 WHERE scope = p_scope[i] AND operation = p_operation[i]
                   AND idempotency_key = p_idem[i]
                   AND (payload_sha256 = p_fp[i]
                        OR payload_sha256 = ANY(string_to_array(p_also[i], ',')));
                verdict := 'run';
            END IF;
        ELSIF verdict = 'wait' THEN
            parked := true;
        END IF;
        RETURN NEXT;
    END LOOP;
    -- Nothing parked: what this transaction wrote is rebuilt by a redelivery (the
    -- delivery is acked only after its outcome commits, which flushes this too), so its
    -- commit need not wait for the WAL flush. A parked delivery is acked once this
    -- commits, so then it must.
    IF NOT parked THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
END
$$;
