"""This service's tests: real servers on loopback from the engine's test kit.

``reliable_consumer.testing.fixtures`` gives every test here ``tansu_broker`` (a
Kafka-protocol broker in a wheel), ``redis_url``, ``postgres_url`` (migrated with the inbox
and service/migrations/) and ``unique_name``, each started for the test and stopped after.
"""

pytest_plugins = ["reliable_consumer.testing.fixtures"]
