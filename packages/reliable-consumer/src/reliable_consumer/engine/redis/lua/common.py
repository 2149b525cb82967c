"""Lua fragments every script of the record path shares: state parsing and Redis's clock.

The scripts run a batch per call and are idempotent when re-sent (the reconnect path
re-sends whole calls). Fixed keys travel in KEYS, the batch as one JSON array in ARGV
(decoded with cjson): packing hundreds of separate arguments costs more client CPU than
the script itself. Per-record keys travel inside that array, which is fine on a
standalone Redis or a primary with replicas.
"""

from __future__ import annotations

# parse(): a dedupe key's value (redis/lua/claims.py lists its states) as kind and two fields.
# release(): drop a claim only while it is still ours.
PARSE = """
local function parse(v)
  if not v then return nil, nil, nil end
  local kind = string.sub(v, 1, 1)
  local rest = string.sub(v, 3)
  local bar = string.find(rest, '|', 1, true)
  if not bar then return kind, rest, '' end
  return kind, string.sub(rest, 1, bar - 1), string.sub(rest, bar + 1)
end
local function release(key, token)
  if token == '' or key == '' then return end
  local v = redis.call('GET', key)
  if v and string.sub(v, 1, 3 + #token) == 'c|' .. token .. '|' then
    redis.call('DEL', key)
  end
end
-- chain_head(): the record a key's chain waits on (nil when none waits). Ids whose item
-- is gone are dropped, and the head is made due (now, on Redis's clock: at once, and the
-- oldest-due age measures from its release) unless it already is or runs, so a chain
-- never waits on nothing. TIME after a write is fine: effects replication (Redis 5+).
local function chain_head(chain, inflight, due, items)
  while true do
    local head = redis.call('LINDEX', chain, 0)
    if not head then return nil end
    if redis.call('HEXISTS', items, head) == 1 then
      if not redis.call('ZSCORE', due, head) and not redis.call('ZSCORE', inflight, head) then
        local t = redis.call('TIME')
        local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
        redis.call('ZADD', due, string.format('%d', now), head)
      end
      return head
    end
    redis.call('LPOP', chain)
  end
end
-- The reason-class tally (redis.delay_queue.reason_class), kept exact by every script that parks or
-- drops an item: 'class' (HASH id -> 'handler|reason') and 'counts' (HASH 'handler|reason'
-- -> n), siblings of 'items' in the retry namespace (RedisKeys.retry_class/retry_counts),
-- named from it so every caller of drop_item keeps them without passing more keys.
local function uncount(base, class)  -- a count never goes below 0; a 0 is deleted
  if redis.call('HINCRBY', base .. 'counts', class, -1) <= 0 then
    redis.call('HDEL', base .. 'counts', class)
  end
end
-- untally(): the item leaves its class.
local function untally(items, id)
  local base = string.sub(items, 1, -6)
  local old = redis.call('HGET', base .. 'class', id)
  if old then
    redis.call('HDEL', base .. 'class', id)
    uncount(base, old)
  end
end
-- tally(): the item is counted under class (moved there if it was under another).
local function tally(items, id, class)
  local base = string.sub(items, 1, -6)
  local old = redis.call('HGET', base .. 'class', id)
  if old == class then return end
  if old then uncount(base, old) end
  redis.call('HSET', base .. 'class', id, class)
  redis.call('HINCRBY', base .. 'counts', class, 1)
end
-- drop_item(): a retry leaves the queue; if it was in a key's chain, the next one is released.
local function drop_item(inflight, due, items, id, chain)
  if id ~= '' then
    redis.call('ZREM', inflight, id)
    redis.call('ZREM', due, id)
    redis.call('HDEL', items, id)
    untally(items, id)
    if chain and chain ~= '' then
      redis.call('LREM', chain, 1, id)
      chain_head(chain, inflight, due, items)
    end
  end
end
"""

# Redis's clock, the one every host shares: due times and retry lease deadlines are
# taken from TIME inside the scripts, never from a host's clock, which may be off by
# seconds. replicate_commands lets a script write after TIME on Redis 6.2 (a no-op on 7+,
# absent in fakeredis, hence the guard).
NOW = """
if redis.replicate_commands then redis.replicate_commands() end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""
