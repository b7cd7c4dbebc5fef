-- An operation whose outcome was ever uncertain is never run again without `reconcile`
-- saying "not applied", whatever path leads back to it: a reconcile that failed for
-- good, a result that could not be stored after the effect, a replay, a released
-- lease. `status` alone cannot say it (a pending operation may end `failed`), so the
-- record keeps it. See DESIGN.md, "Pending: reconcile, never re-run blindly".
--
-- Adding a column with a constant default rewrites nothing (PostgreSQL 11+).
ALTER TABLE processed_operations
    ADD COLUMN IF NOT EXISTS reconcile_first boolean NOT NULL DEFAULT false;

-- Operations pending today were uncertain, and so were those that were pending once and
-- then failed (a reconcile that failed for good): they kept the provider's reference or
-- the uncertain error. The unresolved index finds them.
UPDATE processed_operations SET reconcile_first = true
 WHERE status <> 'completed' AND NOT reconcile_first
   AND (status = 'pending' OR external_ref IS NOT NULL OR error->>'kind' = 'uncertain');
