"""The engine: the record's path from fetch to commit, and everything it needs at run time.

Its root holds the lifecycle (``worker.py``, ``intake.py``, ``startup.py``, ``shutdown.py``,
``runtime.py``, ``memory_limit.py``), which starts, runs and stops the rest, and the few
modules every room shares (``settings.py``, ``errors.py``, ``records.py``, ``stalls.py``,
``outages.py``, ``until_done.py``). The rest lives in rooms named by what they hold:
``declaration/``, ``batch/``, ``handlers/``, ``redis/`` (with ``redis/lua/``), ``kafka/``,
``postgres/`` and ``observation/``; each room's ``__init__`` says what it may import, and
packages/reliable-consumer/tests/unit/test_rooms.py holds the whole table. The rooms'
``__init__`` modules import nothing: the template's generation hook imports
``declaration/naming.py`` where the library's dependencies are not installed.

A service's code (its app declaration, ``reliable_consumer.App``, and its handlers) is handed
to the engine, never imported by a fixed name: the engine finds the declaration through
``reliable_consumer.engine.declaration.location``. It imports nothing from
``reliable_consumer.ops``, ``reliable_consumer.dev``, ``reliable_consumer.cli``,
``reliable_consumer.console``, ``reliable_consumer.testing`` or ``reliable_consumer_pipeline``
(ruff's banned-import rule; packages/reliable-consumer/tests/unit/test_rooms.py).
"""
