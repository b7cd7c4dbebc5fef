-- processed_operations is a queue-like table: records are inserted, completed and, after
-- the retention, deleted at about the same rate. Vacuum and analyze it once 5 % of it
-- changed (Postgres's defaults wait for 20 %), so the space of deleted records is reused
-- before the table grows, and the planner's row counts follow gc's large deletes.
-- Fillfactor stays 100: a completion changes indexed columns (status, expires_at), so it
-- is never a HOT update and free room left in each page would only be wasted.
--
-- The ALTER takes a SHARE UPDATE EXCLUSIVE lock: it waits for a vacuum running on the
-- table, but neither it nor its wait blocks the workers' reads and writes.
ALTER TABLE processed_operations SET (
    autovacuum_vacuum_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.05
);
