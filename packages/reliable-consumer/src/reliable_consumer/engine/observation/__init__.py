"""What the worker says about itself: its metrics, the health and metrics HTTP server, its
log lines, the report each member writes to Redis for ``service status``, and the
``unassigned`` stall of a member the group leaves out. It may import the shared modules at
the engine's root, handlers (redaction), redis (key names) and kafka (clients, the group
check, offsets); never batch or the lifecycle.
"""
