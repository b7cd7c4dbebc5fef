-- Order per entity, cheaper per turn (docs/PERFORMANCE.md, "Order per entity"): the
-- release reads and writes an entity's position once, and can run in the transaction
-- that completes the holder; a parked delivery writes its position only when it raises
-- last_seq. The decisions are those of
-- 20261208000001_ordering.sql.

-- Room on each page for a position's new version, so that a write that changes no
-- indexed column (a park's last_seq) can stay on the page (HOT), for the pages written
-- from now on; a move or a hand-off changes indexed columns and cannot.
ALTER TABLE ordering_positions SET (fillfactor = 70);

CREATE OR REPLACE FUNCTION idem_ordering_enter(
    p_scope text[], p_key text[], p_seq bigint[], p_first bigint[], p_operation text[],
    p_idem text[], p_fp text[], p_also text[], p_queue text[], p_body bytea[],
    p_props bytea[])
    RETURNS TABLE (item integer, verdict text, seq bigint)
    LANGUAGE plpgsql AS $$
DECLARE
    i integer;
    pos ordering_positions%ROWTYPE;
    w ordering_waiting%ROWTYPE;
    n bigint;
    parked boolean := false;
BEGIN
    FOR i IN SELECT t.i FROM unnest(p_scope, p_key) WITH ORDINALITY AS t(s, k, i)
              ORDER BY t.s, t.k, t.i
    LOOP
        item := i;
        seq := NULL;
        pos := idem_ordering_lock(p_scope[i], p_key[i], p_first[i]);
        -- Its turn, or a record that decides without a turn: completed (a duplicate) or
        -- failed for good (acked as such; a replay makes it retryable first).
        IF (pos.holder_operation = p_operation[i] AND pos.holder_key = p_idem[i])
           OR EXISTS (SELECT 1 FROM processed_operations r
                       WHERE r.scope = p_scope[i] AND r.operation = p_operation[i]
                         AND r.idempotency_key = p_idem[i]
                         AND (r.status = 'completed' OR (r.status = 'failed' AND NOT r.retryable)))
        THEN
            -- A copy of it that waited is done with: this delivery, from the broker, is
            -- acked only once its outcome, retry copy or dead letter is safe (a delivery
            -- handed over in its releasing process does not enter, and keeps its row).
            DELETE FROM ordering_waiting
             WHERE scope = p_scope[i] AND operation = p_operation[i]
               AND idempotency_key = p_idem[i];
            verdict := 'run';
            RETURN NEXT;
            CONTINUE;
        END IF;
        SELECT * INTO w FROM ordering_waiting
         WHERE scope = p_scope[i] AND operation = p_operation[i] AND idempotency_key = p_idem[i];
        IF FOUND THEN
            seq := w.seq;
            IF NOT (w.payload_sha256 = p_fp[i]
                    OR COALESCE(w.payload_sha256 = ANY(string_to_array(p_also[i], ',')), false)) THEN
                verdict := 'conflict';
            ELSIF w.scope = pos.scope AND w.ordering_key = pos.ordering_key
                  AND w.seq < pos.next_seq THEN
                -- Its turn was skipped while it waited (or was on its way).
                DELETE FROM ordering_waiting
                 WHERE scope = w.scope AND ordering_key = w.ordering_key AND ordering_waiting.seq = w.seq;
                verdict := 'passed';
            ELSIF w.scope = pos.scope AND w.ordering_key = pos.ordering_key
                  AND w.seq = pos.next_seq AND pos.holder_key IS NULL THEN
                DELETE FROM ordering_waiting
                 WHERE scope = w.scope AND ordering_key = w.ordering_key AND ordering_waiting.seq = w.seq;
                UPDATE ordering_positions
                   SET holder_operation = p_operation[i], holder_key = p_idem[i], held_since = now()
                 WHERE scope = pos.scope AND ordering_key = pos.ordering_key;
                verdict := 'run';
            ELSE
                verdict := 'waiting';
            END IF;
            RETURN NEXT;
            CONTINUE;
        END IF;
        IF p_seq[i] IS NULL THEN
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
                IF pos.holder_key IS NOT NULL OR EXISTS (
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
                INSERT INTO ordering_waiting (scope, ordering_key, seq, operation,
                    idempotency_key, payload_sha256, queue, body, properties)
                VALUES (p_scope[i], p_key[i], p_seq[i], p_operation[i], p_idem[i], p_fp[i],
                        p_queue[i], p_body[i], p_props[i])
                ON CONFLICT DO NOTHING;
                IF FOUND THEN
                    -- Written only when it grows: a parked row's number is past next_seq,
                    -- so last_seq >= next_seq already keeps gc off the position.
                    IF pos.last_seq < p_seq[i] THEN
                        UPDATE ordering_positions SET last_seq = p_seq[i]
                         WHERE scope = pos.scope AND ordering_key = pos.ordering_key;
                    END IF;
                    verdict := 'wait';
                ELSE
                    verdict := 'taken';
                END IF;
            END IF;
        END IF;
        IF verdict = 'wait' THEN
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

-- Moves each entity's position on past a completed holder and hands the turn to the
-- delivery waiting for it, in one write of the position row (it was three statements
-- and two writes: a look, the move, the hand-off); returns the rows released, as before.
-- `p_async`: its own transaction, whose commit need not wait for the WAL flush; false
-- when it runs in the transaction of the holder's completion, whose commit must.
DROP FUNCTION IF EXISTS idem_ordering_release(text[], text[], bigint);
CREATE FUNCTION idem_ordering_release(
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
    pos ordering_positions%ROWTYPE;
    next_op text;
    next_key text;
BEGIN
    FOR k IN SELECT DISTINCT t.s, t.k FROM unnest(p_scope, p_key) AS t(s, k) ORDER BY t.s, t.k
    LOOP
        SELECT * INTO pos FROM ordering_positions p
         WHERE p.scope = k.s AND p.ordering_key = k.k FOR UPDATE;
        CONTINUE WHEN NOT FOUND;
        IF pos.holder_key IS NOT NULL AND EXISTS (
            SELECT 1 FROM processed_operations r
             WHERE r.scope = pos.scope AND r.operation = pos.holder_operation
               AND r.idempotency_key = pos.holder_key AND r.status = 'completed')
        THEN
            -- The holder's waiting row, if its turn was handed to it from there, is done
            -- with; the turn goes to the delivery waiting with the next number, if one is.
            DELETE FROM ordering_waiting w
             WHERE w.scope = pos.scope AND w.operation = pos.holder_operation
               AND w.idempotency_key = pos.holder_key;
            SELECT w.operation, w.idempotency_key INTO next_op, next_key
              FROM ordering_waiting w
             WHERE w.scope = pos.scope AND w.ordering_key = pos.ordering_key
               AND w.seq = pos.next_seq + 1;
            UPDATE ordering_positions p
               SET next_seq = p.next_seq + 1, holder_operation = next_op,
                   holder_key = next_key,
                   held_since = CASE WHEN next_key IS NULL THEN NULL ELSE clock_timestamp() END,
                   moved_at = clock_timestamp()
             WHERE p.scope = pos.scope AND p.ordering_key = pos.ordering_key
            RETURNING * INTO pos;
        ELSIF pos.holder_key IS NULL THEN
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
                            SELECT 1 FROM processed_operations r
                             WHERE r.scope = w.scope AND r.operation = w.operation
                               AND r.idempotency_key = w.idempotency_key
                               AND r.status IN ('processing', 'pending')
                               AND r.lease_expires_at > clock_timestamp())))
            RETURNING w.scope, w.ordering_key, w.seq, w.operation, w.idempotency_key,
                      w.queue, w.body, w.properties, w.seq = pos.next_seq;
    END LOOP;
    -- A lost release is published again by the sweep; a lost move by the next entry.
    IF p_async THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
END
$$;
