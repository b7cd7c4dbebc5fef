-- Ordered processing per entity (DESIGN.md, "Order per entity"): one entity's
-- deliveries run one at a time, in sequence order, across every worker process.

-- One row per entity (scope and ordering key): the sequence number that runs next, and
-- who holds it. The holder is the operation whose delivery took the position; its
-- successors wait until its record is `completed` (or an operator skips it).
CREATE TABLE IF NOT EXISTS ordering_positions (
    scope            text        NOT NULL,
    ordering_key     text        NOT NULL CHECK (octet_length(ordering_key) BETWEEN 1 AND 500),
    next_seq         bigint      NOT NULL,
    -- Order of arrival (no sequence from the message): the last number handed out.
    last_seq         bigint      NOT NULL,
    holder_operation text,
    holder_key       text,
    held_since       timestamptz,
    -- The last time next_seq moved (or the position was created): a position with
    -- waiting deliveries that has not moved for a while is stalled.
    moved_at         timestamptz NOT NULL DEFAULT now(),
    -- Skipped sequence numbers, and what the operator said of the last one.
    skipped          bigint      NOT NULL DEFAULT 0,
    skip_note        text,
    skipped_at       timestamptz,
    PRIMARY KEY (scope, ordering_key),
    CHECK ((holder_key IS NULL) = (holder_operation IS NULL))
);

-- The sweep's look at held positions (a holder that completed without moving its
-- position on).
CREATE INDEX IF NOT EXISTS ordering_positions_held
    ON ordering_positions (scope, holder_operation, holder_key)
    WHERE holder_key IS NOT NULL;
-- gc: idle positions.
CREATE INDEX IF NOT EXISTS ordering_positions_moved
    ON ordering_positions (moved_at) WHERE holder_key IS NULL;

-- Deliveries that arrived before their turn: acked, kept here (body sealed when data
-- protection is on, properties as JSON bytes), published again to their queue when
-- their turn comes, and deleted when that copy takes the position.
CREATE TABLE IF NOT EXISTS ordering_waiting (
    scope            text        NOT NULL,
    ordering_key     text        NOT NULL,
    seq              bigint      NOT NULL,
    operation        text        NOT NULL,
    idempotency_key  text        NOT NULL,
    payload_sha256   text        NOT NULL,
    queue            text        NOT NULL,
    body             bytea       NOT NULL,
    properties       bytea       NOT NULL,
    waiting_since    timestamptz NOT NULL DEFAULT now(),
    -- When its turn was last released (NULL: not yet), and how often: a released turn
    -- that did not complete is published again after 5 s, doubling up to 320 s, never
    -- while its run holds a live lease.
    released_at      timestamptz,
    releases         integer     NOT NULL DEFAULT 0,
    PRIMARY KEY (scope, ordering_key, seq),
    CONSTRAINT ordering_waiting_key UNIQUE (scope, operation, idempotency_key)
);

ALTER TABLE ordering_positions SET (autovacuum_vacuum_scale_factor = 0.05);
ALTER TABLE ordering_waiting SET (autovacuum_vacuum_scale_factor = 0.05);

-- Locks an entity's position (creating it at `first`) and moves it on past a holder
-- whose record completed: the holder's own move may not have come (a crash after its
-- commit), and a completed operation never blocks its successors.
CREATE OR REPLACE FUNCTION idem_ordering_lock(p_scope text, p_key text, p_first bigint)
    RETURNS ordering_positions
    LANGUAGE plpgsql AS $$
DECLARE
    pos ordering_positions%ROWTYPE;
BEGIN
    SELECT * INTO pos FROM ordering_positions
     WHERE scope = p_scope AND ordering_key = p_key FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO ordering_positions (scope, ordering_key, next_seq, last_seq)
        VALUES (p_scope, p_key, p_first, p_first - 1)
        ON CONFLICT DO NOTHING;
        SELECT * INTO pos FROM ordering_positions
         WHERE scope = p_scope AND ordering_key = p_key FOR UPDATE;
    END IF;
    IF pos.holder_key IS NOT NULL AND EXISTS (
        SELECT 1 FROM processed_operations
         WHERE scope = pos.scope AND operation = pos.holder_operation
           AND idempotency_key = pos.holder_key AND status = 'completed')
    THEN
        -- The holder's waiting row, if its turn was handed to it from there (kept until
        -- it completed, in case its worker died), is done with.
        DELETE FROM ordering_waiting
         WHERE scope = pos.scope AND operation = pos.holder_operation
           AND idempotency_key = pos.holder_key;
        UPDATE ordering_positions
           SET next_seq = next_seq + 1, holder_operation = NULL, holder_key = NULL,
               held_since = NULL, moved_at = now()
         WHERE scope = pos.scope AND ordering_key = pos.ordering_key
        RETURNING * INTO pos;
    END IF;
    RETURN pos;
END
$$;

-- Decides where each delivery stands in its entity's order, in (scope, key) order so
-- that two workers never deadlock: `run` (it holds the position now, or its record
-- decides: a completed one is a duplicate), `wait` (parked until its turn), `waiting`
-- (a copy of one already parked), `passed` (its number is behind the position: run or
-- skipped), `taken` (another message holds or waits with its number), `conflict` (its
-- key waits with another payload). A NULL sequence means order of arrival.
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
                    UPDATE ordering_positions SET last_seq = greatest(last_seq, p_seq[i])
                     WHERE scope = pos.scope AND ordering_key = pos.ordering_key;
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

-- Moves each entity's position on past a completed holder and releases the delivery
-- whose turn it is now, if one waits and was not released within `p_stale_ms`: it is
-- returned, to be published to its queue. Entities in (scope, key) order.
CREATE OR REPLACE FUNCTION idem_ordering_release(
    p_scope text[], p_key text[], p_stale_ms bigint)
    RETURNS TABLE (scope text, ordering_key text, seq bigint, operation text,
                   idempotency_key text, queue text, body bytea, properties bytea,
                   turn boolean)
    LANGUAGE plpgsql AS $$
DECLARE
    k record;
    pos ordering_positions%ROWTYPE;
BEGIN
    FOR k IN SELECT DISTINCT t.s, t.k FROM unnest(p_scope, p_key) AS t(s, k) ORDER BY t.s, t.k
    LOOP
        SELECT * INTO pos FROM ordering_positions p
         WHERE p.scope = k.s AND p.ordering_key = k.k;
        CONTINUE WHEN NOT FOUND;
        pos := idem_ordering_lock(k.s, k.k, pos.next_seq);
        -- The turn is handed to the delivery waiting for it: it holds the turn now, and
        -- its row stays until it completes (the worker that runs it may die).
        IF pos.holder_key IS NULL THEN
            UPDATE ordering_positions p
               SET holder_operation = w.operation, holder_key = w.idempotency_key,
                   held_since = now()
              FROM ordering_waiting w
             WHERE p.scope = pos.scope AND p.ordering_key = pos.ordering_key
               AND w.scope = pos.scope AND w.ordering_key = pos.ordering_key
               AND w.seq = pos.next_seq;
            SELECT * INTO pos FROM ordering_positions p
             WHERE p.scope = k.s AND p.ordering_key = k.k;
        END IF;
        -- The row whose turn it is (again, when it did not complete: 5 s, doubling up to
        -- 320 s, never while its run holds a live lease), flagged `turn`, and rows whose
        -- turn passed while they waited (an operator skipped it): their copies come back
        -- and are dead-lettered `sequence_passed`, so none is lost in the table.
        RETURN QUERY
            UPDATE ordering_waiting w SET released_at = now(), releases = w.releases + 1
             WHERE w.scope = pos.scope AND w.ordering_key = pos.ordering_key
               AND (w.seq < pos.next_seq
                    OR (w.seq = pos.next_seq AND pos.holder_operation = w.operation
                        AND pos.holder_key = w.idempotency_key))
               AND (w.released_at IS NULL
                    OR (w.released_at < now()
                        - p_stale_ms * (1 << least(w.releases - 1, 6)) * interval '1 millisecond'
                        AND NOT EXISTS (
                            SELECT 1 FROM processed_operations r
                             WHERE r.scope = w.scope AND r.operation = w.operation
                               AND r.idempotency_key = w.idempotency_key
                               AND r.status IN ('processing', 'pending')
                               AND r.lease_expires_at > now())))
            RETURNING w.scope, w.ordering_key, w.seq, w.operation, w.idempotency_key,
                      w.queue, w.body, w.properties, w.seq = pos.next_seq;
    END LOOP;
    -- A lost release is published again by the sweep; a lost move by the next entry.
    PERFORM set_config('synchronous_commit', 'off', true);
END
$$;
