-- Which operations the workers of each queue run, noted by every worker as it starts:
-- the console releases and resolves only records of its queues' operations.
CREATE TABLE IF NOT EXISTS queue_operations (
    queue      text        NOT NULL,
    operation  text        NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, operation)
);
