"""Redis: the connection and its one policy for "Redis is not answering", URLs, what an
error means, the durability wait and the start-up check of persistence, key names, claims
and done-markers (``idempotency.py``), and the delay queue. It may import the shared modules
at the engine's root, its ``lua/`` room, and handlers (the effects a handler queued, which
FINISH applies); never batch, kafka, postgres, observation or the lifecycle.
"""
