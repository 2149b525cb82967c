"""The handler side: the registry of handlers and their topics, what a handler sees
(``Context`` and the effects it queues), what it declares about failure (retry and breaker
policies), the runner pool and the calls that ignore their cancel, the circuit breakers,
fault injection, and the redaction of what a handler's errors say. It may import the shared
modules at the engine's root, declaration (the app names the handler modules), redis (key
names) and observation (metrics); never batch or the lifecycle.
"""
