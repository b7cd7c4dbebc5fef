-- One row per logical operation (intent): the record that decides every delivery.
-- See DESIGN.md, "The record".

CREATE SEQUENCE IF NOT EXISTS processed_operations_lease_token_seq;

CREATE TABLE IF NOT EXISTS processed_operations (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope            text        NOT NULL CHECK (octet_length(scope) BETWEEN 1 AND 200),
    operation        text        NOT NULL CHECK (octet_length(operation) BETWEEN 1 AND 200),
    idempotency_key  text        NOT NULL CHECK (octet_length(idempotency_key) BETWEEN 1 AND 500),
    -- SHA-256 of the payload's canonical JSON, hex.
    payload_sha256   text        NOT NULL CHECK (payload_sha256 ~ '^[0-9a-f]{64}$'),
    status           text        NOT NULL
                     CHECK (status IN ('processing', 'completed', 'failed', 'pending')),
    retryable        boolean     NOT NULL DEFAULT false,
    attempts         integer     NOT NULL DEFAULT 1 CHECK (attempts >= 1),
    -- Fencing token: a fresh value from the sequence on every claim or takeover, so it
    -- only grows; every outcome write is conditional on it.
    lease_token      bigint      NOT NULL,
    lease_expires_at timestamptz,
    owner            text,
    result           jsonb,
    error            jsonb,
    external_ref     text,
    correlation_id   text,
    message_id       text,
    -- Set once the message was published to the DLQ (confirmed); the record is pinned
    -- while its dead letter waits there.
    dead_lettered_at timestamptz,
    replay_count     integer     NOT NULL DEFAULT 0,
    last_replayed_at timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz,
    -- NULL = kept (in flight, failed or pending: pinned until resolved).
    expires_at       timestamptz,
    CONSTRAINT processed_operations_key UNIQUE (scope, operation, idempotency_key)
);

-- The claim path uses the unique constraint's index; outcome writes use the primary key.
-- Retention: only rows that can expire.
CREATE INDEX IF NOT EXISTS processed_operations_expires_at
    ON processed_operations (expires_at)
    WHERE expires_at IS NOT NULL;

-- Stuck and unresolved operations, oldest first.
CREATE INDEX IF NOT EXISTS processed_operations_unresolved
    ON processed_operations (status, lease_expires_at)
    WHERE status <> 'completed';
