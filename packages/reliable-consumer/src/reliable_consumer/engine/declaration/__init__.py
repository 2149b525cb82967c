"""What a service declares, and how the engine finds it: the app declaration (``App``), the
ledger and demo samples it may name, the name rules its fields follow, and where the
declaration is named (``--app``, ``WORKER_APP``, ``[tool.service] app``). It imports only
``engine/errors.py``: every room may read a declaration, and a declaration needs nothing of
the engine's machinery (``naming.py`` needs only the standard library: the template's
generation hook imports it where the library's dependencies are not installed).
"""
