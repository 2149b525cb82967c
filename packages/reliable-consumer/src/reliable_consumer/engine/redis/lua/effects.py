"""Lua pieces shared by the scripts that apply a record's effects: FINISH (finish.py) and the
sharded gate's FINISH_ORDER (redis/sharded/lua.py). One copy of the effect table, the int64
checks and the outbox append, so both apply effects under exactly the same rules.
"""

from __future__ import annotations

# effects_error(cmds): the first error the record's effects would meet, checked before any
# write (nil: none); learn_types(cmds, applied): what the batch knows of key types after.
EFFECT_CHECKS = """
-- Redis never rolls back a script's earlier writes when a later command fails. So every
-- effect of a record is checked first against what it will meet (command, arity, key
-- types, integer counters and their int64 overflow), simulating the record's own earlier
-- effects on the same keys; and the script writes its marker (FINISH's done-marker,
-- FINISH_ORDER's proof) before the effects, so one that still fails after another was
-- applied leaves the marker: never applied twice.
local MAX_ARGS = 1024  -- per command, far below what unpack() takes (~8000)
-- effect -> {type the key must hold ('' any), fewest arguments after the key, most (-1 any)}
local EFFECTS = {
  xadd = {'stream', 3, -1}, hset = {'hash', 2, -1}, hsetnx = {'hash', 2, 2},
  hincrby = {'hash', 2, 2}, hdel = {'hash', 1, -1}, sadd = {'set', 1, -1},
  srem = {'set', 1, -1}, zadd = {'zset', 2, -1}, zincrby = {'zset', 2, 2},
  lpush = {'list', 1, -1}, rpush = {'list', 1, -1}, incr = {'string', 0, 0},
  incrby = {'string', 1, 1}, decr = {'string', 0, 0}, decrby = {'string', 1, 1},
  set = {'', 1, 6}, del = {'', 0, 0}, expire = {'', 1, 1}, pexpire = {'', 1, 1},
}
local KEEPS_TYPE = {hdel = true, srem = true, expire = true, pexpire = true}
-- Exact int64 arithmetic with doubles: value = h * 1e10 + l, 0 <= l < 1e10.
local E10 = 1e10
local function in_range(h, l)
  return (h < 922337203 or (h == 922337203 and l <= 6854775807))
    and (h > -922337204 or (h == -922337204 and l >= 3145224192))
end
local function to_int(s)  -- nil unless Redis reads s as an int64 (string2ll)
  if type(s) ~= 'string' then return nil end
  if s == '0' then return 0, 0 end
  if #s > 20 or not string.match(s, '^-?[1-9]%d*$') then return nil end
  local neg = string.sub(s, 1, 1) == '-'
  local digits = neg and string.sub(s, 2) or s
  local n = #digits
  if n > 19 then return nil end
  local h = n > 10 and tonumber(string.sub(digits, 1, n - 10)) or 0
  local l = tonumber(string.sub(digits, math.max(1, n - 9)))
  if neg then
    h, l = -h, -l
    if l < 0 then h, l = h - 1, l + E10 end
  end
  if not in_range(h, l) then return nil end
  return h, l
end
local function add(h1, l1, h2, l2)
  local h, l = h1 + h2, l1 + l2
  if l >= E10 then h, l = h + 1, l - E10 end
  return h, l
end
local function negate(h, l)
  if l == 0 then return -h, 0 end
  return -h - 1, E10 - l
end
local function finite(s)
  local n = type(s) == 'string' and not string.find(s, '^%s') and tonumber(s)
  return n and n == n and n ~= math.huge and n ~= -math.huge
end
local OVERFLOW = 'ERR increment or decrement would overflow'
local NOT_INT = 'ERR value is not an integer or out of range'
-- What one record's effects will meet, simulated as its commands are checked (reset per
-- record): key types, integer counters, hash fields, keys its own effects replaced.
local types, ints, fields, gone
-- Key types across the batch: what TYPE answered, kept true by every record applied since
-- (a command that creates its type sets it; any other write forgets the key). Records of
-- a batch mostly share a few keys (a ledger stream), so one TYPE serves them all.
local known = {}
local function type_of(key)
  if types[key] == nil then
    local t = known[key]
    if t == nil then
      local r = redis.pcall('TYPE', key)
      if r.err then return nil, r.err end
      t = r['ok']
    end
    types[key] = t
  end
  return types[key]
end
local function counter(key)  -- {h, l}, or false when the key holds no integer
  if ints[key] == nil then
    local v = redis.call('GET', key)
    local h, l = 0, 0
    if v then h, l = to_int(v) end
    ints[key] = h and {h, l} or false
  end
  return ints[key]
end
local function field(key, name)  -- {h, l}, 'text' or 'none'
  local fs = fields[key]
  if not fs then fs = {}; fields[key] = fs end
  if fs[name] == nil then
    local v = not gone[key] and redis.call('HGET', key, name)
    if not v then fs[name] = 'none'
    else
      local h, l = to_int(v)
      fs[name] = h and {h, l} or 'text'
    end
  end
  return fs[name]
end
local function set_field(key, name, value)  -- the old value does not matter: no HGET
  local fs = fields[key]
  if not fs then fs = {}; fields[key] = fs end
  local h, l = to_int(value)
  fs[name] = h and {h, l} or 'text'
end
local function replaced(key, kind)
  types[key], gone[key], fields[key] = kind, true, {}
  ints[key] = kind == 'none' and {0, 0} or nil
end
local function effects_error(cmds)
  types, ints, fields, gone = {}, {}, {}, {}
  for _, cmd in ipairs(cmds) do
    local name = string.lower(tostring(cmd[1]))
    local NAME = string.upper(name)
    local spec = EFFECTS[name]
    if not spec then return 'ERR ' .. NAME .. ' is not an effect command' end
    if #cmd > MAX_ARGS then
      return 'ERR ' .. NAME .. ' has ' .. #cmd .. ' arguments, more than ' .. MAX_ARGS
    end
    local nargs = #cmd - 2
    if nargs < spec[2] or (spec[3] >= 0 and nargs > spec[3]) then
      return "ERR wrong number of arguments for '" .. name .. "' command"
    end
    local key = cmd[2]
    local have, err = type_of(key)
    if not have then return err end
    local want = spec[1]
    if want ~= '' and have ~= 'none' and have ~= want then
      return 'WRONGTYPE ' .. NAME .. ' needs a ' .. want .. ', the key holds a ' .. have
    end
    if name == 'incr' or name == 'incrby' or name == 'decr' or name == 'decrby' then
      local c = counter(key)
      if not c then return 'ERR ' .. NAME .. ': the key does not hold an integer' end
      local h, l = 0, 1
      if nargs == 1 then
        h, l = to_int(cmd[3])
        if not h then return NOT_INT end
      end
      if name == 'decr' or name == 'decrby' then
        if h == -922337204 and l == 3145224192 then return OVERFLOW end
        h, l = negate(h, l)
      end
      h, l = add(c[1], c[2], h, l)
      if not in_range(h, l) then return OVERFLOW end
      ints[key] = {h, l}
    elseif name == 'hincrby' then
      local c = field(key, cmd[3])
      if c == 'text' then return 'ERR hash value is not an integer' end
      if c == 'none' then c = {0, 0} end
      local h, l = to_int(cmd[4])
      if not h then return NOT_INT end
      h, l = add(c[1], c[2], h, l)
      if not in_range(h, l) then return OVERFLOW end
      fields[key][cmd[3]] = {h, l}
    elseif name == 'hset' then
      if nargs % 2 ~= 0 then return "ERR wrong number of arguments for 'hset' command" end
      for i = 3, #cmd, 2 do set_field(key, cmd[i], cmd[i + 1]) end
    elseif name == 'hsetnx' then
      if field(key, cmd[3]) == 'none' then set_field(key, cmd[3], cmd[4]) end
    elseif name == 'hdel' then
      field(key, cmd[3])
      for i = 3, #cmd do fields[key][cmd[i]] = 'none' end
    elseif name == 'zadd' then
      local i, seen = 3, {}
      while cmd[i] and ({NX = 1, XX = 1, GT = 1, LT = 1, CH = 1})[string.upper(cmd[i])] do
        seen[string.upper(cmd[i])] = true
        i = i + 1
      end
      if (seen.NX and (seen.XX or seen.GT or seen.LT)) or (seen.GT and seen.LT) then
        return 'ERR ZADD: incompatible options'
      end
      if #cmd - i + 1 < 2 or (#cmd - i + 1) % 2 ~= 0 then
        return "ERR wrong number of arguments for 'zadd' command"
      end
      for j = i, #cmd, 2 do
        if not finite(cmd[j]) then return 'ERR ZADD: a score is not a finite number' end
      end
    elseif name == 'zincrby' then
      if not finite(cmd[3]) then return 'ERR ZINCRBY: the increment is not a finite number' end
    elseif name == 'xadd' then
      local i = 3
      if string.upper(cmd[i]) == 'NOMKSTREAM' then i = i + 1 end
      if cmd[i] and string.upper(cmd[i]) == 'MAXLEN' then
        i = i + 1
        if cmd[i] == '~' or cmd[i] == '=' then i = i + 1 end
        local h = to_int(cmd[i])
        if not h or h < 0 then return 'ERR XADD: MAXLEN needs a count >= 0' end
        i = i + 1
      end
      if cmd[i] ~= '*' then return 'ERR XADD effects take the id *' end
      if #cmd - i < 2 or (#cmd - i) % 2 ~= 0 then
        return "ERR wrong number of arguments for 'xadd' command"
      end
    elseif name == 'set' then
      local seen, i = {}, 4
      while i <= #cmd do
        local opt = string.upper(cmd[i])
        if seen[opt] then return 'ERR SET: ' .. opt .. ' given twice' end
        seen[opt] = true
        if opt == 'EX' or opt == 'PX' then
          local h, l = to_int(cmd[i + 1])
          if not h or h < 0 or (h == 0 and l == 0) or h >= 1000 then
            return 'ERR SET: invalid expire time'
          end
          i = i + 2
        elseif opt == 'NX' or opt == 'XX' or opt == 'KEEPTTL' then
          i = i + 1
        else
          return 'ERR SET: option ' .. opt .. ' is not allowed in effects'
        end
      end
      if (seen.NX and seen.XX) or ((seen.EX and 1 or 0) + (seen.PX and 1 or 0)
          + (seen.KEEPTTL and 1 or 0)) > 1 then
        return 'ERR SET: incompatible options'
      end
      if not ((seen.NX and have ~= 'none') or (seen.XX and have == 'none')) then
        replaced(key, 'string')
        local h, l = to_int(cmd[3])
        ints[key] = h and {h, l} or false
      end
    elseif name == 'del' then
      replaced(key, 'none')
    elseif name == 'expire' or name == 'pexpire' then
      local h, l = to_int(cmd[3])
      if not h or h < 0 or (h == 0 and l == 0) or h >= 1000 then
        return 'ERR ' .. NAME .. ': invalid expire time'
      end
    end
    if want ~= '' and not KEEPS_TYPE[name] then types[key] = want end
  end
  return nil
end
-- After a record's effects ran (applied, or failed part-way): the types they leave.
local function learn_types(cmds, applied)
  for _, cmd in ipairs(cmds) do
    local name = string.lower(tostring(cmd[1]))
    local want = EFFECTS[name][1]
    if applied and want ~= '' and not KEEPS_TYPE[name] then
      known[cmd[2]] = want
    else
      known[cmd[2]] = nil  -- DEL, SET, HDEL of the last field...: ask TYPE next time
    end
  end
end
"""

# outbox_error(): why the outbox cannot take an append (nil: it can); emit(emissions):
# append them, the error of the first that fails. The composing script declares the locals
# ``outbox`` (the stream's key) and ``packed`` (the emissions' fields end to end) first.
OUTBOX = """
local outbox_type  -- asked once, only when a record emits
local function outbox_error()
  if not outbox_type then
    local r = redis.pcall('TYPE', outbox)
    if r.err then return r.err end
    outbox_type = r['ok']
  end
  if outbox_type ~= 'none' and outbox_type ~= 'stream' then
    return 'WRONGTYPE the outbox ' .. outbox .. ' holds a ' .. outbox_type .. ', not a stream'
  end
  return nil
end
local FIELDS = {'topic', 'value', 'key', 'headers', 'event', 'handler'}
-- emit(): append the record's emissions to the outbox; the error of the first that fails.
local function emit(emissions)
  for _, e in ipairs(emissions) do
    local fields, at = {}, e[1]
    for i, name in ipairs(FIELDS) do
      local n = e[i + 1]
      if n >= 0 then  -- key -1: no key field
        fields[#fields + 1] = name
        fields[#fields + 1] = string.sub(packed, at, at + n - 1)
        at = at + n
      end
    end
    local res = redis.pcall('XADD', outbox, '*', unpack(fields))
    if type(res) == 'table' and res.err then return res.err end
    outbox_type = 'stream'
  end
  return nil
end
"""

# run_effects(cmds, emissions): apply the record's effects, then its emissions. nil when
# all applied; 'error', err when the first command failed (nothing applied); 'partial',
# err when something failed after another was applied.
RUN_EFFECTS = """
local function run_effects(cmds, emissions)
  for i, cmd in ipairs(cmds) do
    local res = redis.pcall(unpack(cmd))
    if type(res) == 'table' and res.err then
      if i == 1 then return 'error', res.err end
      return 'partial', res.err
    end
  end
  if #emissions > 0 then
    local failed = emit(emissions)
    if failed then return 'partial', 'outbox: ' .. failed end
  end
  return nil
end
"""
