"""The servers a developer or a test runs on loopback: brokers, Redis, PostgreSQL, a proxy.

``process.py`` is one server process started and stopped by mirakuru (and dying with its
owner), ``mark.py`` the mark on such a process that no other process's exit matches;
``broker.py`` is what the tools need from any Kafka broker, met by the embedded Tansu
(``tansu.py``) and by Apache Kafka from Maven (``apache_kafka.py`` and its pom);
``redis_server.py`` and ``postgres_server.py`` are the embedded Redis and PostgreSQL,
``redis_cluster.py`` a Redis Cluster made of embedded Redis nodes, ``toxiproxy.py`` the proxy
the network-fault tests cut, and ``downloads.py`` the cache the fetched binaries share. The
rest of ``reliable_consumer.dev`` (the demo, the dev stack, the scaffold) uses them; nothing
here imports it back.
"""
