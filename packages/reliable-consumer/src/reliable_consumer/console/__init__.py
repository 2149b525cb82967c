"""The operators' web console (`service console`): a process of its own, read-only by default.

Pages are rendered on the server from the ``reliable_consumer.ops`` functions the CLI uses, so the
console and ``service status`` / ``retries`` / ``dlq`` / ``trace`` / ``audit`` never disagree.
Actions (retry now, drop, redrive) need the token from ``WORKER_CONSOLE__TOKEN``.
"""
