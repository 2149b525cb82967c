"""The outbox: records handlers emitted with their effects, and the relay that publishes them.

A store keeps the emitted records where the effects live (a Redis stream written by FINISH,
a PostgreSQL table written in the wave's transaction); the relay reads them in order,
publishes them (Kafka's idempotent producer where the broker grants it), and only then
removes them. It may import the shared modules at the engine's root, handlers (what an
emission is), redis, kafka, postgres and observation; never batch or the lifecycle, which
start it.
"""
