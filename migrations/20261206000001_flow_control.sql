-- Flow control (DESIGN.md, "Flow control"): circuit breakers and limits, shared by every
-- worker process through this database.

-- One row per circuit breaker (a queue's). Workers open it when their handler's
-- transient failures reach the threshold, take turns at the one probe a half-open
-- circuit lets through, and close it when the probe succeeds (or an operator does).
-- `generation` counts the transitions: a probe's close or reopen is fenced by the one
-- its take wrote, so a probe whose turn ran out cannot decide for the next one.
CREATE TABLE IF NOT EXISTS flow_circuits (
    name        text        PRIMARY KEY,
    state       text        NOT NULL DEFAULT 'closed'
                            CHECK (state IN ('closed', 'open', 'half_open')),
    generation  bigint      NOT NULL DEFAULT 0,
    -- Opens since it last closed: the backoff's step.
    opens       integer     NOT NULL DEFAULT 0,
    -- Open: when the next probe may go. Half-open: when the probe's turn ends.
    retry_at    timestamptz,
    -- The failure that opened it, or the operator's note that closed it.
    reason      text,
    changed_at  timestamptz NOT NULL DEFAULT now()
);

-- A limit's concurrency permits: `slot` 0..N-1 per limit, each free (no holder) or held
-- until `held_until`, which its holder renews; a worker that dies holding one loses it
-- when that time passes. `token` fences the release and renewals of an earlier holder.
CREATE TABLE IF NOT EXISTS flow_permits (
    name        text        NOT NULL,
    slot        integer     NOT NULL,
    holder      text,
    held_until  timestamptz,
    token       bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (name, slot)
);

-- A limit's calls per second: R slots per limit, each the time of one call; a call takes
-- a slot last used over a second ago, so no second (sliding, by the database's clock)
-- holds more than R calls.
CREATE TABLE IF NOT EXISTS flow_rate_slots (
    name        text        NOT NULL,
    slot        integer     NOT NULL,
    used_at     timestamptz NOT NULL DEFAULT 'epoch',
    PRIMARY KEY (name, slot)
);
