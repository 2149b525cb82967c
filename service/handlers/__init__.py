"""Business handlers: one module per topic, each declaring one handler with ``@handler``.

The registry imports every module here (names starting with '_' are skipped) and
binds each handler to the topic ``WORKER_TOPICS`` names for it.
"""
