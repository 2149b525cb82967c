"""Spark jobs over what the worker writes (optional extra: `pip install -e '.[pipeline]'`).

- `source`: Kafka topics as a Spark DataFrame. Spark's official `kafka` format when its
  connector is on the classpath, else `kafka_py`, our Python Data Source (batch and
  streaming) with the same schema and option names. `read_topic()` / `read_topic_stream()`
  pick one.
- `kafka_reader`: the synchronous aiokafka layer under it (high watermarks from Fetch, offset
  and timestamp resolution, range reads); no pyspark import.
- `reconcile`: `run_reconcile(spark, ReconcileConfig(...)) -> ReconcileReport`: every record
  ends granted once or dead-lettered; finds lost, doubled and stuck ones, against the ledger
  the service's app declares.
- `cli`: `pipeline_app`, the typer group mounted as `service pipeline`.
- `spark`: `build_spark()` (Java discovery, loopback-only local defaults).
- `synthetic`: worker output with known problems, for tests, benchmarks and demos.
- `chart`: an optional PNG of a reconcile run.

Nothing here is imported by the worker; importing this package does not import pyspark.
"""
