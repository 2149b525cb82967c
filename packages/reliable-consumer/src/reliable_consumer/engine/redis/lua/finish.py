"""FINISH: the Lua script that writes a record's done-marker and its effects, atomically.

Every effect is checked against the data before anything is written, and the marker goes
first, so an effect failing part-way never leads to a second application (the key
states are listed in redis/lua/claims.py).
"""

from __future__ import annotations

from reliable_consumer.engine.redis.lua.common import PARSE
from reliable_consumer.engine.redis.lua.effects import EFFECT_CHECKS, OUTBOX, RUN_EFFECTS

# KEYS: inflight, due, items, outbox (the stream of emitted records, redis/keys.py)
# ARGV[1]: ttl_s ('' = done-markers never expire);
# ARGV[2]: [[idem_key, token, fingerprint, retry_id, [[cmd, arg...], ...], chain,
#            [[start, topic, value, key, headers, event, handler], ...]], ...]
# ARGV[3]: the emitted records' outbox fields end to end, binary-safe (JSON would not carry
# raw bytes): an emission's fields start at ARGV[3]'s byte `start` (from 1) and follow each
# other with the lengths given (key -1: the record has no key). One string rather than an
# argument per field: packing ~19 arguments a record was about half of what FINISH cost the
# worker (idempotency.outbox_fields).
# Returns per record:
#   ok | done | dead | conflict | superseded | blocked | error:<message> | partial:<message>
# chain: the record's Kafka-key chain ('' for none). For a fresh record (retry_id ''), its
# effects wait while the chain holds an earlier record (blocked: nothing applied); for a
# retry, which is its chain's head, leaving the queue releases the next record of the chain.
# The same checks serve a delivery that claimed the key and one that did not (an
# effects-only handler's): the effects apply only while the key is free or ours.
# error: nothing of the record was applied (the record is retried);
# partial: an effect failed after another was applied. The done-marker is kept, flagged
# '|p', so the effects are never applied again; the record is dead-lettered.
# Emissions are appended to the outbox only for 'ok', after every effect applied, in
# record order: never for a duplicate, a conflict, a blocked, an error or a partial record
# (its effects are half applied and it is dead-lettered, so no event says it happened).
# A re-sent call answers 'ok' from the marker and appends nothing again.
FINISH = (
    PARSE
    + EFFECT_CHECKS
    + """
local ttl = ARGV[1]
local outbox = KEYS[4]
local packed = ARGV[3] or ''
"""
    + OUTBOX
    + RUN_EFFECTS
    + """
local function set_marker(key, value)
  if ttl == '' then return redis.pcall('SET', key, value) end
  return redis.pcall('SET', key, value, 'EX', ttl)
end
local out = {}
for _, r in ipairs(cjson.decode(ARGV[2])) do
  local key, token, fp, retry_id, cmds, chain = r[1], r[2], r[3], r[4], r[5], r[6]
  local emissions = r[7] or {}
  local v = redis.call('GET', key)
  local kind, f1, f2 = parse(v)
  local status
  if kind == 'd' then
    if f2 == token then status = 'ok'
    elseif f2 == token .. '|p' then status = 'partial:effects applied in part (reply re-sent)'
    elseif f1 == fp and string.sub(f2, -2) == '|p' then
      status = 'partial:an earlier delivery applied the effects in part'
    elseif f1 == fp then status = 'done'
    else status = 'conflict' end
  elseif kind == 'x' then
    if f1 == fp then status = 'dead' else status = 'conflict' end
  elseif kind == 'c' and f1 ~= token then
    status = 'superseded'
  elseif retry_id == '' and chain ~= '' and chain_head(chain, KEYS[1], KEYS[2], KEYS[3]) then
    status = 'blocked'
  else
    local problem = effects_error(cmds)
    if not problem and #emissions > 0 then problem = outbox_error() end
    if problem then
      status = 'error:' .. problem
    else
      local was_ttl = v and redis.call('PTTL', key)
      local done = 'd|' .. fp .. '|' .. token
      local wrote = set_marker(key, done)
      if wrote.err then
        status = 'error:' .. wrote.err  -- Redis refused the first write: nothing written
      else
        local how, err = run_effects(cmds, emissions)
        if how == 'error' then  -- nothing of the record applied: put the key back, fail whole
          if not v then redis.call('DEL', key)
          elseif was_ttl > 0 then redis.call('SET', key, v, 'PX', was_ttl)
          else redis.call('SET', key, v) end
          status = 'error:' .. err
        elseif how == 'partial' then
          -- applied in part (or its emissions failed): keep the marker, flagged, so the
          -- effects are never applied again; dead-lettered, no event
          redis.call('SET', key, done .. '|p', 'KEEPTTL')
          status = 'partial:' .. err
        else
          status = 'ok'
        end
        learn_types(cmds, status == 'ok')
      end
    end
  end
  if status == 'ok' or status == 'done' or status == 'dead' then
    drop_item(KEYS[1], KEYS[2], KEYS[3], retry_id, chain)
  end
  out[#out + 1] = status
end
return out
"""
)
