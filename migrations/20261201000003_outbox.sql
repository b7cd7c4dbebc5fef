-- The transactional outbox (DESIGN.md, "Follow-up messages"): a handler's follow-up
-- messages, staged in the transaction that records its outcome, published after the
-- commit and kept until their retention ends.

CREATE SEQUENCE IF NOT EXISTS outbox_messages_take_seq;

CREATE TABLE IF NOT EXISTS outbox_messages (
    -- Staging order: an operation's messages get increasing ids in one transaction.
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Derived from the source operation's key and the position; the AMQP message_id of
    -- every publish of this row, so a downstream consumer dedupes a republished copy.
    message_id     text        NOT NULL,
    -- The source operation: its key digest (64 hex digits) and operation name.
    source         text        NOT NULL CHECK (source ~ '^[0-9a-f]{64}$'),
    operation      text        NOT NULL,
    position       integer     NOT NULL CHECK (position >= 0),
    exchange       text        NOT NULL,
    routing_key    text        NOT NULL,
    body           bytea       NOT NULL,
    -- content_type, type, correlation_id and headers, as JSON.
    properties     jsonb       NOT NULL,
    staged_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- When a relay may take the row: shortly after staging (the committing worker
    -- publishes it first), then after each take the lease of whoever took it, then
    -- after a failed publish the backoff.
    available_at   timestamptz NOT NULL,
    -- The last take's token, from outbox_messages_take_seq (0: never taken). It only
    -- grows, and a publisher writes a failure or a give-back only on the row as it
    -- took it.
    take_token     bigint      NOT NULL DEFAULT 0,
    -- Failed publishes (the backoff grows with them).
    attempts       integer     NOT NULL DEFAULT 0,
    -- Why the last publish failed (the broker's reason for a returned message).
    last_error     text,
    dispatched_at  timestamptz,
    -- Set with dispatched_at; gc deletes the row after it.
    expires_at     timestamptz,
    CHECK ((dispatched_at IS NULL) = (expires_at IS NULL))
);

-- The relay's scan, and the operators' backlog: undispatched rows only.
CREATE INDEX IF NOT EXISTS outbox_messages_undispatched
    ON outbox_messages (id) WHERE dispatched_at IS NULL;
-- Per-operation ordering: an operation's earlier, undispatched messages.
CREATE INDEX IF NOT EXISTS outbox_messages_source
    ON outbox_messages (source, position) WHERE dispatched_at IS NULL;
-- gc.
CREATE INDEX IF NOT EXISTS outbox_messages_expires
    ON outbox_messages (expires_at) WHERE expires_at IS NOT NULL;

-- Wakes the relays when a transaction that staged messages commits (one notification
-- per statement; Postgres folds identical ones of a transaction into one).
CREATE OR REPLACE FUNCTION outbox_messages_notify() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idem_outbox', '');
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS outbox_messages_notify ON outbox_messages;
CREATE TRIGGER outbox_messages_notify
    AFTER INSERT ON outbox_messages
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_messages_notify();

-- Like processed_operations, a queue-like table.
ALTER TABLE outbox_messages SET (
    autovacuum_vacuum_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.05
);
