"""The sharded gate's scripts. Each touches one slot (a gate shard or an order shard) and
names every key it touches in KEYS, as a cluster requires; records refer to their keys by
their index in KEYS. Each is idempotent when re-sent (a lost reply is answered again).

Gate states (``<gate tag>:idem:<handler>:=<key>``; a reservation never expires, a closed
gate after the gate's ``ttl_s`` when one is set):
    r|<token>|<fp>|<order tag>|<deadline ms>  reserved by one delivery until its deadline
                                              (Redis's clock), then overdue but kept, so the
                                              next delivery learns whose it was
    d|<fp>|<token>[|p|P]                      done (flags as in redis/lua/claims.py)
    x|<fp>|<token>                            dead-lettered (its dead letter acknowledged)
Proof states (``<order tag>:applied:<sha256 of the gate key>``, no TTL):
    <token>[|p]                 that delivery applied the effects (|p: in part)
    fenced:<t1>[|<t2>...]       those deliveries were taken over: they never apply here
Tokens are free of '|' and ':'.
"""

from __future__ import annotations

from reliable_consumer.engine.redis.lua.claims import DROP_LEASED, LEASE
from reliable_consumer.engine.redis.lua.common import NOW, PARSE
from reliable_consumer.engine.redis.lua.effects import EFFECT_CHECKS, OUTBOX, RUN_EFFECTS
from reliable_consumer.engine.redis.sharded.calls import LuaScript

# split(v): a state's fields between '|'; fenced_has(v, token): whether a fenced proof
# names the token.
_FIELDS = """
local function split(v)
  local out, from = {}, 1
  while true do
    local bar = string.find(v, '|', from, true)
    if not bar then out[#out + 1] = string.sub(v, from); return out end
    out[#out + 1] = string.sub(v, from, bar - 1)
    from = bar + 1
  end
end
local function is_fenced(v)
  return string.sub(v, 1, 7) == 'fenced:'
end
local function fenced_has(v, token)
  for _, t in ipairs(split(string.sub(v, 8))) do
    if t == token then return true end
  end
  return false
end
"""

# close(key, value, ttl): a gate closed (done or dead) for ttl seconds ('': for good).
_CLOSED = """
local function close(key, value, ttl)
  if ttl == '' then redis.call('SET', key, value) else redis.call('SET', key, value, 'EX', ttl) end
end
"""

# KEYS[1]: the gate shard's open set; then the records' gate keys and redrive tickets.
# ARGV[1]: lease_ms; ARGV[2]: [[gate i, token, fp, ticket i (0: none), ticket, order tag,
#   over ('' or the overdue token this delivery fenced and may replace)], ...]
# Returns per record: reserved:<deadline ms> | busy | done | partial | dead | conflict |
#   overdue:<token>:<order tag> (nothing written: fence that order shard first).
RESERVE = LuaScript(
    NOW
    + _FIELDS
    + """
local now = now_ms()
local deadline = string.format('%d', now + tonumber(ARGV[1]))
local out = {}
for _, r in ipairs(cjson.decode(ARGV[2])) do
  local key, token, fp, ticket_i, ticket = KEYS[r[1]], r[2], r[3], r[4], r[5]
  local otag, over = r[6], r[7]
  local v = redis.call('GET', key)
  local status
  if not v then
    status = 'take'
  else
    local p = split(v)
    if p[1] == 'r' then
      if p[2] == token then status = 'reserved:' .. p[5]  -- re-sent: ours already
      elseif tonumber(p[5]) > now then status = 'busy'
      elseif over ~= '' and p[2] == over then status = 'take'
      else status = 'overdue:' .. p[2] .. ':' .. p[4] end
    elseif p[1] == 'd' then
      if p[2] ~= fp then status = 'conflict'
      elseif p[4] == 'p' then status = 'partial'
      else status = 'done' end
    elseif p[1] == 'x' then
      if p[2] ~= fp then status = 'conflict'
      elseif ticket_i > 0 and redis.call('GET', KEYS[ticket_i]) == ticket then
        redis.call('DEL', KEYS[ticket_i])
        status = 'take'
      else status = 'dead' end
    else
      status = 'conflict'
    end
  end
  if status == 'take' then
    redis.call('SET', key, table.concat({'r', token, fp, otag, deadline}, '|'))
    redis.call('ZADD', KEYS[1], deadline, key)
    status = 'reserved:' .. deadline
  end
  out[#out + 1] = status
end
return out
"""
)

# KEYS[1]: the order shard's proofs by time; then the records' proofs.
# ARGV[1]: [[proof i, gate key, t1], ...]
# Returns per record: applied | applied_partial (t1 applied the effects) | fenced (t1 never
# will here: fenced now or before, or another delivery applied them).
FENCE = LuaScript(
    NOW
    + _FIELDS
    + """
local now = string.format('%d', now_ms())
local out = {}
for _, r in ipairs(cjson.decode(ARGV[1])) do
  local key, gate, t1 = KEYS[r[1]], r[2], r[3]
  local v = redis.call('GET', key)
  local status = 'fenced'
  if v == t1 then status = 'applied'
  elseif v == t1 .. '|p' then status = 'applied_partial'
  elseif not v or (is_fenced(v) and not fenced_has(v, t1)) then
    redis.call('SET', key, v and (v .. '|' .. t1) or ('fenced:' .. t1))
    redis.call('ZADD', KEYS[1], now, gate)
  end
  out[#out + 1] = status
end
return out
"""
)

# KEYS: inflight, due, items, class, counts (the order shard's delay queue), outbox,
#   proofs by time; then the records' proofs, chains and effect keys.
# ARGV[1]: late_ms, how long past its reservation's deadline a delivery may still apply;
# ARGV[2]: [[proof i, gate key, token, fp, retry_id, cmds, chain, emissions, deadline], ...]
#   deadline: the reservation's as the gate last granted it to this token (RESERVE's answer,
#   or a later EXTEND_GATE's). The caller's word is enough: the gate moves a deadline only
#   while the reservation is this token's and not yet overdue, so no take-over (which needs
#   it overdue) can have fenced it before that deadline; a caller that never heard of its
#   extension presents the older deadline and is at worst told expired.
# ARGV[3]: the emissions' fields end to end (as FINISH's, redis/lua/finish.py).
# Returns per record: ok | done | superseded | expired | blocked | error:<msg> | partial:<msg>
# The proof decides: absent, or fencing only others, the effects apply (checked first as
# FINISH checks them) with the proof = token; our token -> ok again, nothing applied; fenced
# with our token -> superseded; another's token -> done. expired: past deadline + late_ms,
# which bounds how late a FINISH can come, so the janitor may delete proofs older than that.
FINISH_ORDER = LuaScript(
    PARSE
    + NOW
    + _FIELDS
    + EFFECT_CHECKS
    + """
local outbox = KEYS[6]
local packed = ARGV[3] or ''
"""
    + OUTBOX
    + RUN_EFFECTS
    + """
-- An effect key outside this order shard's tag would be another slot: refused per record
-- (the caller leaves such keys out of KEYS, so on a cluster the call itself stays whole).
local tag = string.sub(KEYS[1], 1, string.find(KEYS[1], '}', 1, true))
local function outside(cmds)
  for _, cmd in ipairs(cmds) do
    if type(cmd[2]) ~= 'string' or string.sub(cmd[2], 1, #tag + 1) ~= tag .. ':' then
      return 'ERR the effect key ' .. tostring(cmd[2]) .. ' is outside the order shard ' .. tag
    end
  end
  return nil
end
local now = now_ms()
local late = tonumber(ARGV[1])
local out = {}
for _, r in ipairs(cjson.decode(ARGV[2])) do
  local key, gate, token, fp, retry_id = KEYS[r[1]], r[2], r[3], r[4], r[5]
  local cmds, chain, emissions, deadline = r[6], r[7], r[8], tonumber(r[9])
  local v = redis.call('GET', key)
  local status
  if v == token then status = 'ok'
  elseif v == token .. '|p' then status = 'partial:effects applied in part (reply re-sent)'
  elseif v and is_fenced(v) and fenced_has(v, token) then status = 'superseded'
  elseif v and not is_fenced(v) then
    if string.sub(v, -2) == '|p' then
      status = 'partial:an earlier delivery applied the effects in part'
    else status = 'done' end
  elseif now > deadline + late then status = 'expired'
  elseif retry_id == '' and chain ~= '' and chain_head(chain, KEYS[1], KEYS[2], KEYS[3]) then
    status = 'blocked'
  else
    local problem = outside(cmds) or effects_error(cmds)
    if not problem and #emissions > 0 then problem = outbox_error() end
    if problem then
      status = 'error:' .. problem
    else
      local wrote = redis.pcall('SET', key, token)
      if wrote.err then
        status = 'error:' .. wrote.err  -- Redis refused the first write: nothing written
      else
        local how, err = run_effects(cmds, emissions)
        if how == 'error' then  -- nothing applied: the proof goes back as it was
          if v then redis.call('SET', key, v) else redis.call('DEL', key) end
          status = 'error:' .. err
        else
          if how == 'partial' then
            redis.call('SET', key, token .. '|p')
            status = 'partial:' .. err
          else
            status = 'ok'
          end
          redis.call('ZADD', KEYS[7], string.format('%d', now), gate)
        end
        learn_types(cmds, status == 'ok')
      end
    end
  end
  if status == 'ok' or status == 'done' then
    drop_item(KEYS[1], KEYS[2], KEYS[3], retry_id, chain)
  end
  out[#out + 1] = status
end
return out
"""
)

# KEYS[1]: the gate shard's open set; then the records' gate keys.
# ARGV[1]: ttl_s of a closed gate ('' = never expires); ARGV[2]: [[gate i, token, partial
#   (0 or 1)], ...]
# Returns per record: ok (closed now or before, by this token) | found:<the state found>.
CLOSE = LuaScript(
    _FIELDS
    + _CLOSED
    + """
local ttl = ARGV[1]
local out = {}
for _, r in ipairs(cjson.decode(ARGV[2])) do
  local key, token, partial = KEYS[r[1]], r[2], r[3]
  local v = redis.call('GET', key)
  local p = v and split(v) or {}
  local status
  if p[1] == 'r' and p[2] == token then
    close(key, 'd|' .. p[3] .. '|' .. token .. (partial == 1 and '|p' or ''), ttl)
    redis.call('ZREM', KEYS[1], key)
    status = 'ok'
  elseif p[1] == 'd' and p[3] == token then
    status = 'ok'
  else
    status = 'found:' .. (v or '')
  end
  out[#out + 1] = status
end
return out
"""
)

# MARK_DEAD's gate half, sent once the dead-letter topic acknowledged the record (its order
# half, DROP_DEAD, follows: a crash between re-runs the retry, which finds x and drops).
# KEYS[1]: the gate shard's open set; then the records' gate keys.
# ARGV[1]: ttl_s ('' = never expires); ARGV[2]: [[gate i, token, fp], ...]
# Returns per record, as redis/lua/claims.py's MARK_DEAD: marked (free or reserved by this
# token: now x; or x by this token before) | settled (a partial apply's d|..|p now |P, its TTL
# kept; or |P before) | kept (another delivery completed or holds the key, or other content).
MARK_DEAD_GATE = LuaScript(
    _FIELDS
    + _CLOSED
    + """
local ttl = ARGV[1]
local out = {}
for _, r in ipairs(cjson.decode(ARGV[2])) do
  local key, token, fp = KEYS[r[1]], r[2], r[3]
  local v = redis.call('GET', key)
  local p = v and split(v) or {}
  local status = 'kept'
  if not v or (p[1] == 'r' and p[2] == token) then
    close(key, 'x|' .. fp .. '|' .. token, ttl)
    redis.call('ZREM', KEYS[1], key)
    status = 'marked'
  elseif p[1] == 'x' and p[2] == fp and p[3] == token then
    status = 'marked'
  elseif p[1] == 'd' and p[2] == fp and p[4] == 'p' then
    redis.call('SET', key, string.sub(v, 1, -2) .. 'P', 'KEEPTTL')
    status = 'settled'
  elseif p[1] == 'd' and p[2] == fp and p[4] == 'P' then
    status = 'settled'
  end
  out[#out + 1] = status
end
return out
"""
)

# MARK_DEAD's order half: the retry items leave the order shard's delay queue, each only
# while in flight under the lease presented (MARK_DEAD's own piece, drop_leased).
# KEYS: inflight, due, items, class, counts; then the records' chains.
# ARGV[1]: [[retry_id, chain i (0: none), lease], ...]
# Returns per record: dropped | lost_lease (another run may hold it) | gone (no item left).
DROP_DEAD = LuaScript(
    PARSE
    + DROP_LEASED
    + """
local out = {}
for _, r in ipairs(cjson.decode(ARGV[1])) do
  local chain = r[2] > 0 and KEYS[r[2]] or ''
  out[#out + 1] = drop_leased(KEYS[1], KEYS[2], KEYS[3], r[1], chain, r[3])
end
return out
"""
)

# A reservation's deadline moved later, only while it is ours and not yet overdue (once
# overdue a take-over may have fenced it: it stays as it is, as an expired claim would).
# KEYS[1]: the gate shard's open set; then the records' gate keys.
# ARGV[1]: [[gate i, token, ms], ...]: the reservation lasts at least ms more (never less).
# Returns per record: ok:<its deadline now> | lost. Re-sent, the reservation is still
# recognised by its token.
EXTEND_GATE = LuaScript(
    NOW
    + _FIELDS
    + """
local now = now_ms()
local out = {}
for _, r in ipairs(cjson.decode(ARGV[1])) do
  local key, token, ms = KEYS[r[1]], r[2], tonumber(r[3])
  local v = redis.call('GET', key)
  local p = v and split(v) or {}
  local status = 'lost'
  if p[1] == 'r' and p[2] == token and tonumber(p[5]) > now then
    local deadline = math.max(tonumber(p[5]), now + ms)
    p[5] = string.format('%d', deadline)
    redis.call('SET', key, table.concat(p, '|'))
    redis.call('ZADD', KEYS[1], p[5], key)
    status = 'ok:' .. p[5]
  end
  out[#out + 1] = status
end
return out
"""
)

# The retry leases of an order shard stretched, as redis/lua/claims.py's EXTEND does (its
# own pieces: a re-sent call recognises its own extension).
# KEYS[1]: inflight. ARGV[1]: [[retry_id, lease, ms], ...]
# Returns per record: ok:<the lease now in force> | lost_lease.
EXTEND_LEASE = LuaScript(
    NOW
    + LEASE
    + """
local now = now_ms()
local out = {}
for _, r in ipairs(cjson.decode(ARGV[1])) do
  local id, lease, ms = r[1], r[2], tonumber(r[3])
  local current = held_lease(KEYS[1], id, lease)
  if current then
    current = stretch_lease(KEYS[1], id, lease, current, now + ms, ms)
    out[#out + 1] = 'ok:' .. string.format('%d', current)
  else
    out[#out + 1] = 'lost_lease'
  end
end
return out
"""
)

# KEYS[1]: the gate shard's open set; then the records' gate keys.
# ARGV[1]: [[gate i, token], ...]. Returns per record: released | kept (not ours).
RELEASE = LuaScript(
    _FIELDS
    + """
local out = {}
for _, r in ipairs(cjson.decode(ARGV[1])) do
  local key, token = KEYS[r[1]], r[2]
  local v = redis.call('GET', key)
  local status = 'kept'
  if v and string.sub(v, 1, 3 + #token) == 'r|' .. token .. '|' then
    redis.call('DEL', key)
    redis.call('ZREM', KEYS[1], key)
    status = 'released'
  end
  out[#out + 1] = status
end
return out
"""
)

# The janitor's reads and its one delete.
# KEYS[1]: a sorted set; ARGV[1]: how far back (ms) from now on the shard's clock;
# ARGV[2]: how many. Returns that moment ('upto'), then the members scored up to it, oldest
# first.
DUE = LuaScript(
    NOW
    + """
local upto = string.format('%d', now_ms() - tonumber(ARGV[1]))
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', upto, 'LIMIT', 0, tonumber(ARGV[2]))
table.insert(due, 1, upto)
return due
"""
)

# KEYS: keys of one slot. Returns their values (MGET).
READ = LuaScript("return redis.call('MGET', unpack(KEYS))")

# KEYS[1]: the open set; then gate keys. Drops from the open set the gates no longer reserved.
PRUNE_OPEN = LuaScript(
    """
local n = 0
for i = 2, #KEYS do
  local v = redis.call('GET', KEYS[i])
  if not v or string.sub(v, 1, 2) ~= 'r|' then
    n = n + redis.call('ZREM', KEYS[1], KEYS[i])
  end
end
return n
"""
)

# KEYS[1]: the proofs by time; then proofs. ARGV[1]: [[proof i, gate key, value], ...].
# Deletes each proof still holding the value the janitor judged (or already gone), and its
# entry. Returns how many proofs were deleted.
DROP_PROOFS = LuaScript(
    """
local n = 0
for _, r in ipairs(cjson.decode(ARGV[1])) do
  local key, gate, value = KEYS[r[1]], r[2], r[3]
  local v = redis.call('GET', key)
  if v == value then
    redis.call('DEL', key)
    n = n + 1
  end
  if not v or v == value then redis.call('ZREM', KEYS[1], gate) end
end
return n
"""
)
