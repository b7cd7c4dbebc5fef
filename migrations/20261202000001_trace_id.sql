-- The trace an operation ran in (32 hex digits of a W3C trace id), so that an operator
-- who finds a stuck key or a dead letter is one lookup away from its trace
-- (docs/DESIGN.md, "Traces"). Set by the claim that inserts or takes the record; NULL
-- when the delivery or request carried no trace context and none was made.
--
-- A nullable column without a default rewrites nothing.
ALTER TABLE processed_operations ADD COLUMN IF NOT EXISTS trace_id text;
