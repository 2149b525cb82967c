"""The sharded gate (stage 2 of Redis Cluster support, docs/redis-cluster.md): a service's
dedupe gates spread over S gate shards and its effects over S order shards, each a hash tag,
every script touching one slot. The worker does not use this room yet: it is the protocol's
core (layout, scripts, the gate's calls, the janitor), to be wired into the record path later.
"""
