"""Every core of a pod: N workers in one container under one supervisor (`service run
--processes N`). The supervisor starts the workers, restarts one that dies or stops being
live, stops them all on SIGTERM, and serves the pod's one health and metrics endpoint,
gathered from theirs. It may import the shared modules at the engine's root and
observation (the HTTP server); never a worker's rooms: it runs none of the record path.
"""
