"""Every Lua script the worker runs, in one place.

Each script works on a batch of records so one fetched batch costs one round trip,
and each is idempotent when re-run after a lost reply (the reconnect path re-sends
the whole call). Fixed keys are passed in KEYS; the batch travels as one JSON array
in ARGV[1] (decoded with cjson), because packing hundreds of separate arguments
costs more client CPU than the script itself. Per-record keys travel inside that
array, which is fine on a standalone Redis or a primary with replicas.

Idempotency key states (one string per dedupe key):
    c|<token>|<fingerprint>   claimed by one delivery; expires with its lease (PX)
    d|<fingerprint>|<token>   done: the effects were applied (EX = idempotency TTL)
    x|<fingerprint>|<token>   dead-lettered: acknowledged by the dead-letter topic
The fingerprint is a hash of the decoded payload, so the same id with other
content is a conflict, never a second grant.

Retry queue: ``due`` (ZSET id -> due ms), ``inflight`` (ZSET id -> lease deadline ms;
the deadline doubles as the fencing token of the claim), ``items`` (HASH id -> JSON).
"""

from __future__ import annotations

_PARSE = """
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
local function drop_item(inflight, due, items, id)
  if id ~= '' then
    redis.call('ZREM', inflight, id)
    redis.call('ZREM', due, id)
    redis.call('HDEL', items, id)
  end
end
"""

# ARGV[1]: lease_ms; ARGV[2]: [[idem_key, token, fingerprint, allow_over_dead (bool)], ...]
# Returns per record: claimed | busy | done | dead | conflict
CLAIM = (
    _PARSE
    + """
local lease = ARGV[1]
local out = {}
for _, r in ipairs(cjson.decode(ARGV[2])) do
  local key, token, fp, over_dead = r[1], r[2], r[3], r[4]
  local v = redis.call('GET', key)
  local kind, f1, f2 = parse(v)
  local status
  if not v then
    status = 'claimed'
  elseif kind == 'c' then
    if f1 == token then status = 'claimed' else status = 'busy' end
  elseif kind == 'd' then
    if f1 == fp then status = 'done' else status = 'conflict' end
  elseif kind == 'x' and over_dead == true then
    status = 'claimed'
  elseif kind == 'x' then
    if f1 == fp then status = 'dead' else status = 'conflict' end
  else
    status = 'conflict'
  end
  if status == 'claimed' then
    redis.call('SET', key, 'c|' .. token .. '|' .. fp, 'PX', lease)
  end
  out[#out + 1] = status
end
return out
"""
)

# KEYS: inflight, due, items
# ARGV[1]: ttl_s; ARGV[2]: [[idem_key, token, fingerprint, retry_id, [[cmd, arg...], ...]], ...]
# Returns per record: ok | done | dead | conflict | superseded | error:<message>
# The same checks serve a delivery that claimed the key and one that did not (an
# effects-only handler's): the effects apply only while the key is free or ours.
FINISH = (
    _PARSE
    + """
-- Redis never rolls back a script's earlier writes when a later command fails, so the
-- effects are checked before any is applied: a record's effects then fail as a whole
-- (nothing written) instead of half applied, and re-applied by every retry.
local NEEDS = {
  xadd = 'stream', hset = 'hash', hsetnx = 'hash', hincrby = 'hash', hdel = 'hash',
  sadd = 'set', srem = 'set', zadd = 'zset', zincrby = 'zset', lpush = 'list',
  rpush = 'list', incr = 'string', incrby = 'string', decr = 'string', decrby = 'string',
}
local COUNTERS = {incr = true, incrby = true, decr = true, decrby = true}
local function effects_error(cmds)
  for _, cmd in ipairs(cmds) do
    local name = string.lower(cmd[1])
    local want = NEEDS[name]
    if want then
      local have = redis.call('TYPE', cmd[2])['ok']
      if have ~= 'none' and have ~= want then
        return 'WRONGTYPE ' .. string.upper(name) .. ' needs a ' .. want
          .. ', the key holds a ' .. have
      end
      local value = COUNTERS[name] and have == 'string' and redis.call('GET', cmd[2])
      if value and value ~= '0' and not (#value <= 20 and string.match(value, '^-?[1-9]%d*$')) then
        return 'ERR ' .. string.upper(name) .. ': the key does not hold an integer'
      end
    end
  end
  return nil
end
local ttl = ARGV[1]
local out = {}
for _, r in ipairs(cjson.decode(ARGV[2])) do
  local key, token, fp, retry_id, cmds = r[1], r[2], r[3], r[4], r[5]
  local v = redis.call('GET', key)
  local kind, f1, f2 = parse(v)
  local status
  if kind == 'd' then
    if f2 == token then status = 'ok'
    elseif f1 == fp then status = 'done'
    else status = 'conflict' end
  elseif kind == 'x' then
    if f1 == fp then status = 'dead' else status = 'conflict' end
  elseif kind == 'c' and f1 ~= token then
    status = 'superseded'
  else
    status = 'ok'
    local problem = effects_error(cmds)
    if problem then
      status = 'error:' .. problem
      cmds = {}
    end
    for _, cmd in ipairs(cmds) do
      local r = redis.pcall(unpack(cmd))
      if type(r) == 'table' and r.err then
        status = 'error:' .. r.err
        break
      end
    end
    if status == 'ok' then
      redis.call('SET', key, 'd|' .. fp .. '|' .. token, 'EX', ttl)
    end
  end
  if status == 'ok' or status == 'done' or status == 'dead' then
    drop_item(KEYS[1], KEYS[2], KEYS[3], retry_id)
  end
  out[#out + 1] = status
end
return out
"""
)

# KEYS: inflight, due, items
# ARGV[1]: [[id, item_json, due_ms, idem_key, token, lease], ...]
#   lease '' for a fresh delivery (park unless already parked), else the fencing
#   deadline of the retry claim being rescheduled. due_ms and lease are strings.
# Returns per record: parked | exists | lost_lease
PARK = (
    _PARSE
    + """
local out = {}
for _, r in ipairs(cjson.decode(ARGV[1])) do
  local id, item, due_ms, key, token, lease = r[1], r[2], r[3], r[4], r[5], r[6]
  local status
  if lease == '' then
    if redis.call('HEXISTS', KEYS[3], id) == 1 then
      status = 'exists'
    else
      redis.call('HSET', KEYS[3], id, item)
      redis.call('ZADD', KEYS[2], due_ms, id)
      status = 'parked'
    end
  else
    local score = redis.call('ZSCORE', KEYS[1], id)
    if (not score) or tonumber(score) ~= tonumber(lease) then
      status = 'lost_lease'
    else
      redis.call('ZREM', KEYS[1], id)
      redis.call('HSET', KEYS[3], id, item)
      redis.call('ZADD', KEYS[2], due_ms, id)
      status = 'parked'
    end
  end
  release(key, token)
  out[#out + 1] = status
end
return out
"""
)

# KEYS: inflight, due, items
# ARGV[1]: ttl_s; ARGV[2]: [[idem_key ('' when undecodable), token, fingerprint, retry_id], ...]
# Marks the key dead-lettered (unless someone completed it meanwhile), drops the retry item.
MARK_DEAD = (
    _PARSE
    + """
local ttl = ARGV[1]
local out = {}
for _, r in ipairs(cjson.decode(ARGV[2])) do
  local key, token, fp, retry_id = r[1], r[2], r[3], r[4]
  local status = 'marked'
  if key ~= '' then
    local v = redis.call('GET', key)
    local kind, f1, f2 = parse(v)
    if (not v) or (kind == 'c' and f1 == token) then
      redis.call('SET', key, 'x|' .. fp .. '|' .. token, 'EX', ttl)
    else
      status = 'kept'
    end
  end
  drop_item(KEYS[1], KEYS[2], KEYS[3], retry_id)
  out[#out + 1] = status
end
return out
"""
)

# ARGV per record: idem_key, token. Drops the claim if it is still ours.
RELEASE = (
    _PARSE
    + """
for pos = 1, #ARGV, 2 do
  release(ARGV[pos], ARGV[pos + 1])
end
return 1
"""
)

# KEYS: due, inflight, items; ARGV: now_ms, lease_ms, limit
# Returns a flat list: id, lease deadline, item json, ...
CLAIM_DUE = """
local now = tonumber(ARGV[1])
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[3])
local out = {}
for _, id in ipairs(ids) do
  redis.call('ZREM', KEYS[1], id)
  local item = redis.call('HGET', KEYS[3], id)
  if item then
    local deadline = string.format('%d', now + tonumber(ARGV[2]))
    redis.call('ZADD', KEYS[2], deadline, id)
    out[#out + 1] = id
    out[#out + 1] = deadline
    out[#out + 1] = item
  end
end
return out
"""

# KEYS: due, inflight; ARGV: now_ms, limit. Expired retry leases go back to the queue.
REAP = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
for _, id in ipairs(ids) do
  redis.call('ZREM', KEYS[2], id)
  redis.call('ZADD', KEYS[1], ARGV[1], id)
end
return #ids
"""
