"""A batch on the record path: its records decoded, their dedupe keys claimed, the circuit
breakers' gate passed, the handlers run (the postgres ones in one transaction per wave),
and each record's fate decided and made durable before the batch returns (and, with
tracing on, told to the record's span). It may import the
shared modules at the engine's root and the handlers, redis, kafka, postgres and
observation rooms; never the lifecycle (``worker.py``, ``intake.py``, ...), which drives it.
"""
