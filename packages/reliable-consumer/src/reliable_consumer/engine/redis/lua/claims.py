"""The Lua scripts that guard a dedupe key: CLAIM, EXTEND, RELEASE and MARK_DEAD.

Idempotency key states (one string per dedupe key):
    c|<token>|<fingerprint>   claimed by one delivery; expires with its lease (PX)
    d|<fingerprint>|<token>   done: the effects were applied (no expiry unless a TTL is set)
    d|<fingerprint>|<token>|p done, but an effect failed after others applied: every
                              delivery is dead-lettered `effects_partial` until one is
    d|<fingerprint>|<token>|P acknowledged by the dead-letter topic (MARK_DEAD), then done
    x|<fingerprint>|<token>   dead-lettered: acknowledged by the dead-letter topic
The fingerprint is a hash of the decoded payload, so the same id with other
content is a conflict, never a second grant. FINISH, which writes the done state and
the effects, is in redis/lua/finish.py.
"""

from __future__ import annotations

from reliable_consumer.engine.redis.lua.common import NOW, PARSE

# KEYS: inflight, due, items (of the delay queue, for the key chains)
# ARGV[1]: lease_ms; ARGV[2]: [[idem_key, token, fingerprint, ticket_key, ticket, chain], ...]
# Returns per record: claimed | busy | done | dead | conflict | partial | blocked
# (partial: done with effects applied in part, and no dead letter acknowledged yet;
# blocked: the record could claim, but its Kafka key's chain (chain '' for none) still has
# an earlier record waiting in the delay queue, so it must not run yet: nothing is taken)
# ticket_key ('' for a record that is no redrive) names the ticket `service dlq redrive`
# wrote before sending the record back; only while it holds `ticket` may the record claim
# over its own dead-letter marker (same fingerprint), and claiming consumes it: once.
# A marker of another fingerprint is a conflict, which no redrive overrides.
CLAIM = (
    PARSE
    + """
local lease = ARGV[1]
local out = {}
for _, r in ipairs(cjson.decode(ARGV[2])) do
  local key, token, fp, ticket_key, ticket, chain = r[1], r[2], r[3], r[4], r[5], r[6]
  local ticketed = ticket_key ~= '' and redis.call('GET', ticket_key) == ticket
  local v = redis.call('GET', key)
  local kind, f1, f2 = parse(v)
  local status
  if not v then
    status = 'claimed'
  elseif kind == 'c' then
    if f1 == token then status = 'claimed' else status = 'busy' end
  elseif kind == 'd' then
    if f1 ~= fp then status = 'conflict'
    elseif string.sub(f2, -2) == '|p' then status = 'partial'
    else status = 'done' end
  elseif kind == 'x' then
    if f1 ~= fp then status = 'conflict'
    elseif ticketed then status = 'claimed'
    else status = 'dead' end
  else
    status = 'conflict'
  end
  if status == 'claimed' and chain ~= '' and chain_head(chain, KEYS[1], KEYS[2], KEYS[3]) then
    status = 'blocked'
  end
  if status == 'claimed' then
    redis.call('SET', key, 'c|' .. token .. '|' .. fp, 'PX', lease)
    if ticketed then redis.call('DEL', ticket_key) end
  end
  out[#out + 1] = status
end
return out
"""
)

# KEYS: inflight
# ARGV[1]: [[idem_key, token, claim_ms, retry_id, lease, retry_ms], ...]
#   idem_key '' when the record holds no claim; retry_id '' (and lease '') when it is
#   not a retry. Called as a pool runner starts the handler: the leases taken at claim
#   time may have burned while the record waited for a runner.
# Returns per record: ok:<retry lease, '' when not a retry> | lost_claim | lost_lease
# Only when both are still ours: the claim lives at least claim_ms more, and the retry
# lease (the inflight score, also PARK's fencing token) at least retry_ms more. A moved
# lease is remembered in <inflight>:ext:<id> for as long as it runs, so a re-sent call
# (lost reply) recognises its own extension instead of reporting the lease lost.
# held_lease(): the retry lease (the inflight score, PARK's fencing token) still in force for
# a run presenting ``lease``: the score itself, or a later one this run's own extension set
# (remembered in <inflight>:ext:<id>, so a re-sent call recognises it); nil when lost.
# stretch_lease(): makes a held lease last until at least ``upto`` (ms) and remembers the
# move for as long as it runs. Returns the lease now in force.
LEASE = """
local function held_lease(inflight, id, lease)
  local score = redis.call('ZSCORE', inflight, id)
  if not score then return nil end
  if tonumber(score) == tonumber(lease) then return tonumber(score) end
  local moved = redis.call('GET', inflight .. ':ext:' .. id)
  if moved and moved == lease .. '|' .. string.format('%d', tonumber(score)) then
    return tonumber(score)
  end
  return nil
end
local function stretch_lease(inflight, id, lease, current, upto, ms)
  if current < upto then
    current = upto
    redis.call('ZADD', inflight, string.format('%d', current), id)
    redis.call('SET', inflight .. ':ext:' .. id, lease .. '|' .. string.format('%d', current),
      'PX', ms)
  end
  return current
end
"""

# KEYS: inflight
# ARGV[1]: [[idem_key, token, claim_ms, retry_id, lease, retry_ms], ...]
#   idem_key '' when the record holds no claim; retry_id '' (and lease '') when it is
#   not a retry. Called as a pool runner starts the handler: the leases taken at claim
#   time may have burned while the record waited for a runner.
# Returns per record: ok:<retry lease, '' when not a retry> | lost_claim | lost_lease
# Only when both are still ours: the claim lives at least claim_ms more, and the retry
# lease (the inflight score, also PARK's fencing token) at least retry_ms more. A moved
# lease is remembered in <inflight>:ext:<id> for as long as it runs, so a re-sent call
# (lost reply) recognises its own extension instead of reporting the lease lost.
EXTEND = (
    PARSE
    + NOW
    + LEASE
    + """
local now = now_ms()
local out = {}
for _, r in ipairs(cjson.decode(ARGV[1])) do
  local key, token, claim_ms = r[1], r[2], tonumber(r[3])
  local id, lease, retry_ms = r[4], r[5], tonumber(r[6])
  local status = 'ok'
  local current = 0
  if key ~= '' then
    local v = redis.call('GET', key)
    if not (v and string.sub(v, 1, 3 + #token) == 'c|' .. token .. '|') then
      status = 'lost_claim'
    end
  end
  if status == 'ok' and id ~= '' then
    current = held_lease(KEYS[1], id, lease)
    if not current then status = 'lost_lease' end
  end
  if status == 'ok' then
    if key ~= '' and redis.call('PTTL', key) < claim_ms then
      redis.call('PEXPIRE', key, claim_ms)
    end
    if id ~= '' then
      current = stretch_lease(KEYS[1], id, lease, current, now + retry_ms, retry_ms)
      status = 'ok:' .. string.format('%d', current)
    else
      status = 'ok:'
    end
  end
  out[#out + 1] = status
end
return out
"""
)

# ARGV per record: idem_key, token. Drops the claim if it is still ours.
RELEASE = (
    PARSE
    + """
for pos = 1, #ARGV, 2 do
  release(ARGV[pos], ARGV[pos + 1])
end
return 1
"""
)

# KEYS: inflight, due, items
# ARGV[1]: ttl_s ('' = no expiry);
# ARGV[2]: [[idem_key ('' when undecodable), token, fingerprint, retry_id, chain, lease], ...]
#   lease: the fencing deadline of the retry's claim (its inflight score), '' when not a retry.
# Returns per record: marked | settled | kept | lost_lease
# Marks the key dead-lettered (unless someone completed it meanwhile), settles a partial
# apply's marker ('|p' -> '|P'), drops the retry item and releases the next of its chain.
# The item is dropped only while the lease is still the one presented (PARK's fence): when it
# ran out, the reaper re-queued the item and another run may hold it and the key's claim.
# That run settles the key; dropping its item would leave the key with neither a marker nor
# a retry (its PARK answers lost_lease and releases the claim). lost_lease: the key was
# marked or kept as usual, and the item left to its holder.
# drop_leased(): MARK_DEAD's queue part. A retry's item is dropped (and the next of its
# chain released) only while it is in flight under the lease presented (PARK's fence):
# 'dropped'; 'lost_lease' when the item is still queued but no longer under that lease (the
# reaper re-queued it: another run may hold it); 'gone' when no item is left.
DROP_LEASED = """
local function drop_leased(inflight, due, items, id, chain, lease)
  local held = redis.call('ZSCORE', inflight, id)
  if held and tonumber(held) == tonumber(lease) then
    drop_item(inflight, due, items, id, chain)
    return 'dropped'
  elseif redis.call('HEXISTS', items, id) == 1 then
    return 'lost_lease'
  end
  return 'gone'
end
"""

MARK_DEAD = (
    PARSE
    + DROP_LEASED
    + """
local ttl = ARGV[1]
local out = {}
for _, r in ipairs(cjson.decode(ARGV[2])) do
  local key, token, fp, retry_id, chain, lease = r[1], r[2], r[3], r[4], r[5], r[6]
  local status = 'marked'
  if key ~= '' then
    local v = redis.call('GET', key)
    local kind, f1, f2 = parse(v)
    if (not v) or (kind == 'c' and f1 == token) then
      if ttl == '' then
        redis.call('SET', key, 'x|' .. fp .. '|' .. token)
      else
        redis.call('SET', key, 'x|' .. fp .. '|' .. token, 'EX', ttl)
      end
    elseif kind == 'd' and f1 == fp and string.sub(f2, -2) == '|p' then
      -- a partial apply's dead letter is acknowledged: later deliveries are duplicates
      redis.call('SET', key, string.sub(v, 1, -2) .. 'P', 'KEEPTTL')
      status = 'settled'
    else
      status = 'kept'
    end
  end
  if retry_id ~= '' and
      drop_leased(KEYS[1], KEYS[2], KEYS[3], retry_id, chain, lease) == 'lost_lease' then
    status = 'lost_lease'
  end
  out[#out + 1] = status
end
return out
"""
)

# MARK_DEAD for one retry an operator took out of the queue (``service retries drop``,
# reliable_consumer/ops/retry_admin.py): ARGV[2] holds exactly one record, ARGV[3] the fencing
# deadline of the operator's lease on it. Marks as MARK_DEAD does only while the item is still
# in flight under that lease; otherwise (the lease ran out, the reaper re-queued the item, a
# worker may run it now) nothing changes and it answers {'lost_lease'}.
MARK_DEAD_LEASED = (
    PARSE
    + """
local leased = cjson.decode(ARGV[2])
local held = #leased == 1 and redis.call('ZSCORE', KEYS[1], leased[1][4])
if (not held) or tonumber(held) ~= tonumber(ARGV[3]) then return {'lost_lease'} end
"""
    + MARK_DEAD.removeprefix(PARSE)
)
