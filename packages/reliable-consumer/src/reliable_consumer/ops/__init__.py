"""Operator tools: what an operator reads and does, shared by the CLI and the console.

The operations (status, trace, the delay queue's and dead letters' views, redrive, offsets
reset, the audit log) live here; ``commands/`` is the CLI's own room, which calls them. They
use the engine (keys, settings, clients); the engine never imports them. Updated with the
library, never edited in a service.
"""
