"""The engine: the record's path from fetch to commit, and everything it needs at run time.

Updated from the template (``make template-update``); change it upstream, not here. A
service author's code lives in ``service/handlers/`` and ``service/app.py`` (the app
declaration, ``service.engine.app.App``, which names everything of the service the engine
needs) and imports the handler API from ``service`` itself. The engine imports no module of
the service by a fixed name: it finds the app declaration (``service.engine.app_location``).
It imports nothing from ``service.ops``, ``service.dev`` or ``service.pipeline`` (ruff's
banned-import rule, tests/unit/test_rooms.py).
"""
