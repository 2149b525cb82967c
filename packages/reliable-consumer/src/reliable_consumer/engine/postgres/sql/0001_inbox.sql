-- The inbox of the postgres effects store (service/engine/inbox.py): one row per record
-- whose effects committed, written in the same transaction as the handler's own SQL.
-- A second delivery of the same (handler, dedupe key) finds its row: a duplicate when the
-- payload's fingerprint matches, a conflict (dead-lettered) when it does not.
-- Rows are kept until `service db prune-inbox` removes them (docs/postgres.md, Retention).
CREATE TABLE kafka_inbox (
    handler       text        NOT NULL,
    dedupe_key    text        NOT NULL,
    fingerprint   text        NOT NULL,
    topic         text        NOT NULL,
    partition     integer     NOT NULL,
    record_offset bigint      NOT NULL,
    attempt       integer     NOT NULL,
    processed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (handler, dedupe_key)
);

CREATE INDEX kafka_inbox_processed_at ON kafka_inbox (processed_at);
