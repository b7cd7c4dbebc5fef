-- Delayed follow-ups (DESIGN.md, "Follow-up messages"): a message staged with a time
-- it must not be published before ("send the reminder in 24 h"). Until then it is
-- scheduled: no publisher takes it, it holds no later message of its operation back,
-- and the backlog's age does not count it.
ALTER TABLE outbox_messages ADD COLUMN IF NOT EXISTS not_before timestamptz;

-- The relays take due rows, and sleep until the next one, through this index instead of
-- scanning every undispatched row (scheduled ones may be many, and far ahead). Built in
-- the migration's transaction: it holds off writes to the outbox for one scan of it.
CREATE INDEX IF NOT EXISTS outbox_messages_due
    ON outbox_messages (available_at) WHERE dispatched_at IS NULL;
