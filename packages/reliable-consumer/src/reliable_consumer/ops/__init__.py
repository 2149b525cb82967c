"""Operator commands: read the group's offsets, redrive dead letters.

Updated from the template. They use the engine (keys, settings, clients); the engine never
imports them.
"""
