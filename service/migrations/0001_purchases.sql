-- The purchases ledger of the postgres example handler (service/handlers/purchases.py).
-- One row per grant and per refund. Deliberately no unique constraint on payment_id:
-- exactly-once is the inbox's job (kafka_inbox), and if anything ever granted twice it
-- would show here as two rows instead of being hidden by a constraint.
CREATE TABLE purchases (
    id           bigserial   PRIMARY KEY,
    payment_id   text        NOT NULL,
    kind         text        NOT NULL CHECK (kind IN ('grant', 'refund')),
    user_id      text        NOT NULL,
    product_id   text        NOT NULL,
    amount_minor bigint      NOT NULL,
    currency     char(3)     NOT NULL,
    source       text        NOT NULL,
    granted_at   timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX purchases_payment_id ON purchases (payment_id);

-- What a user owns now: granted and not refunded (the entitlement the Redis example keeps
-- in a hash).
CREATE VIEW entitlements AS
SELECT g.user_id, g.product_id, g.payment_id, g.granted_at
FROM purchases g
WHERE g.kind = 'grant'
  AND NOT EXISTS (
      SELECT 1 FROM purchases r
      WHERE r.kind = 'refund' AND r.payment_id = g.payment_id
  );
