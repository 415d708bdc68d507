"""The session store's Lua scripts (``cloud_verifier/store/redis.py``).

Each script names every key it touches in KEYS, and those keys are one session's (``P{<id>}:meta``,
``P{<id>}:tokens`` and ``P{<id>}:logprobs``, the last only where the script touches it): one hash tag, one hash
slot, so the scripts run unchanged on a Redis Cluster. The replica's session index
(``Pverifier:{<vid>}:sessions``) lives in another slot and is never touched here: the store updates it apart,
best-effort.

Holder check: ``ARGV[1]`` is a replica id that must hold the session, or ``ANY_HOLDER`` (no check).
A reply's status (its first element; CREATE answers the status alone) is one of the names below, written
``$NAME`` in the scripts' text and put in by :func:`_lua`, so the Lua and the Python that reads the replies
(``redis.py``) share one value per name. Scripts that may change the index answer the holder they saw.

Idempotent on a retry (the first call's reply was lost, and the client, or the verifier after a failover, sent
it again): create answers 1 again when the stored record is the one it created (same replica and created_at),
append when block ``seq``'s tokens are the stored tail, extend when the turn's tokens are the stored tail of a
turn started at the same ``now``, claim when the new replica already holds the session.
"""

from __future__ import annotations

import re

ANY_HOLDER = "\x00any"  # not a replica id (those come from settings and hostnames)

# The statuses of the scripts' replies. Two pairs share a value, each script answering one of the pair: a commit
# script (APPEND, EXTEND) answers COMMITTED or NOT_FOUND, the others DONE or ABSENT.
DONE = 1  # CREATE, TOUCH, DELETE, DISOWN, CLAIM: done
ABSENT = 0  # TOUCH, DELETE, DISOWN, CLAIM: no such session; CREATE: another session has the id
COMMITTED = 0  # APPEND, EXTEND: done (the reply carries the new byte length)
NOT_FOUND = -1  # APPEND, EXTEND: no such session
LENGTH_MISMATCH = -2  # APPEND, EXTEND: the stored length is not the expected one (the compare failed)
NOT_HOLDER = -3  # another replica holds the session (the holder check)
FINISHED = -4  # APPEND: the session has finished
GENERATING = -5  # EXTEND: the session's turn is still generating
_STATUSES = {"DONE": DONE, "ABSENT": ABSENT, "COMMITTED": COMMITTED, "NOT_FOUND": NOT_FOUND,
             "LENGTH_MISMATCH": LENGTH_MISMATCH, "NOT_HOLDER": NOT_HOLDER, "FINISHED": FINISHED,
             "GENERATING": GENERATING}


def _lua(text: str) -> str:
    """``text`` with each ``$NAME`` replaced by that status's value (a KeyError names an unknown one)."""
    return re.sub(r"\$([A-Z_]+)", lambda m: str(_STATUSES[m.group(1)]), text)


_HOLDER_OK = "local holder = redis.call('HGET', KEYS[1], 'verifier_id')\n" \
             "if ARGV[1] ~= '\\0any' and holder ~= ARGV[1] then return {$NOT_HOLDER, holder} end\n"

# KEYS: meta, tokens.  ARGV: verifier id, created_at, n, n hash fields/values, packed tokens, ttl ms.
# Returns DONE created (or created by this same call before) | ABSENT another session has the id.
CREATE = _lua("""
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'verifier_id') == ARGV[1]
     and redis.call('HGET', KEYS[1], 'created_at') == ARGV[2] then return $DONE end
  return $ABSENT
end
local n = tonumber(ARGV[3])
local fields = {}
for i = 1, n do fields[i] = ARGV[3 + i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('SET', KEYS[2], ARGV[4 + n], 'PX', ARGV[5 + n])
redis.call('PEXPIRE', KEYS[1], ARGV[5 + n])
return $DONE
""")

# KEYS: meta, tokens, logprobs.  ARGV: verifier id | ANY_HOLDER, expected byte length, packed tokens, seq,
# finished (0/1), finish reason ('' = none), now (unix s), ttl ms, packed logprobs of the tokens ('' = none).
# Returns {COMMITTED, new byte length, holder} | {NOT_FOUND, 0} | {LENGTH_MISMATCH, byte length} |
# {NOT_HOLDER, holder} | {FINISHED, 0}.
APPEND = _lua("""
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return {$NOT_FOUND, 0} end
""" + _HOLDER_OK + """
local cur = redis.call('STRLEN', KEYS[2])
local expected = tonumber(ARGV[2])
local len = cur
if cur ~= expected then
  if cur ~= expected + string.len(ARGV[3]) or redis.call('HGET', KEYS[1], 'last_seq') ~= ARGV[4]
     or redis.call('GETRANGE', KEYS[2], expected, cur - 1) ~= ARGV[3] then return {$LENGTH_MISMATCH, cur} end
else
  if redis.call('HGET', KEYS[1], 'finished') == '1' then return {$FINISHED, 0} end
  len = redis.call('APPEND', KEYS[2], ARGV[3])
  if ARGV[9] ~= '' then redis.call('APPEND', KEYS[3], ARGV[9]) end
  redis.call('HSET', KEYS[1], 'last_seq', ARGV[4], 'finished', ARGV[5], 'finish_reason', ARGV[6])
end
redis.call('HSET', KEYS[1], 'last_seen_at', ARGV[7])
redis.call('PEXPIRE', KEYS[1], ARGV[8])
redis.call('PEXPIRE', KEYS[2], ARGV[8])
redis.call('PEXPIRE', KEYS[3], ARGV[8])
return {$COMMITTED, len, holder}
""")

# KEYS: meta, tokens, logprobs (deleted: a new turn has no output yet).  ARGV: verifier id, expected byte
# length, packed tokens, sampling JSON, stopping JSON, seed, now (unix s), ttl ms.
# Returns {COMMITTED, new byte length} | {NOT_FOUND, 0} | {LENGTH_MISMATCH, byte length} | {NOT_HOLDER, holder} |
# {GENERATING, 0}.
EXTEND = _lua("""
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return {$NOT_FOUND, 0} end
""" + _HOLDER_OK + """
local cur = redis.call('STRLEN', KEYS[2])
local expected = tonumber(ARGV[2])
if cur ~= expected then
  if cur == expected + string.len(ARGV[3]) and redis.call('HGET', KEYS[1], 'last_seen_at') == ARGV[7]
     and redis.call('HGET', KEYS[1], 'prompt_length') == tostring(cur / 4)
     and redis.call('GETRANGE', KEYS[2], expected, cur - 1) == ARGV[3] then return {$COMMITTED, cur} end
  return {$LENGTH_MISMATCH, cur}
end
if redis.call('HGET', KEYS[1], 'finished') ~= '1'
   and cur ~= 4 * tonumber(redis.call('HGET', KEYS[1], 'prompt_length')) then return {$GENERATING, 0} end
local len = redis.call('APPEND', KEYS[2], ARGV[3])
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[1], 'prompt_length', len / 4, 'sampling', ARGV[4], 'stopping', ARGV[5], 'seed', ARGV[6],
           'finished', '0', 'finish_reason', '', 'last_seen_at', ARGV[7])
redis.call('PEXPIRE', KEYS[1], ARGV[8])
redis.call('PEXPIRE', KEYS[2], ARGV[8])
return {$COMMITTED, len}
""")

# KEYS: meta, tokens, logprobs.  ARGV: verifier id | ANY_HOLDER, now (unix s), ttl ms.
# Returns {DONE, holder} touched | {ABSENT, 0} | {NOT_HOLDER, holder}.
TOUCH = _lua("""
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return {$ABSENT, 0} end
""" + _HOLDER_OK + """
redis.call('HSET', KEYS[1], 'last_seen_at', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('PEXPIRE', KEYS[3], ARGV[3])
return {$DONE, holder}
""")

# KEYS: meta, tokens, logprobs.  ARGV: verifier id | ANY_HOLDER.
# Returns {DONE, holder} deleted | {ABSENT, 0} | {NOT_HOLDER, holder}.
DELETE = _lua("""
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[2], KEYS[3])
  return {$ABSENT, 0}
end
""" + _HOLDER_OK + """
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return {$DONE, holder}
""")

# KEYS: meta.  ARGV: verifier id.  Returns {DONE, holder} given up (held by no replica: verifier_id '') |
# {ABSENT, 0} | {NOT_HOLDER, holder}.
DISOWN = _lua("""
if redis.call('EXISTS', KEYS[1]) == 0 then return {$ABSENT, 0} end
""" + _HOLDER_OK + """
redis.call('HSET', KEYS[1], 'verifier_id', '')
return {$DONE, holder}
""")

# KEYS: meta, tokens, logprobs.  ARGV: old verifier id | ANY_HOLDER, new verifier id, now (unix s), ttl ms.
# Returns {DONE, old holder} claimed (or already held by the new replica) | {ABSENT, 0} | {NOT_HOLDER, holder}.
CLAIM = _lua("""
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return {$ABSENT, 0} end
local holder = redis.call('HGET', KEYS[1], 'verifier_id')
if holder == ARGV[2] then return {$DONE, holder} end
if ARGV[1] ~= '\\0any' and holder ~= ARGV[1] then return {$NOT_HOLDER, holder} end
redis.call('HSET', KEYS[1], 'verifier_id', ARGV[2], 'last_seen_at', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
return {$DONE, holder}
""")

# KEYS: meta, tokens, logprobs.  Returns {hash as a flat list, tokens (nil when missing), packed logprobs (nil
# when none)}: one consistent read.
GET = """
return {redis.call('HGETALL', KEYS[1]), redis.call('GET', KEYS[2]), redis.call('GET', KEYS[3])}
"""
