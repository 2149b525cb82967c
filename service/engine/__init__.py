"""The engine: the record's path from fetch to commit, and everything it needs at run time.

Updated from the template (``make template-update``); change it upstream, not here. A
service author's code lives in ``service/handlers/`` and ``service/project.py`` and imports
the handler API from ``service`` itself. The engine imports nothing from ``service.ops``,
``service.dev`` or ``service.pipeline`` (ruff's banned-import rule, tests/unit/test_rooms.py).
"""
