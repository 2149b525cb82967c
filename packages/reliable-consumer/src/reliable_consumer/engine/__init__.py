"""The engine: the record's path from fetch to commit, and everything it needs at run time.

A service's code (its app declaration, ``reliable_consumer.App``, and its handlers) is handed
to the engine, never imported by a fixed name: the engine finds the declaration through
``reliable_consumer.engine.declaration.location``. It imports nothing from
``reliable_consumer.ops``, ``reliable_consumer.dev``, ``reliable_consumer.cli``,
``reliable_consumer.console``, ``reliable_consumer.testing`` or ``reliable_consumer_pipeline``
(ruff's banned-import rule; packages/reliable-consumer/tests/unit/test_rooms.py).
"""
