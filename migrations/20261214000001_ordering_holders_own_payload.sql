-- A completed holder's row of its own payload only (docs/DESIGN.md, "Owned order"):
-- moving an entity on past a holder whose record completed deleted the holder's waiting
-- row at its turn, whatever its payload. A message of another payload parked under a
-- key that another message completed (a producer's bug, refused when it runs) is
-- handed its turn with that key as the holder, whose record completed already: the
-- next lock of the position (an entering delivery, the sweep, a skip) moved past it and
-- deleted its row before it ran (in the releasing process, where its run dead-letters
-- it `fingerprint_conflict`); a crash in between lost it without a trace. The row now goes
-- only when it carries the record's payload; a row of another payload stays, behind the
-- position, and the sweep publishes it once its release is stale, then deletes it
-- (its own run, when it happens first, deletes it). A row parked before a deploy that
-- changed the fingerprint's canonical form (the handler's volatile fields) carries
-- another fingerprint than the record its own run wrote, and goes the same way, its
-- copy a duplicate. Otherwise the functions of 20261212000001_ordering_own_rows.sql,
-- unchanged.

-- Deletes the waiting row of `pos`'s holder at its turn when it carries the payload of
-- the holder's record: what the turn ran. One of another payload under the key stays.
CREATE OR REPLACE FUNCTION idem_ordering_holders_row_done(pos ordering_positions)
    RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM ordering_waiting w
     WHERE w.scope = pos.scope AND w.operation = pos.holder_operation
       AND w.idempotency_key = pos.holder_key
       AND w.ordering_key = pos.ordering_key AND w.seq = pos.next_seq
       AND EXISTS (SELECT 1 FROM processed_operations r
                    WHERE r.scope = w.scope AND r.operation = w.operation
                      AND r.idempotency_key = w.idempotency_key
                      AND r.payload_sha256 = w.payload_sha256);
END
$$;

-- Moves `pos` on past its holder, whose record completed, and deletes the holder's
-- waiting row of the record's payload (kept, when its turn was handed to it from there,
-- until it completed).
CREATE OR REPLACE FUNCTION idem_ordering_move_on(pos ordering_positions)
    RETURNS ordering_positions
    LANGUAGE plpgsql AS $$
DECLARE
    moved ordering_positions%ROWTYPE;
BEGIN
    PERFORM idem_ordering_holders_row_done(pos);
    UPDATE ordering_positions p
       SET next_seq = p.next_seq + 1, holder_operation = NULL, holder_key = NULL,
           held_since = NULL, moved_at = now()
     WHERE p.scope = pos.scope AND p.ordering_key = pos.ordering_key
    RETURNING p.* INTO moved;
    RETURN moved;
END
$$;

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
            -- when it is of the record's payload (a row of another payload stays behind
            -- the position, for a later round to publish once its release is stale),
            -- the position moves on and its turn is handed to the delivery
            -- waiting with the next number (`moved`), which is released: one row, found
            -- by its number as a value, not through `moved` (a join on the entity's
            -- rows read all of them: each turn of a hot entity with 10,000 waiting took
            -- longer than one handler's). Rows behind the position (only a skip leaves
            -- them, and a row of another payload kept above, which a later round
            -- publishes once its release is stale) are looked for only where a skip
            -- was made.
            PERFORM idem_ordering_holders_row_done(pos);
            RETURN QUERY
                WITH next_row AS (
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
        -- The row whose turn it is (again, when it did not complete: after p_stale_ms,
        -- doubling up to 64 times that, never while its run holds a live lease), flagged
        -- `turn`, and rows behind the position: whose turn passed while they waited (an
        -- operator skipped it), or kept by a move past a completed holder (another
        -- payload's under its key, or one parked under an older fingerprint). The worker
        -- publishes them; their copies are decided when they come back
        -- (`sequence_passed`, `fingerprint_conflict`, a duplicate), so none is lost in
        -- the table. A kept one, whose key's record decides it, goes once its copy is
        -- confirmed (worker/hand_on.rs), so that none is published for ever.
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
