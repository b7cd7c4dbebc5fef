-- Data protection (DESIGN.md, "Data protection"): keyed fingerprints, erasure
-- tombstones, the keys that sealed stored values, the erasure audit, and retention per
-- operation. New columns are nullable without a default: no table rewrite.
SET LOCAL lock_timeout = '10s';

ALTER TABLE processed_operations
    -- Which key made payload_sha256 (an HMAC); NULL: an unkeyed SHA-256.
    ADD COLUMN IF NOT EXISTS fingerprint_key text,
    -- Set by an erasure: result, error and external_ref are gone, the key and its
    -- fingerprint are kept, so the intent is still recognised and never runs again.
    ADD COLUMN IF NOT EXISTS erased_at timestamptz;

-- Every key that sealed a value or made a fingerprint: a process whose keys do not
-- open a key's check value, or that lacks a key not yet retired, does not start.
CREATE TABLE IF NOT EXISTS idem_keys (
    id            text        PRIMARY KEY,
    -- A constant sealed with the key: proves the configured material is the same.
    check_value   bytea       NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now(),
    -- When a newer key became the one new writes use.
    superseded_at timestamptz,
    -- When `idem keys retire` found nothing left under it.
    retired_at    timestamptz
);

-- Who erased what, when and why: kept until the operator deletes it.
CREATE TABLE IF NOT EXISTS erasures (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    erased_at       timestamptz NOT NULL DEFAULT now(),
    erased_by       text        NOT NULL CHECK (octet_length(erased_by) BETWEEN 1 AND 200),
    scope           text        NOT NULL,
    -- NULL: every key of the scope.
    idempotency_key text,
    note            text        NOT NULL CHECK (octet_length(note) BETWEEN 1 AND 2000),
    records         bigint      NOT NULL,
    follow_ups      bigint      NOT NULL,
    -- Records left alone because they were in flight or pending.
    skipped         bigint      NOT NULL
);

-- How long an operation's completed records are kept, noted by the workers that run
-- it; an operation not listed keeps the store's retention.
CREATE TABLE IF NOT EXISTS operation_retention (
    operation    text        PRIMARY KEY,
    retention_ms bigint      NOT NULL CHECK (retention_ms > 0),
    noted_at     timestamptz NOT NULL DEFAULT now()
);
