-- Only the worker ends a wave's transaction (service/engine/inbox.py, docs/postgres.md
-- "What ctx.db is"). A postgres handler's SQL could COMMIT it (COMMIT, END, COMMIT AND CHAIN,
-- PREPARE TRANSACTION sent through ctx.db) without any call the worker could refuse; here
-- such a commit fails, and the whole wave's transaction rolls back with it.
--
-- Each wave's transaction inserts one row here as it begins. The row's deferred constraint
-- trigger runs at COMMIT (and PREPARE TRANSACTION, and SET CONSTRAINTS ... IMMEDIATE) and
-- raises unless the worker, in the statement string that ends with its own COMMIT, said so
-- (set_config('kafka_inbox.commit', <the wave's txid>, true)). The worker deletes the row in
-- that same string (the trigger still runs for it), so the table stays empty; UNLOGGED, it
-- costs no WAL.
--
-- SQLSTATEs (class KI: the kafka inbox), raised here and by kafka_inbox_guard below:
--   KI001  the session is in another transaction than the wave's: a handler ended it;
--   KI002  a record's savepoint marker outlived the worker's rollback to that savepoint:
--          the handler replaced the savepoint, taking its earlier work out of reach;
--   KI003  a COMMIT the worker did not send.
CREATE UNLOGGED TABLE kafka_inbox_wave (
    wave_xid bigint PRIMARY KEY  -- txid_current() of the wave's transaction
);

CREATE FUNCTION kafka_inbox_wave_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('kafka_inbox.commit', true) IS DISTINCT FROM NEW.wave_xid::text THEN
        RAISE EXCEPTION 'only the worker commits a wave''s transaction: a postgres handler '
            'must not end, replace or split the worker''s transaction'
            USING ERRCODE = 'KI003';
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER kafka_inbox_wave_commit AFTER INSERT ON kafka_inbox_wave
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION kafka_inbox_wave_commit();

-- Raises when the worker's check failed (the worker tests the condition in plain SQL and calls
-- this only then): wave_xid is the wave's transaction id; mark, when given, is the value the
-- worker's savepoint marker (kafka_inbox.record) must have after a rollback to a record's
-- savepoint.
CREATE FUNCTION kafka_inbox_guard(wave_xid bigint, mark text) RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    IF txid_current() <> wave_xid THEN
        RAISE EXCEPTION 'the wave''s transaction % was ended by a handler (the session is in %)',
            wave_xid, txid_current() USING ERRCODE = 'KI001';
    END IF;
    IF mark IS NOT NULL
            AND current_setting('kafka_inbox.record', true) IS DISTINCT FROM mark THEN
        RAISE EXCEPTION 'a record''s savepoint marker outlived the rollback to its savepoint'
            USING ERRCODE = 'KI002';
    END IF;
    RETURN NULL;
END
$$;
