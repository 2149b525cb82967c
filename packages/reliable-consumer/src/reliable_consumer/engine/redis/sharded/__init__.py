"""The sharded layout on a Redis Cluster (docs/redis-cluster.md, stage 2)."""
