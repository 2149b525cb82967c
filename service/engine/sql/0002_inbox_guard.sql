-- The worker's proof that a postgres handler left the wave's transaction as it found it
-- (service/engine/inbox.py, docs/postgres.md "What ctx.db is"). The worker sends it in the
-- same statement string as the record's RELEASE SAVEPOINT, and before the wave's COMMIT:
-- it raises, so what follows it in that string (the release, the COMMIT) never runs.
--
--   wave_xid      txid_current() as the wave's transaction began;
--   row_handler,  the record whose handler just ran (NULL: check the transaction only);
--   row_key
--   row_expected  whether its inbox row must be there: true after its handler returned
--                 (the row was inserted in its savepoint), false once the worker rolled
--                 back to that savepoint.
--
-- SQLSTATEs (class KI: the kafka inbox): KI001 the session is in another transaction than
-- the wave's (the handler ended it); KI002 the record's inbox row is gone (the handler rolled
-- back the worker's savepoint); KI003 the row outlived the rollback to its savepoint (the
-- handler replaced the savepoint, so its earlier work is out of the worker's reach).
CREATE FUNCTION kafka_inbox_guard(
    wave_xid bigint, row_handler text, row_key text, row_expected boolean
) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF txid_current() <> wave_xid THEN
        RAISE EXCEPTION 'the wave''s transaction % was ended by a handler (the session is in %)',
            wave_xid, txid_current() USING ERRCODE = 'KI001';
    END IF;
    IF row_handler IS NULL THEN
        RETURN;
    END IF;
    IF EXISTS (
        SELECT 1 FROM kafka_inbox WHERE handler = row_handler AND dedupe_key = row_key
    ) <> row_expected THEN
        IF row_expected THEN
            RAISE EXCEPTION 'the record''s inbox row is gone: its savepoint was rolled back'
                USING ERRCODE = 'KI002';
        END IF;
        RAISE EXCEPTION 'the record''s inbox row outlived the rollback of its savepoint'
            USING ERRCODE = 'KI003';
    END IF;
END
$$;
