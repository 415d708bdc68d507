"""The session store's Lua scripts (``cloud_verifier/store/redis.py``).

Each script names every key it touches in KEYS, and those keys are one session's (``P{<id>}:meta``,
``P{<id>}:tokens`` and ``P{<id>}:logprobs``, the last only where the script touches it): one hash tag, one hash
slot, so the scripts run unchanged on a Redis Cluster. The replica's session index
(``Pverifier:{<vid>}:sessions``) lives in another slot and is never touched here: the store updates it apart,
best-effort.

Holder check: ``ARGV[1]`` is a replica id that must hold the session, or ``ANY_HOLDER`` (no check).
Statuses shared by the scripts: 0 or 1 done, -1 not found, -2 length mismatch, -3 held by another replica,
-4 finished, -5 generating. Scripts that may change the index answer the holder they saw.

Idempotent on a retry (the first call's reply was lost, and the client, or the verifier after a failover, sent
it again): create answers 1 again when the stored record is the one it created (same replica and created_at),
append when block ``seq``'s tokens are the stored tail, extend when the turn's tokens are the stored tail of a
turn started at the same ``now``, claim when the new replica already holds the session.
"""

from __future__ import annotations

ANY_HOLDER = "\x00any"  # not a replica id (those come from settings and hostnames)

_HOLDER_OK = "local holder = redis.call('HGET', KEYS[1], 'verifier_id')\n" \
             "if ARGV[1] ~= '\\0any' and holder ~= ARGV[1] then return {-3, holder} end\n"

# KEYS: meta, tokens.  ARGV: verifier id, created_at, n, n hash fields/values, packed tokens, ttl ms.
# Returns 1 created (or created by this same call before) | 0 another session has the id.
CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'verifier_id') == ARGV[1]
     and redis.call('HGET', KEYS[1], 'created_at') == ARGV[2] then return 1 end
  return 0
end
local n = tonumber(ARGV[3])
local fields = {}
for i = 1, n do fields[i] = ARGV[3 + i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('SET', KEYS[2], ARGV[4 + n], 'PX', ARGV[5 + n])
redis.call('PEXPIRE', KEYS[1], ARGV[5 + n])
return 1
"""

# KEYS: meta, tokens, logprobs.  ARGV: verifier id | ANY_HOLDER, expected byte length, packed tokens, seq,
# finished (0/1), finish reason ('' = none), now (unix s), ttl ms, packed logprobs of the tokens ('' = none).
# Returns {0, new byte length, holder} | {-1, 0} | {-2, byte length} | {-3, holder} | {-4, 0}.
APPEND = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return {-1, 0} end
""" + _HOLDER_OK + """
local cur = redis.call('STRLEN', KEYS[2])
local expected = tonumber(ARGV[2])
local len = cur
if cur ~= expected then
  if cur ~= expected + string.len(ARGV[3]) or redis.call('HGET', KEYS[1], 'last_seq') ~= ARGV[4]
     or redis.call('GETRANGE', KEYS[2], expected, cur - 1) ~= ARGV[3] then return {-2, cur} end
else
  if redis.call('HGET', KEYS[1], 'finished') == '1' then return {-4, 0} end
  len = redis.call('APPEND', KEYS[2], ARGV[3])
  if ARGV[9] ~= '' then redis.call('APPEND', KEYS[3], ARGV[9]) end
  redis.call('HSET', KEYS[1], 'last_seq', ARGV[4], 'finished', ARGV[5], 'finish_reason', ARGV[6])
end
redis.call('HSET', KEYS[1], 'last_seen_at', ARGV[7])
redis.call('PEXPIRE', KEYS[1], ARGV[8])
redis.call('PEXPIRE', KEYS[2], ARGV[8])
redis.call('PEXPIRE', KEYS[3], ARGV[8])
return {0, len, holder}
"""

# KEYS: meta, tokens, logprobs (deleted: a new turn has no output yet).  ARGV: verifier id, expected byte
# length, packed tokens, sampling JSON, stopping JSON, seed, now (unix s), ttl ms.
# Returns {0, new byte length} | {-1, 0} | {-2, byte length} | {-3, holder} | {-5, 0}.
EXTEND = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return {-1, 0} end
""" + _HOLDER_OK + """
local cur = redis.call('STRLEN', KEYS[2])
local expected = tonumber(ARGV[2])
if cur ~= expected then
  if cur == expected + string.len(ARGV[3]) and redis.call('HGET', KEYS[1], 'last_seen_at') == ARGV[7]
     and redis.call('HGET', KEYS[1], 'prompt_length') == tostring(cur / 4)
     and redis.call('GETRANGE', KEYS[2], expected, cur - 1) == ARGV[3] then return {0, cur} end
  return {-2, cur}
end
if redis.call('HGET', KEYS[1], 'finished') ~= '1'
   and cur ~= 4 * tonumber(redis.call('HGET', KEYS[1], 'prompt_length')) then return {-5, 0} end
local len = redis.call('APPEND', KEYS[2], ARGV[3])
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[1], 'prompt_length', len / 4, 'sampling', ARGV[4], 'stopping', ARGV[5], 'seed', ARGV[6],
           'finished', '0', 'finish_reason', '', 'last_seen_at', ARGV[7])
redis.call('PEXPIRE', KEYS[1], ARGV[8])
redis.call('PEXPIRE', KEYS[2], ARGV[8])
return {0, len}
"""

# KEYS: meta, tokens, logprobs.  ARGV: verifier id | ANY_HOLDER, now (unix s), ttl ms.
# Returns {1, holder} touched | {0, 0} not found | {-3, holder}.
TOUCH = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return {0, 0} end
""" + _HOLDER_OK + """
redis.call('HSET', KEYS[1], 'last_seen_at', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('PEXPIRE', KEYS[3], ARGV[3])
return {1, holder}
"""

# KEYS: meta, tokens, logprobs.  ARGV: verifier id | ANY_HOLDER.
# Returns {1, holder} deleted | {0, 0} not found | {-3, holder}.
DELETE = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[2], KEYS[3])
  return {0, 0}
end
""" + _HOLDER_OK + """
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return {1, holder}
"""

# KEYS: meta.  ARGV: verifier id.  Returns {1, holder} given up (held by no replica: verifier_id '') |
# {0, 0} not found | {-3, holder}.
DISOWN = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 0} end
""" + _HOLDER_OK + """
redis.call('HSET', KEYS[1], 'verifier_id', '')
return {1, holder}
"""

# KEYS: meta, tokens, logprobs.  ARGV: old verifier id | ANY_HOLDER, new verifier id, now (unix s), ttl ms.
# Returns {1, old holder} claimed (or already held by the new replica) | {0, 0} not found | {-3, holder}.
CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return {0, 0} end
local holder = redis.call('HGET', KEYS[1], 'verifier_id')
if holder == ARGV[2] then return {1, holder} end
if ARGV[1] ~= '\\0any' and holder ~= ARGV[1] then return {-3, holder} end
redis.call('HSET', KEYS[1], 'verifier_id', ARGV[2], 'last_seen_at', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
return {1, holder}
"""

# KEYS: meta, tokens, logprobs.  Returns {hash as a flat list, tokens (nil when missing), packed logprobs (nil
# when none)}: one consistent read.
GET = """
return {redis.call('HGETALL', KEYS[1]), redis.call('GET', KEYS[2]), redis.call('GET', KEYS[3])}
"""
