-- Records whose next delivery is awaited (a retryable failure or a pending operation of
-- a message, no dead letter, not discarded), for the workers' check that it comes: a
-- classic retry queue dead-letters its copies back at most once, and a copy lost there
-- would leave the record waiting for ever. Not built CONCURRENTLY: that cannot run in
-- the migration's transaction, and outside one it deadlocks with a second worker
-- waiting for the migration lock (seen here). Building it holds off writes to the table
-- for one scan of it.
CREATE INDEX IF NOT EXISTS processed_operations_awaiting_retry
    ON processed_operations (operation, updated_at)
    WHERE expires_at IS NULL AND dead_letters = 0 AND discarded_at IS NULL
      AND (status = 'pending' OR (status = 'failed' AND retryable));
