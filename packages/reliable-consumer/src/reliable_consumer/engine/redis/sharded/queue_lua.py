"""The delay queue's scripts for one order shard: every key a script touches is in KEYS.

The sharded layout (docs/redis-cluster.md, stage 2) keeps one delay queue per order shard,
each on the keys of that shard's tag, so every script here runs in one slot. PARK differs
from the single Redis's in two ways: a record's chain is named in KEYS (a key built or
passed in ARGV cannot be routed on a cluster), and it releases no claim (the gate's RELEASE
does, in the gate shard). CLAIM_DUE and REAP are the single Redis's own: their keys were
always all in KEYS. SURVEY and GAUGES are the reads the scheduler asks of every shard.
"""

from __future__ import annotations

from reliable_consumer.engine.redis.lua import delay_queue
from reliable_consumer.engine.redis.lua.common import NOW, PARSE
from reliable_consumer.engine.redis.sharded.calls import LuaScript

# KEYS: inflight, due, items, class, counts (the shard's queue and its tally, which the
#   tally's functions name from items), then the records' chains.
# ARGV[1]: [[id, item_json, delay_ms, '', '', lease, chain i, handler, reason], ...]:
#   PARK's records (lua/delay_queue.py, park_one) with the chain as its position in KEYS
#   (0: none) and no claim to release.
# Returns per record: parked | exists | lost_lease | blocked
PARK = LuaScript(
    PARSE
    + NOW
    + delay_queue.PARK_ONE
    + """
local now = now_ms()
local out = {}
for _, r in ipairs(cjson.decode(ARGV[1])) do
  local chain = ''
  if tonumber(r[7]) > 0 then chain = KEYS[tonumber(r[7])] end
  out[#out + 1] = park_one(KEYS[1], KEYS[2], KEYS[3], now, r, chain)
end
return out
"""
)

# KEYS: due, inflight, items; ARGV: lease_ms, limit. See lua/delay_queue.py.
CLAIM_DUE = LuaScript(delay_queue.CLAIM_DUE)

# KEYS: due, inflight; ARGV: limit. See lua/delay_queue.py.
REAP = LuaScript(delay_queue.REAP)

# KEYS: due. What a claim round asks each shard first, to share its limit among the shards
# with due items: {how many are due now, how late (ms) the oldest of them is (0: none; heads
# released at score 0 carry no moment, as CLAIM_DUE leaves them out), the earliest due time
# ('' when the queue is empty), the shard's now}. All on the shard's clock.
SURVEY = LuaScript(
    NOW
    + """
local now = now_ms()
local nowtext = string.format('%d', now)
local count = redis.call('ZCOUNT', KEYS[1], '-inf', nowtext)
local late = 0
local oldest = redis.call('ZRANGEBYSCORE', KEYS[1], '(0', nowtext, 'WITHSCORES', 'LIMIT', 0, 1)
if oldest[2] then late = now - tonumber(oldest[2]) end
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {count, late, head[2] or '', nowtext}
"""
)

# KEYS: due, inflight, items, counts. The shard's gauges: {due, in flight, items, the oldest
# due time above 0 ('' when none), the shard's now, then the tally's fields and counts}.
GAUGES = LuaScript(
    NOW
    + """
local head = redis.call('ZRANGEBYSCORE', KEYS[1], '(0', '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
local out = {
  redis.call('ZCARD', KEYS[1]),
  redis.call('ZCARD', KEYS[2]),
  redis.call('HLEN', KEYS[3]),
  head[2] or '',
  string.format('%d', now_ms()),
}
for _, v in ipairs(redis.call('HGETALL', KEYS[4])) do out[#out + 1] = v end
return out
"""
)
