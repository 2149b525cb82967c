-- The worker's proof that a postgres handler left the wave's transaction as it found it
-- (service/engine/inbox.py, docs/postgres.md "What ctx.db is"). A handler's SQL can end the
-- transaction (COMMIT, ROLLBACK, END, PREPARE TRANSACTION) or undo the worker's savepoint
-- without any call the worker could refuse; these functions catch it in the statements the
-- worker sends anyway, and raise, so that what follows in the same statement string (the
-- RELEASE of the record's savepoint, the wave's COMMIT) never runs.
--
-- SQLSTATEs (class KI: the kafka inbox):
--   KI001  the session is in another transaction than the wave's: the handler ended it;
--   KI002  the record's inbox row is gone: the handler rolled back the worker's savepoint;
--   KI003  the row outlived the worker's rollback to its savepoint: the handler replaced the
--          savepoint, taking its earlier work out of the rollback's reach.

-- wave_xid: txid_current() as the wave's transaction began; row_handler, row_key: the record
-- whose handler just ran (NULL: check the transaction only); row_expected: whether its inbox
-- row must be there (true after its handler returned: the row was inserted in its savepoint;
-- false once the worker rolled back to that savepoint).
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

-- A record's step into the wave, in its new savepoint: first the proof for the last record
-- whose handler ran (wave_xid NULL: this is the wave's first record; last_handler NULL: no
-- handler ran since the last proof), then the record's inbox row. Returns whether the row
-- was inserted (false: one exists, a duplicate or a conflict) and the wave's transaction id.
-- A function rather than a statement of the worker's: PostgreSQL keeps its plans for the
-- session, where a statement sent for each record would be planned for each record.
CREATE FUNCTION kafka_inbox_enter(
    row_handler text, row_key text, row_fingerprint text, row_topic text, row_partition integer,
    row_offset bigint, row_attempt integer, wave_xid bigint, last_handler text, last_key text
) RETURNS TABLE (inserted boolean, transaction_id bigint) LANGUAGE plpgsql AS $$
BEGIN
    IF wave_xid IS NOT NULL AND (
        txid_current() <> wave_xid OR (last_handler IS NOT NULL AND NOT EXISTS (
            SELECT 1 FROM kafka_inbox WHERE handler = last_handler AND dedupe_key = last_key
        ))
    ) THEN
        PERFORM kafka_inbox_guard(wave_xid, last_handler, last_key, true);
    END IF;
    INSERT INTO kafka_inbox (handler, dedupe_key, fingerprint, topic, partition, record_offset,
                             attempt)
    VALUES (row_handler, row_key, row_fingerprint, row_topic, row_partition, row_offset,
            row_attempt)
    ON CONFLICT (handler, dedupe_key) DO NOTHING;
    inserted := FOUND;
    transaction_id := txid_current();
    RETURN NEXT;
END
$$;
