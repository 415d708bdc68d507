"""Session store in Redis, shared by all verifier replicas.

Key layout (``P`` = prefix, e.g. ``specdec:v1:``)::

    P session:<id>                hash   metadata (sampling/stopping as JSON, times in unix s, tenant_id)
    P session:<id>:tokens         string committed token ids (prompt + output), little-endian int32
    P verifier:<vid>:sessions     zset   session ids held by replica <vid>, scored by last-seen (unix s)

Every key has a TTL (``ttl_s``), refreshed by activity (create, append_committed, touch). Writes are atomic
Lua scripts; a commit is a compare-and-APPEND on the tokens string (STRLEN must equal 4 × expected length).

Expiry: a session not touched for ``ttl_s`` seconds disappears (Redis TTL); ``get`` then answers None and
writes raise :class:`~common.errors.SessionNotFoundError`.
"""

from __future__ import annotations

import dataclasses
import json
import threading

import numpy as np

from cloud_verifier.store import (
    SessionRecord,
    SessionStore,
    check_tokens,
    extend_conflict,
    finished_error,
    generating_error,
    length_mismatch,
    not_found,
    not_owner,
)
from common.errors import VerifierUnavailableError
from common.types import FinishReason, SamplingParams, StoppingCriteria

# KEYS: session hash, tokens string, verifier zset.  ARGV: session id, hash fields..., packed tokens, ttl ms,
# last_seen score.  Returns 1 when created, 0 when the id exists.
_CREATE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local n = tonumber(ARGV[2])
local fields = {}
for i = 1, n do fields[i] = ARGV[2 + i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('SET', KEYS[2], ARGV[3 + n], 'PX', ARGV[4 + n])
redis.call('PEXPIRE', KEYS[1], ARGV[4 + n])
redis.call('ZADD', KEYS[3], ARGV[5 + n], ARGV[1])
redis.call('PEXPIRE', KEYS[3], ARGV[4 + n])
return 1
"""

# KEYS: session hash, tokens string, verifier zset.
# ARGV: session id, verifier id, expected byte length, packed tokens, seq, finished (0/1), finish reason ('' =
# none), now (unix s), ttl ms.
# Returns {status, value}: {0, new byte length} | {-1, 0} not found | {-2, byte length} mismatch |
# {-3, 0} held by another verifier (caller's zset key is stale) | {-4, 0} finished.
# The same commit sent again (block ARGV[5]'s tokens are the stored tail: its first answer was lost to a timeout,
# and redis-py or the verifier retried it) is answered {0, byte length} as the first time, nothing appended.
_APPEND_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return {-1, 0} end
if redis.call('HGET', KEYS[1], 'verifier_id') ~= ARGV[2] then return {-3, 0} end
local cur = redis.call('STRLEN', KEYS[2])
local expected = tonumber(ARGV[3])
local len = cur
if cur ~= expected then
  if cur ~= expected + string.len(ARGV[4]) or redis.call('HGET', KEYS[1], 'last_seq') ~= ARGV[5]
     or redis.call('GETRANGE', KEYS[2], expected, cur - 1) ~= ARGV[4] then return {-2, cur} end
else
  if redis.call('HGET', KEYS[1], 'finished') == '1' then return {-4, 0} end
  len = redis.call('APPEND', KEYS[2], ARGV[4])
  redis.call('HSET', KEYS[1], 'last_seq', ARGV[5], 'finished', ARGV[6], 'finish_reason', ARGV[7])
end
redis.call('HSET', KEYS[1], 'last_seen_at', ARGV[8])
redis.call('PEXPIRE', KEYS[1], ARGV[9])
redis.call('PEXPIRE', KEYS[2], ARGV[9])
redis.call('ZADD', KEYS[3], ARGV[8], ARGV[1])
redis.call('PEXPIRE', KEYS[3], ARGV[9])
return {0, len}
"""

# KEYS: session hash, tokens string, verifier zset.
# ARGV: session id, verifier id, expected byte length, packed tokens, sampling JSON, stopping JSON, seed, now
# (unix s), ttl ms.
# Returns {status, value}: {0, new byte length} | {-1, 0} not found | {-2, byte length} mismatch |
# {-3, 0} held by another verifier | {-5, 0} generating (not finished, output committed in the current turn).
_EXTEND_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return {-1, 0} end
if redis.call('HGET', KEYS[1], 'verifier_id') ~= ARGV[2] then return {-3, 0} end
local cur = redis.call('STRLEN', KEYS[2])
if cur ~= tonumber(ARGV[3]) then return {-2, cur} end
if redis.call('HGET', KEYS[1], 'finished') ~= '1'
   and cur ~= 4 * tonumber(redis.call('HGET', KEYS[1], 'prompt_length')) then return {-5, 0} end
local len = redis.call('APPEND', KEYS[2], ARGV[4])
redis.call('HSET', KEYS[1], 'prompt_length', len / 4, 'sampling', ARGV[5], 'stopping', ARGV[6], 'seed', ARGV[7],
           'finished', '0', 'finish_reason', '', 'last_seen_at', ARGV[8])
redis.call('PEXPIRE', KEYS[1], ARGV[9])
redis.call('PEXPIRE', KEYS[2], ARGV[9])
redis.call('ZADD', KEYS[3], ARGV[8], ARGV[1])
redis.call('PEXPIRE', KEYS[3], ARGV[9])
return {0, len}
"""

# KEYS: session hash, tokens string, verifier zset.  ARGV: session id, verifier id, now, ttl ms.
# Returns 1 touched | 0 not found | -3 held by another verifier.
_TOUCH_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
if redis.call('HGET', KEYS[1], 'verifier_id') ~= ARGV[2] then return -3 end
redis.call('HSET', KEYS[1], 'last_seen_at', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
return 1
"""

# KEYS: session hash, tokens string, verifier zset.  ARGV: session id, verifier id.
# Returns 1 deleted | 0 not found | -3 held by another verifier.
_DELETE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[2])
  redis.call('ZREM', KEYS[3], ARGV[1])
  return 0
end
if redis.call('HGET', KEYS[1], 'verifier_id') ~= ARGV[2] then return -3 end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
"""

# KEYS: session hash, verifier zset.  ARGV: session id, verifier id.
# Returns 1 given up (held by no replica: verifier_id '') | 0 not found | -3 held by another verifier.
_DISOWN_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('HGET', KEYS[1], 'verifier_id') ~= ARGV[2] then return -3 end
redis.call('HSET', KEYS[1], 'verifier_id', '')
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

# KEYS: session hash, tokens string, old verifier zset, new verifier zset.
# ARGV: session id, old verifier id, new verifier id, now, ttl ms.
# Returns 1 claimed | 0 not found | -3 the old verifier id is stale.
_CLAIM_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
if redis.call('HGET', KEYS[1], 'verifier_id') ~= ARGV[2] then return -3 end
redis.call('HSET', KEYS[1], 'verifier_id', ARGV[3], 'last_seen_at', ARGV[4])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
redis.call('PEXPIRE', KEYS[4], ARGV[5])
return 1
"""


def _pack(token_ids: list[int]) -> bytes:
    check_tokens(token_ids)
    return np.asarray(token_ids, dtype="<i4").tobytes()


def _unpack(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i4").astype(np.int64).tolist()


class RedisSessionStore(SessionStore):
    """Session store in Redis (shared by all replicas). See the module docstring for the key layout.

    ``url``: redis URL (``redis://host:6379/0``); ``prefix``: key namespace; ``ttl_s``: seconds (fractions
    allowed); ``socket_timeout_s``: connect/read timeout of each Redis call, seconds.

    Redis errors become :class:`~common.errors.VerifierUnavailableError` (gRPC UNAVAILABLE).
    Needs a single Redis instance (or a primary): the Lua scripts touch a session's keys and its replica's set.
    """

    def __init__(self, url: str, prefix: str = "specdec:v1:", ttl_s: float = 600, socket_timeout_s: float = 5.0):
        import redis

        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.url = url
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._ttl_ms = max(1, int(round(ttl_s * 1000)))
        self._redis_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            health_check_interval=30,
            decode_responses=False,
        )
        self._create = self.client.register_script(_CREATE_LUA)
        self._append = self.client.register_script(_APPEND_LUA)
        self._touch = self.client.register_script(_TOUCH_LUA)
        self._extend = self.client.register_script(_EXTEND_LUA)
        self._delete = self.client.register_script(_DELETE_LUA)
        self._claim = self.client.register_script(_CLAIM_LUA)
        self._disown = self.client.register_script(_DISOWN_LUA)
        # session id -> verifier id (the zset key that scripts update); checked by the scripts, refreshed on -3
        self._owner: dict[str, str] = {}
        self._owner_lock = threading.Lock()

    # ---- keys
    def session_key(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}"

    def tokens_key(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}:tokens"

    def verifier_key(self, verifier_id: str) -> str:
        return f"{self.prefix}verifier:{verifier_id}:sessions"

    def keys_of(self, session_id: str, verifier_id: str) -> list[str]:
        """All keys of a session (hash, tokens, its replica's session set)."""
        return [self.session_key(session_id), self.tokens_key(session_id), self.verifier_key(verifier_id)]

    # ---- helpers
    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except self._redis_errors as e:
            raise VerifierUnavailableError(f"session store unreachable at {self._safe_url()}: {e}") from e

    def _safe_url(self) -> str:
        from urllib.parse import urlsplit

        parts = urlsplit(self.url)
        host = parts.hostname or ""
        return f"{parts.scheme}://{host}{':' + str(parts.port) if parts.port else ''}{parts.path}"

    def _owner_of(self, session_id: str, refresh: bool = False) -> str | None:
        if not refresh:
            with self._owner_lock:
                vid = self._owner.get(session_id)
            if vid is not None:
                return vid
        raw = self._call(self.client.hget, self.session_key(session_id), "verifier_id")
        with self._owner_lock:
            if raw is None:
                self._owner.pop(session_id, None)
                return None
            vid = raw.decode()
            self._owner[session_id] = vid
            return vid

    def _forget(self, session_id: str) -> None:
        with self._owner_lock:
            self._owner.pop(session_id, None)

    def _run_owned(self, script, session_id: str, args_fn):
        """Run a script that needs the session's replica zset key; retry once if the cached owner is stale.

        Returns the script's result, or None when the session does not exist."""
        result = None
        for refresh in (False, True):
            vid = self._owner_of(session_id, refresh=refresh)
            if vid is None:
                return None
            result = self._call(script, keys=self.keys_of(session_id, vid), args=args_fn(vid))
            status = result[0] if isinstance(result, list) else result
            if status != -3:
                return result
        return result

    # ---- API
    def create(self, record: SessionRecord) -> None:
        fields = {
            "session_id": record.session_id,
            "verifier_id": record.verifier_id,
            "model_id": record.model_id,
            "prompt_length": record.prompt_length,
            "sampling": json.dumps(dataclasses.asdict(record.sampling)),
            "stopping": json.dumps(dataclasses.asdict(record.stopping)),
            "seed": record.seed,
            "created_at": repr(float(record.created_at)),
            "last_seen_at": repr(float(record.last_seen_at)),
            "finished": "1" if record.finished else "0",
            "finish_reason": record.finish_reason.value if record.finish_reason else "",
            "last_seq": record.last_seq,
            "tenant_id": record.tenant_id,  # immutable: no script rewrites it (claim/disown keep it on resume)
        }
        flat: list = []
        for k, v in fields.items():
            flat += [k, str(v)]
        packed = _pack(record.committed_token_ids)
        args = [record.session_id, len(flat), *flat, packed, self._ttl_ms, repr(float(record.last_seen_at))]
        created = self._call(self._create, keys=self.keys_of(record.session_id, record.verifier_id), args=args)
        if not created:
            raise ValueError(f"session {record.session_id!r} exists")
        with self._owner_lock:
            self._owner[record.session_id] = record.verifier_id

    def get(self, session_id: str) -> SessionRecord | None:
        pipe = self.client.pipeline(transaction=True)
        pipe.hgetall(self.session_key(session_id))
        pipe.get(self.tokens_key(session_id))
        raw, tokens = self._call(pipe.execute)
        if not raw or tokens is None:
            self._forget(session_id)
            return None
        h = {k.decode(): v.decode() for k, v in raw.items()}
        sampling = json.loads(h["sampling"])
        stopping = json.loads(h["stopping"])
        stopping["stop_token_ids"] = tuple(stopping.get("stop_token_ids", ()))
        stopping["stop_strings"] = tuple(stopping.get("stop_strings", ()))
        with self._owner_lock:
            self._owner[session_id] = h["verifier_id"]
        return SessionRecord(
            session_id=h["session_id"],
            verifier_id=h["verifier_id"],
            model_id=h["model_id"],
            prompt_length=int(h["prompt_length"]),
            committed_token_ids=_unpack(tokens),
            sampling=SamplingParams(**sampling),
            stopping=StoppingCriteria(**stopping),
            seed=int(h["seed"]),
            created_at=float(h["created_at"]),
            last_seen_at=float(h["last_seen_at"]),
            finished=h.get("finished") == "1",
            finish_reason=FinishReason(h["finish_reason"]) if h.get("finish_reason") else None,
            last_seq=int(h.get("last_seq", 0)),
            tenant_id=h.get("tenant_id", ""),
        )

    def append_committed(self, session_id, expected_length, token_ids, seq, finished, finish_reason, now,
                         verifier_id=None) -> int:
        packed = _pack(token_ids)
        reason = finish_reason.value if (finished and finish_reason is not None) else ""

        def args(vid: str) -> list:
            return [session_id, vid, 4 * int(expected_length), packed, int(seq), "1" if finished else "0",
                    reason, repr(float(now)), self._ttl_ms]

        if verifier_id is not None:  # only as that replica: the script refuses (-3) when another one holds it
            result = self._call(self._append, keys=self.keys_of(session_id, verifier_id), args=args(verifier_id))
            if int(result[0]) == -3:
                self._forget(session_id)
                raise not_owner(session_id, verifier_id)
        else:
            result = self._run_owned(self._append, session_id, args)
        if result is None:
            raise not_found(session_id)
        status, value = int(result[0]), int(result[1])
        if status == 0:
            return value // 4
        if status == -2:
            raise length_mismatch(session_id, expected_length, value // 4)
        if status == -4:
            raise finished_error(session_id)
        self._forget(session_id)
        raise not_found(session_id)

    def extend(self, session_id, expected_length, token_ids, sampling, stopping, seed, now, verifier_id) -> int:
        packed = _pack(token_ids)
        args = [session_id, verifier_id, 4 * int(expected_length), packed,
                json.dumps(dataclasses.asdict(sampling)), json.dumps(dataclasses.asdict(stopping)), int(seed),
                repr(float(now)), self._ttl_ms]
        status, value = (int(x) for x in self._call(self._extend, keys=self.keys_of(session_id, verifier_id),
                                                    args=args))
        if status == 0:
            return value // 4
        if status == -3:
            self._forget(session_id)
            raise not_owner(session_id, verifier_id)
        if status == -2:
            raise extend_conflict(session_id, expected_length, value // 4)
        if status == -5:
            raise generating_error(session_id)
        self._forget(session_id)
        raise not_found(session_id)

    def touch(self, session_id: str, now: float) -> bool:
        result = self._run_owned(self._touch, session_id, lambda vid: [session_id, vid, repr(float(now)),
                                                                      self._ttl_ms])
        if result == 1:
            return True
        self._forget(session_id)
        return False

    def delete(self, session_id: str, verifier_id: str | None = None) -> bool:
        if verifier_id is not None:  # only if held by verifier_id: the script checks it
            result = self._call(self._delete, keys=self.keys_of(session_id, verifier_id),
                                args=[session_id, verifier_id])
        else:
            result = self._run_owned(self._delete, session_id, lambda vid: [session_id, vid])
        if result == 1 or verifier_id is None:
            self._forget(session_id)
        return result == 1

    def claim(self, session_id: str, verifier_id: str, now: float) -> bool:
        for refresh in (False, True):
            old = self._owner_of(session_id, refresh=refresh)
            if old is None:
                return False
            keys = [self.session_key(session_id), self.tokens_key(session_id), self.verifier_key(old),
                    self.verifier_key(verifier_id)]
            result = self._call(self._claim, keys=keys,
                                args=[session_id, old, verifier_id, repr(float(now)), self._ttl_ms])
            if result == 1:
                with self._owner_lock:
                    self._owner[session_id] = verifier_id
                return True
            if result == 0:
                self._forget(session_id)
                return False
        return False

    def disown(self, session_id: str, verifier_id: str) -> bool:
        result = self._call(self._disown, keys=[self.session_key(session_id), self.verifier_key(verifier_id)],
                            args=[session_id, verifier_id])
        self._forget(session_id)
        return result == 1

    def session_ids_of(self, verifier_id: str) -> list[str]:
        key = self.verifier_key(verifier_id)
        members = [m.decode() for m in self._call(self.client.zrange, key, 0, -1)]
        if not members:
            return []
        pipe = self.client.pipeline(transaction=False)
        for sid in members:
            pipe.hget(self.session_key(sid), "verifier_id")
        owners = self._call(pipe.execute)
        live = [sid for sid, owner in zip(members, owners) if owner is not None and owner.decode() == verifier_id]
        live_set = set(live)
        gone = [sid for sid in members if sid not in live_set]
        if gone:  # expired sessions (or moved away): prune the set
            self._call(self.client.zrem, key, *gone)
        return live

    def ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except Exception:  # noqa: BLE001 - any failure means "not answering"
            return False

    def close(self) -> None:
        self.client.close()
