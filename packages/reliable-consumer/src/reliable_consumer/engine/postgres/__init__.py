"""PostgreSQL, the effects store of handlers declared ``store="postgres"``: the inbox and the
wave's transaction it holds, the schema and its migrations (``sql/``, package data whose
bytes never change: a database records each applied file's sha256), and the start-up checks
of the server. It may import only the shared modules at the engine's root and declaration
(the app's migrations folder): never batch, the lifecycle, or another room's store.
"""
