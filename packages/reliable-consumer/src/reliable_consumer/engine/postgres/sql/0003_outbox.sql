-- The outbox of the postgres effects store (reliable_consumer/engine/outbox/postgres_store.py):
-- the records a handler emitted (ctx.emit), inserted inside the record's savepoint after its
-- handler returned, so they commit with its inbox row and its effects or not at all. A record
-- rolled back to its savepoint (a failure), a duplicate, a conflict or a parked record leaves
-- none. The relay publishes the rows in id order and sets published_at once Kafka acknowledged
-- them; published rows are kept for trace for WORKER_POSTGRES__OUTBOX_RETENTION_H hours, then
-- deleted in bounded batches (docs/postgres.md, Retention).
CREATE TABLE kafka_outbox (
    id            bigserial   PRIMARY KEY,  -- the order the relay publishes in
    event_id      text        NOT NULL UNIQUE,  -- the event-id header of every copy
    topic         text        NOT NULL,
    key           bytea,
    value         bytea       NOT NULL,
    header_names  text[]      NOT NULL DEFAULT '{}',
    header_values bytea[]     NOT NULL DEFAULT '{}',
    handler       text        NOT NULL,
    written_at    timestamptz NOT NULL DEFAULT now(),
    published_at  timestamptz
);

-- What the relay reads (the oldest unpublished first) and what the depth counts, small
-- whatever the published history kept for trace.
CREATE INDEX kafka_outbox_pending ON kafka_outbox (id) WHERE published_at IS NULL;
-- What retention deletes: the oldest published rows.
CREATE INDEX kafka_outbox_published_at ON kafka_outbox (published_at)
    WHERE published_at IS NOT NULL;
