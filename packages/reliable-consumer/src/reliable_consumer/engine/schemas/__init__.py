"""Record values written in a schema registry's wire format, decoded with the writer's schema.

A producer using a schema registry writes a magic byte 0, the writer's schema id (4 bytes,
big-endian) and the payload (``wire.py``). The worker looks the writer's schema up by id,
asynchronously and once per id (``writer_schemas.py`` over ``registry_client.py``), and
decodes the payload with it, resolved to the handler's reader schema (``avro.py``, the
declaration ``RegistryAvro``). It may import the shared modules at the engine's root and
observation; never batch, handlers or the lifecycle, which use it. Needs the ``avro`` extra.
"""
