-- A record is pinned while dead letters of it may wait in a DLQ: counted, not flagged,
-- because a key can have more than one (a duplicate that met the failed record before
-- its pin landed; a producer's duplicate that re-ran a retryable failure), and counted
-- before the publish, so that a crash between the two leaves a pin and never a letter
-- without one. Replaying or discarding a letter takes one away; gc keeps the record
-- while any is left. A crash between the count and the publish leaves one too many:
-- the record is kept, never lost.
ALTER TABLE processed_operations
    ADD COLUMN IF NOT EXISTS dead_letters integer NOT NULL DEFAULT 0;

UPDATE processed_operations SET dead_letters = 1
 WHERE dead_lettered_at IS NOT NULL AND dead_letters = 0;
