"""What the worker says about itself: its metrics, the health and metrics HTTP server, its
log lines, the report each member writes to Redis for ``service status``, the
``unassigned`` stall of a member the group leaves out, and (the ``otel`` extra) an
OpenTelemetry span per record. It may import the shared modules at
the engine's root, handlers (redaction), redis (key names) and kafka (clients, the group
check, offsets); never batch or the lifecycle.
"""
