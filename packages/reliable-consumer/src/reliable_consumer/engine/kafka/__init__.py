"""Kafka: clients built from settings, what the worker writes (dead letters and outcome
events, and the outcome events' wire format), the start-up checks of those topics and of
the group's session timeout, and which offset of a partition may be committed. It may
import the shared modules at the engine's root, redis (long dedupe keys written as digests)
and handlers (redaction of error text); never batch, postgres, observation or the lifecycle.
"""
