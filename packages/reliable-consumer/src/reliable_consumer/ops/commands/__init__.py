"""The operator CLI's commands (``service status``, ``dlq``, ``retries``, ``trace``, ``offsets``,
``db``): arguments, tables, exit codes and the one-line errors an operator reads.

Each command parses what the operator typed and hands it to the operation it names in
``reliable_consumer.ops`` (redrive, retry_admin, status, trace, ...), which the console
calls too; what an action moved is audited through ``actions.py``. Nothing in the rest of
``reliable_consumer.ops`` imports this room.
"""
