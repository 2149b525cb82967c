"""The Lua scripts of the delay queue: PARK, CLAIM_DUE and REAP.

Retry queue: ``due`` (ZSET id -> due ms), ``inflight`` (ZSET id -> lease deadline ms;
the deadline doubles as the fencing token of the claim), ``items`` (HASH id -> JSON), and
one ``chain`` per Kafka key with records waiting (LIST of ids in offset order; only its
head is due or in flight, the rest wait in ``items`` until drop_item releases them).
Both times are on Redis's clock (TIME inside the scripts), never a host's.
"""

from __future__ import annotations

from reliable_consumer.engine.redis.lua.common import NOW, PARSE

# park_one(): one record into the queue whose keys are given, its chain already resolved
# ('' for none); the per-record body of PARK and of the sharded layout's PARK (which names
# its chains in KEYS). Needs PARSE (chain_head, tally) and NOW.
#   lease '' for a fresh delivery (park unless already parked), else the fencing
#   deadline of the retry claim being rescheduled. delay_ms and lease are strings.
#   The item is due at Redis's now + delay_ms.
#   chain: the key of the record's Kafka-key chain ('' for none). A fresh record joins the
#   end of it; it is due only when it is the chain's head (first), otherwise it waits,
#   not scheduled, until the records before it leave the queue (drop_item releases it).
#   handler, reason: the item's class in the tally (lua_common.tally): 'handler|reason', or
#   'handler|blocked' while it waits in its chain; a re-park moves it to its new class.
# Returns parked | exists | lost_lease | blocked (parked, waiting in its chain).
PARK_ONE = """
local function park_one(inflight, due, items, now, r, chain)
  local id, item, delay_ms, lease = r[1], r[2], r[3], r[6]
  local class = (r[8] or '') .. '|' .. (r[9] or 'unknown')
  local due_ms = string.format('%d', now + tonumber(delay_ms))
  if lease == '' then
    if redis.call('HEXISTS', items, id) == 1 then
      return 'exists'
    elseif chain ~= '' then
      local waiting = chain_head(chain, inflight, due, items)
      redis.call('HSET', items, id, item)
      redis.call('RPUSH', chain, id)
      if waiting then
        tally(items, id, (r[8] or '') .. '|blocked')
        return 'blocked'
      end
      redis.call('ZADD', due, due_ms, id)
      tally(items, id, class)
      return 'parked'
    end
    redis.call('HSET', items, id, item)
    redis.call('ZADD', due, due_ms, id)
    tally(items, id, class)
    return 'parked'
  end
  local score = redis.call('ZSCORE', inflight, id)
  if (not score) or tonumber(score) ~= tonumber(lease) then
    return 'lost_lease'
  end
  redis.call('ZREM', inflight, id)
  redis.call('HSET', items, id, item)
  redis.call('ZADD', due, due_ms, id)
  tally(items, id, class)
  return 'parked'
end
"""

# KEYS: inflight, due, items
# ARGV[1]: [[id, item_json, delay_ms, idem_key, token, lease, chain, handler, reason], ...]
#   (park_one above says what each means); the record's claim (idem_key, token) is
#   released after it is parked, if still ours.
# Returns per record: parked | exists | lost_lease | blocked (parked, waiting in its chain)
PARK = (
    PARSE
    + NOW
    + PARK_ONE
    + """
local now = now_ms()
local out = {}
for _, r in ipairs(cjson.decode(ARGV[1])) do
  out[#out + 1] = park_one(KEYS[1], KEYS[2], KEYS[3], now, r, r[7])
  release(r[4], r[5])
end
return out
"""
)

# KEYS: due, inflight, items; ARGV: lease_ms, limit (0: claim nothing, only measure). Due
# and lease times are Redis's TIME.
# Returns a flat list: id, lease deadline, item json, ..., and last how late (ms) the oldest
# item still due after the claim is (0: none due). Heads released at score 0 by earlier
# versions carry no moment and are left out of it, as the gauges leave them out.
CLAIM_DUE = (
    NOW
    + """
local now = now_ms()
local nowtext = string.format('%d', now)
local out = {}
if tonumber(ARGV[2]) > 0 then
  local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', nowtext, 'LIMIT', 0, ARGV[2])
  local deadline = string.format('%d', now + tonumber(ARGV[1]))
  for _, id in ipairs(ids) do
    redis.call('ZREM', KEYS[1], id)
    local item = redis.call('HGET', KEYS[3], id)
    if item then
      redis.call('ZADD', KEYS[2], deadline, id)
      out[#out + 1] = id
      out[#out + 1] = deadline
      out[#out + 1] = item
    end
  end
end
local head = redis.call('ZRANGEBYSCORE', KEYS[1], '(0', nowtext, 'WITHSCORES', 'LIMIT', 0, 1)
local late = 0
if head[2] then late = now - tonumber(head[2]) end
out[#out + 1] = late
return out
"""
)

# KEYS: due, inflight; ARGV: limit. Retry leases past Redis's TIME go back to the queue.
REAP = (
    NOW
    + """
local now = string.format('%d', now_ms())
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, ARGV[1])
for _, id in ipairs(ids) do
  redis.call('ZREM', KEYS[2], id)
  redis.call('ZADD', KEYS[1], now, id)
end
return #ids
"""
)
