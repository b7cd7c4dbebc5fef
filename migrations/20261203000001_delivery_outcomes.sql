-- What became of the deliveries, counted per minute by the workers that decided them
-- (docs/DESIGN.md, "Operator console"): the console charts executed, duplicates,
-- retried and dead-lettered from here, without a metrics server. A duplicate delivery
-- writes nothing to processed_operations (its claim only reads the record), so the
-- records alone cannot tell how many there were.
--
-- Each worker adds its counts every few seconds, in one statement; rows are shared by
-- every worker of a queue. A tally, not a ledger: a worker killed with SIGKILL takes its
-- last few seconds of counts with it. gc deletes rows after the retention.
CREATE TABLE IF NOT EXISTS delivery_outcomes (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The minute (UTC, truncated) the worker decided the deliveries in.
    minute      timestamptz NOT NULL,
    queue       text        NOT NULL,
    operation   text        NOT NULL,
    -- The outcome label of idem_deliveries_total: executed, duplicate_completed, ...,
    -- and dead_lettered for each dead letter published.
    outcome     text        NOT NULL,
    deliveries  bigint      NOT NULL CHECK (deliveries >= 0),
    expires_at  timestamptz NOT NULL,
    UNIQUE (queue, minute, operation, outcome)
);

CREATE INDEX IF NOT EXISTS delivery_outcomes_expires_at ON delivery_outcomes (expires_at);
