-- no-transaction
-- Records whose next delivery is awaited (a retryable failure or a pending operation of
-- a message, no dead letter, not discarded), for the workers' check that it comes: a
-- classic retry queue dead-letters its copies back at most once, and a copy lost there
-- would leave the record waiting for ever. Built concurrently: the table may be large
-- and live.
CREATE INDEX CONCURRENTLY IF NOT EXISTS processed_operations_awaiting_retry
    ON processed_operations (operation, updated_at)
    WHERE expires_at IS NULL AND dead_letters = 0 AND discarded_at IS NULL
      AND (status = 'pending' OR (status = 'failed' AND retryable));
