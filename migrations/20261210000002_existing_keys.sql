-- Which of a batch's keys have a record. A transactional batch looks its keys up before
-- its handlers run; most have none, and the statement that takes over or reports
-- existing records is planned at every call (unnamed: a cached generic plan made while
-- the table was small would scan it), 0.8 ms of Postgres a batch. This look-up runs on a
-- cached plan that cannot scan: PL/pgSQL caches it per session, and it is made with
-- sequential scans, hash and merge joins off, so it is a loop of index probes whatever
-- the table held when it was made; it is the generic plan at every call
-- (`plan_cache_mode`: a custom plan for a batch's array would be planned each time). The
-- other statement then runs only for the keys found.
CREATE OR REPLACE FUNCTION idem_existing_keys(p_scope text[], p_operation text[], p_key text[])
    RETURNS SETOF integer
    LANGUAGE plpgsql STABLE
    SET enable_seqscan = off
    SET enable_hashjoin = off
    SET enable_mergejoin = off
    SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN QUERY
        SELECT t.i::integer
          FROM unnest(p_scope, p_operation, p_key) WITH ORDINALITY AS t(s, o, k, i)
         WHERE EXISTS (SELECT 1 FROM processed_operations r
                        WHERE r.scope = t.s AND r.operation = t.o AND r.idempotency_key = t.k);
END
$$;
