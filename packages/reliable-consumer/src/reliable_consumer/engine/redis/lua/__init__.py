"""The Lua scripts the record path runs in Redis (CLAIM, FINISH, MARK_DEAD, PARK, CLAIM_DUE,
REAP, ...), as Python strings, and the fragments they share. It imports nothing outside
this room: a script depends on Redis alone, and what it is sent is its caller's business.
"""
