-- Operating idem: an operator's decision to discard a dead letter is kept on its record.
ALTER TABLE processed_operations ADD COLUMN IF NOT EXISTS discarded_at timestamptz;
