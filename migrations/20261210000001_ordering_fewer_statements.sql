-- Order per entity in fewer statements (docs/PERFORMANCE.md, "Order per entity"). Each
-- statement PL/pgSQL runs pays a fixed cost (its cached plan checked, its tables and
-- indexes locked, an executor started and ended) that was most of what an entry cost
-- Postgres. An entry now looks at everything it decides on in one statement, and parks
-- in one; a release moves a completed holder's entity on in one after its look. The
-- decisions, and the row locks they take, are those of 20261208000001_ordering.sql and
-- 20261209000001_ordering_cheaper_turns.sql.
--
-- Written so that no plan is made afresh at every call: an IF whose condition joins a
-- variable that is often NULL (`holder_key IS NOT NULL AND EXISTS (...)`) was planned
-- at each call, the plan folded to a constant where the variable was NULL, so that
-- Postgres never settled on its generic plan (pg_stat_statements: 19,482 plans for
-- 20,256 calls).

-- Moves `pos` on past its holder, whose record completed, and deletes the holder's
-- waiting row (kept, when its turn was handed to it from there, until it completed).
CREATE OR REPLACE FUNCTION idem_ordering_move_on(pos ordering_positions)
    RETURNS ordering_positions
    LANGUAGE plpgsql AS $$
DECLARE
    moved ordering_positions%ROWTYPE;
BEGIN
    WITH gone AS (
        DELETE FROM ordering_waiting w
         WHERE w.scope = pos.scope AND w.operation = pos.holder_operation
           AND w.idempotency_key = pos.holder_key)
    UPDATE ordering_positions p
       SET next_seq = p.next_seq + 1, holder_operation = NULL, holder_key = NULL,
           held_since = NULL, moved_at = now()
     WHERE p.scope = pos.scope AND p.ordering_key = pos.ordering_key
    RETURNING p.* INTO moved;
    RETURN moved;
END
$$;

-- As before: locks an entity's position (creating it at `first`) and moves it on past a
-- holder whose record completed. One statement for the lock and the look at the holder.
CREATE OR REPLACE FUNCTION idem_ordering_lock(p_scope text, p_key text, p_first bigint)
    RETURNS ordering_positions
    LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    LOOP
        SELECT p AS pos,
               p.holder_key IS NOT NULL AND EXISTS (
                   SELECT 1 FROM processed_operations h
                    WHERE h.scope = p.scope AND h.operation = p.holder_operation
                      AND h.idempotency_key = p.holder_key AND h.status = 'completed')
                   AS holder_done
          INTO r
          FROM ordering_positions p
         WHERE p.scope = p_scope AND p.ordering_key = p_key
           FOR UPDATE OF p;
        EXIT WHEN FOUND;
        INSERT INTO ordering_positions (scope, ordering_key, next_seq, last_seq)
        VALUES (p_scope, p_key, p_first, p_first - 1)
        ON CONFLICT DO NOTHING;
    END LOOP;
    IF r.holder_done THEN
        RETURN idem_ordering_move_on(r.pos);
    END IF;
    RETURN r.pos;
END
$$;

-- The decisions of 20261209000001's idem_ordering_enter. An entry's first statement
-- locks its entity's position and reads, beside it, whether the holder's record
-- completed, whether the entry's own record decides, and its waiting copy; a park is
-- its second (the row and, when the number grows, last_seq).
CREATE OR REPLACE FUNCTION idem_ordering_enter(
    p_scope text[], p_key text[], p_seq bigint[], p_first bigint[], p_operation text[],
    p_idem text[], p_fp text[], p_also text[], p_queue text[], p_body bytea[],
    p_props bytea[])
    RETURNS TABLE (item integer, verdict text, seq bigint)
    LANGUAGE plpgsql AS $$
DECLARE
    i integer;
    r record;
    pos ordering_positions%ROWTYPE;
    n bigint;
    parked boolean := false;
BEGIN
    FOR i IN SELECT t.i FROM unnest(p_scope, p_key) WITH ORDINALITY AS t(s, k, i)
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
            -- The copy was read under the position's lock, which every park takes.
            IF r.w_seq IS NOT NULL THEN
                DELETE FROM ordering_waiting
                 WHERE scope = p_scope[i] AND operation = p_operation[i]
                   AND idempotency_key = p_idem[i];
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
                DELETE FROM ordering_waiting
                 WHERE scope = p_scope[i] AND operation = p_operation[i]
                   AND idempotency_key = p_idem[i];
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

-- The decisions of 20261209000001's idem_ordering_release. A completed holder's entity
-- takes two statements: the lock with the look at the holder's record, and one that
-- deletes the holder's waiting row, moves the position, hands the turn to the row
-- waiting with the next number and releases it (with rows whose turn passed).
CREATE OR REPLACE FUNCTION idem_ordering_release(
    p_scope text[], p_key text[], p_stale_ms bigint, p_async boolean DEFAULT true)
    RETURNS TABLE (scope text, ordering_key text, seq bigint, operation text,
                   idempotency_key text, queue text, body bytea, properties bytea,
                   turn boolean)
    LANGUAGE plpgsql AS $$
-- Times from the clock, not the transaction's start: in the transaction that completes
-- a holder, now() is when that transaction began, which would make a turn handed over
-- at its commit look released (and the position moved) long before.
DECLARE
    k record;
    r record;
    pos ordering_positions%ROWTYPE;
    next_op text;
    next_key text;
BEGIN
    FOR k IN SELECT DISTINCT t.s, t.k FROM unnest(p_scope, p_key) AS t(s, k) ORDER BY t.s, t.k
    LOOP
        SELECT p AS pos,
               p.holder_key IS NOT NULL AND EXISTS (
                   SELECT 1 FROM processed_operations h
                    WHERE h.scope = p.scope AND h.operation = p.holder_operation
                      AND h.idempotency_key = p.holder_key AND h.status = 'completed')
                   AS holder_done
          INTO r
          FROM ordering_positions p
         WHERE p.scope = k.s AND p.ordering_key = k.k
           FOR UPDATE OF p;
        CONTINUE WHEN NOT FOUND;
        pos := r.pos;
        IF r.holder_done THEN
            -- The holder's waiting row (if its turn was handed to it from there) goes
            -- (`gone`), the position moves on and its turn is handed to the delivery
            -- waiting with the next number (`moved`), which is released: one row, found
            -- by its number as a value, not through `moved` (a join on the entity's
            -- rows read all of them: each turn of a hot entity with 10,000 waiting took
            -- longer than one handler's). Rows behind the position (only a skip leaves
            -- them) are looked for only where a skip was made.
            RETURN QUERY
                WITH gone AS (
                    DELETE FROM ordering_waiting w
                     WHERE w.scope = pos.scope AND w.operation = pos.holder_operation
                       AND w.idempotency_key = pos.holder_key),
                next_row AS (
                    SELECT w.operation, w.idempotency_key FROM ordering_waiting w
                     WHERE w.scope = pos.scope AND w.ordering_key = pos.ordering_key
                       AND w.seq = pos.next_seq + 1),
                moved AS (
                    UPDATE ordering_positions p
                       SET next_seq = p.next_seq + 1,
                           holder_operation = (SELECT x.operation FROM next_row x),
                           holder_key = (SELECT x.idempotency_key FROM next_row x),
                           held_since = CASE WHEN EXISTS (SELECT 1 FROM next_row)
                                             THEN clock_timestamp() END,
                           moved_at = clock_timestamp()
                     WHERE p.scope = pos.scope AND p.ordering_key = pos.ordering_key
                    RETURNING p.next_seq, p.holder_operation, p.holder_key)
                UPDATE ordering_waiting w
                   SET released_at = clock_timestamp(), releases = w.releases + 1
                  FROM moved m
                 WHERE w.scope = pos.scope AND w.ordering_key = pos.ordering_key
                   AND w.seq = pos.next_seq + 1 AND m.holder_operation = w.operation
                   AND m.holder_key = w.idempotency_key
                   AND (w.released_at IS NULL
                        OR (w.released_at < clock_timestamp()
                            - p_stale_ms * (1 << least(w.releases - 1, 6)) * interval '1 millisecond'
                            AND NOT EXISTS (
                                SELECT 1 FROM processed_operations o
                                 WHERE o.scope = w.scope AND o.operation = w.operation
                                   AND o.idempotency_key = w.idempotency_key
                                   AND o.status IN ('processing', 'pending')
                                   AND o.lease_expires_at > clock_timestamp())))
                RETURNING w.scope, w.ordering_key, w.seq, w.operation, w.idempotency_key,
                          w.queue, w.body, w.properties, true;
            IF pos.skipped = 0 THEN
                CONTINUE;
            END IF;
            -- Where a skip was made, the rows behind the position too (below).
            SELECT * INTO pos FROM ordering_positions p
             WHERE p.scope = k.s AND p.ordering_key = k.k;
        END IF;
        IF pos.holder_key IS NULL THEN
            -- A turn nobody took (after a skip, or a move made by an entering delivery).
            SELECT w.operation, w.idempotency_key INTO next_op, next_key
              FROM ordering_waiting w
             WHERE w.scope = pos.scope AND w.ordering_key = pos.ordering_key
               AND w.seq = pos.next_seq;
            IF FOUND THEN
                UPDATE ordering_positions p
                   SET holder_operation = next_op, holder_key = next_key, held_since = clock_timestamp()
                 WHERE p.scope = pos.scope AND p.ordering_key = pos.ordering_key
                RETURNING * INTO pos;
            END IF;
        END IF;
        -- The row whose turn it is (again, when it did not complete: 5 s, doubling up to
        -- 320 s, never while its run holds a live lease), flagged `turn`, and rows whose
        -- turn passed while they waited (an operator skipped it): their copies come back
        -- and are dead-lettered `sequence_passed`, so none is lost in the table.
        RETURN QUERY
            UPDATE ordering_waiting w SET released_at = clock_timestamp(), releases = w.releases + 1
             WHERE w.scope = pos.scope AND w.ordering_key = pos.ordering_key
               AND (w.seq < pos.next_seq
                    OR (w.seq = pos.next_seq AND pos.holder_operation = w.operation
                        AND pos.holder_key = w.idempotency_key))
               AND (w.released_at IS NULL
                    OR (w.released_at < clock_timestamp()
                        - p_stale_ms * (1 << least(w.releases - 1, 6)) * interval '1 millisecond'
                        AND NOT EXISTS (
                            SELECT 1 FROM processed_operations o
                             WHERE o.scope = w.scope AND o.operation = w.operation
                               AND o.idempotency_key = w.idempotency_key
                               AND o.status IN ('processing', 'pending')
                               AND o.lease_expires_at > clock_timestamp())))
            RETURNING w.scope, w.ordering_key, w.seq, w.operation, w.idempotency_key,
                      w.queue, w.body, w.properties, w.seq = pos.next_seq;
    END LOOP;
    -- A lost release is published again by the sweep; a lost move by the next entry.
    IF p_async THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
END
$$;
