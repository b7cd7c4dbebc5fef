-- Validates the fingerprint check added NOT VALID by the previous migration. In its own
-- migration (and transaction) so the scan takes only a SHARE UPDATE EXCLUSIVE lock:
-- workers keep claiming and completing while a large table is checked.
ALTER TABLE processed_operations VALIDATE CONSTRAINT processed_operations_payload_sha256_check;
