"""Session store in Redis, shared by all verifier replicas: standalone, under Sentinel or as a Cluster (the URL
forms and the retry after a failover: ``cloud_verifier/store/redis_connect.py``; the scripts: ``redis_lua.py``).

Key layout (``P`` = prefix, e.g. ``specdec:v1:``)::

    P{<id>}:meta                  hash   metadata (sampling/stopping as JSON, times in unix s, tenant_id)
    P{<id>}:tokens                string committed token ids (prompt + output), little-endian int32
    P{<id>}:logprobs              string only when the session asks for logprobs: the current turn's committed
                                         output tokens' logprobs, appended by the same commit script as the tokens
                                         (:func:`pack_logprobs`); deleted by ExtendSession
    Pverifier:{<vid>}:sessions    zset   index: session ids held by replica <vid>, scored by unix s (best-effort)

A session's keys share one hash tag (``{<id>}``): one slot, so every script (atomic, all its keys in KEYS)
runs on a Cluster too, and the same layout serves standalone and Sentinel. The per-replica index is not part
of any script: it is updated apart (create, claim, disown, delete; refreshed by commits at most every
``ttl_s`` / 4 per session) and read with a check of each member's holder (:meth:`RedisSessionStore.session_ids_of`),
so a missed update costs at most a stale or missing entry for a moment, never a wrong holder.

Every key has a TTL (``ttl_s``), refreshed by activity (create, append_committed, touch). A commit is a
compare-and-APPEND on the tokens string (STRLEN must equal 4 × expected length). With ``wait_replicas`` > 0 a
write is followed, on the same connection, by ``WAIT wait_replicas wait_timeout_ms``: fewer replicas
acknowledging raises :class:`~common.errors.VerifierUnavailableError` (the commit is unconfirmed; the verifier
settles it from the store at the session's next request).

Expiry: a session not touched for ``ttl_s`` seconds disappears (Redis TTL); ``get`` then answers None and
writes raise :class:`~common.errors.SessionNotFoundError`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import threading
import time

import numpy as np

from specdec_runtime.cloud_verifier.store.base import (
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
from specdec_runtime.cloud_verifier.store import redis_lua as lua
from specdec_runtime.cloud_verifier.store.redis_connect import (CLUSTER, StoreCaller, cluster_serves_every_slot, connect,
                                                              parse_redis_url)
from specdec_runtime.common.errors import VerifierUnavailableError
from specdec_runtime.common.types import FinishReason, SamplingParams, StoppingCriteria, TokenLogprobs

log = logging.getLogger(__name__)
_INDEX_CACHE_MAX = 65536  # sessions whose last index refresh is remembered (pruned past it)


def _pack(token_ids: list[int]) -> bytes:
    check_tokens(token_ids)
    return np.asarray(token_ids, dtype="<i4").tobytes()


def _unpack(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i4").astype(np.int64).tolist()


def pack_logprobs(logprobs: list[TokenLogprobs] | None) -> bytes:
    """One record per token, little-endian: logprob (float64), k (uint32), k top ids (int32), k top logprobs
    (float64); b"" for None."""
    out = []
    for lp in logprobs or ():
        k = len(lp.top_token_ids)
        out.append(struct.pack(f"<dI{k}i{k}d", lp.logprob, k, *lp.top_token_ids, *lp.top_logprobs))
    return b"".join(out)


def unpack_logprobs(data: bytes | None) -> list[TokenLogprobs]:
    """The records of :func:`pack_logprobs`, in order ([] for None)."""
    out, pos = [], 0
    while data and pos < len(data):
        logprob, k = struct.unpack_from("<dI", data, pos)
        ids = struct.unpack_from(f"<{k}i", data, pos + 12)
        top = struct.unpack_from(f"<{k}d", data, pos + 12 + 4 * k)
        out.append(TokenLogprobs(logprob, tuple(ids), tuple(top)))
        pos += 12 + 12 * k
    return out


class RedisSessionStore(SessionStore):
    """Session store in Redis (shared by all replicas). See the module docstring for the key layout.

    ``url``: ``SPECDEC_REDIS_URL`` (``redis://host:6379/0``, ``redis+sentinel://...``, ``redis+cluster://...``:
    :func:`~cloud_verifier.store.redis_connect.parse_redis_url`); ``prefix``: key namespace (no ``{`` or ``}``:
    the hash tag is the session id); ``ttl_s``: seconds (fractions allowed); ``socket_timeout_s``: connect/read
    timeout of each Redis call, seconds; ``retry_budget_s``: how long a Sentinel/Cluster call retries while a new
    master is found, seconds; ``wait_replicas`` / ``wait_timeout_ms``: replicas a write must reach before it
    counts (0 = off) and how long to wait for them, ms; ``sentinel_username`` / ``sentinel_password`` /
    ``tls_ca_file``: the sentinels' credentials and the CA bundle of ``rediss+...`` URLs.

    Redis errors become :class:`~common.errors.VerifierUnavailableError` (gRPC UNAVAILABLE).

    Raises:
        ValueError: a bad URL or prefix, ``ttl_s`` <= 0, ``wait_replicas`` < 0.
    """

    def __init__(self, url: str, prefix: str = "specdec:v1:", ttl_s: float = 600, socket_timeout_s: float = 5.0,
                 *, retry_budget_s: float = 10.0, wait_replicas: int = 0, wait_timeout_ms: int = 500,
                 sentinel_username: str | None = None, sentinel_password: str | None = None,
                 tls_ca_file: str | None = None):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"redis prefix {prefix!r} must not contain '{{' or '}}' (the session id is the hash tag)")
        if wait_replicas < 0:
            raise ValueError(f"wait_replicas must be >= 0, got {wait_replicas}")
        self.url = url
        self.target = parse_redis_url(url)
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.wait_replicas, self.wait_timeout_ms = int(wait_replicas), int(wait_timeout_ms)
        self._ttl_ms = max(1, int(round(ttl_s * 1000)))
        self.client = connect(self.target, socket_timeout_s, sentinel_username=sentinel_username,
                              sentinel_password=sentinel_password, tls_ca_file=tls_ca_file)
        self._caller = StoreCaller(self.client, self.target, retry_budget_s)
        self._scripts = {name: self.client.register_script(getattr(lua, name.upper()))
                         for name in ("create", "append", "extend", "touch", "delete", "disown", "claim", "get")}
        self._append = self._scripts["append"]  # a test's reply-dropping proxy spots commits by this sha
        self._indexed: dict[str, float] = {}  # session id -> monotonic s of its last index refresh
        self._indexed_lock = threading.Lock()

    def describe(self) -> str:
        """Which store, for the log (password redacted)."""
        return f"{self.target.describe()}, prefix {self.prefix!r}"

    # ---- keys
    def session_key(self, session_id: str) -> str:
        return f"{self.prefix}{{{session_id}}}:meta"

    def tokens_key(self, session_id: str) -> str:
        return f"{self.prefix}{{{session_id}}}:tokens"

    def logprobs_key(self, session_id: str) -> str:
        return f"{self.prefix}{{{session_id}}}:logprobs"

    def verifier_key(self, verifier_id: str) -> str:
        return f"{self.prefix}verifier:{{{verifier_id}}}:sessions"

    def keys_of(self, session_id: str, verifier_id: str) -> list[str]:
        """All keys of a session (hash, tokens) and its replica's index."""
        return [self.session_key(session_id), self.tokens_key(session_id), self.verifier_key(verifier_id)]

    # ---- helpers
    def _call(self, command: str, fn, *args, key: str | None = None, **kwargs):
        return self._caller(command, fn, *args, key=key, **kwargs)

    def _safe_url(self) -> str:
        return self.target.redacted()

    def _run(self, name: str, session_id: str, args: list, *, tokens: bool = True, durable: bool = False):
        """Run script ``name`` over the session's keys (meta, and tokens and logprobs unless ``tokens`` is False); with
        ``durable`` and ``wait_replicas`` > 0, WAIT for the replicas on the same connection.

        Raises:
            VerifierUnavailableError: the store did not answer, or fewer replicas than ``wait_replicas``
                acknowledged within ``wait_timeout_ms`` (the write may have landed on the master).
        """
        keys = [self.session_key(session_id)]
        if tokens:
            keys += [self.tokens_key(session_id), self.logprobs_key(session_id)]
        script = self._scripts[name]
        if not (durable and self.wait_replicas):
            return self._call(name, script, keys=keys, args=args, key=keys[0])
        result, acked = self._call(name, self._run_waiting, script, keys, args, key=keys[0])
        if acked < self.wait_replicas:
            raise VerifierUnavailableError(
                f"session store write not confirmed by {self.wait_replicas} replica(s) within "
                f"{self.wait_timeout_ms} ms ({acked} acknowledged): unconfirmed")
        return result

    def _run_waiting(self, script, keys: list[str], args: list):
        """[script result, replicas that acknowledged]: one pipeline on the connection of the keys' master."""
        node = self.client
        if self.target.kind == CLUSTER:
            node = self.client.get_redis_connection(self.client.get_node_from_key(keys[0]))
        pipe = node.pipeline(transaction=False)
        script(keys=keys, args=args, client=pipe)
        pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
        if self.target.kind != CLUSTER:
            return pipe.execute()
        import redis.exceptions as rex

        try:
            return pipe.execute()
        except rex.MovedError as e:
            # one node's pipeline bypasses the cluster client's MOVED handling: the slot moved (a failover) and
            # nothing ran. Rebuild the slot map and answer retryable: StoreCaller tries again on the new master.
            try:
                self.client.nodes_manager.initialize()
            except Exception:  # noqa: BLE001 - the cluster still settling: the next try rebuilds again
                pass
            raise rex.TryAgainError(f"slot moved: {e}") from e

    def _index(self, session_id: str, add: str | None = None, remove: str | None = None) -> None:
        """Best-effort update of the per-replica index: add the session to ``add``'s set, remove it from
        ``remove``'s; never raises (a missed update is repaired by a later commit or pruned on read)."""
        def update():  # built anew on each try: a failed execute empties the pipeline
            pipe = self.client.pipeline(transaction=False)
            if remove is not None and remove != add:
                pipe.zrem(self.verifier_key(remove), session_id)
            if add:
                pipe.zadd(self.verifier_key(add), {session_id: time.time()})
                pipe.pexpire(self.verifier_key(add), self._ttl_ms)
            return pipe.execute()

        try:
            update()  # no retry: an advisory update must not hold a create or claim through a failover
        except Exception as e:  # noqa: BLE001 - the index is advisory
            log.debug("session index update of %s skipped: %s", session_id, e)
        with self._indexed_lock:
            if add:
                self._indexed[session_id] = time.monotonic()
            else:
                self._indexed.pop(session_id, None)

    def _refresh_index(self, session_id: str, holder) -> None:
        """After a commit or touch by ``holder``: re-add the session to its index at most every ttl / 4."""
        holder = holder.decode() if isinstance(holder, bytes) else holder
        if not holder:
            return
        now = time.monotonic()
        with self._indexed_lock:
            last = self._indexed.get(session_id)
            if last is not None and now - last < self.ttl_s / 4:
                return
            if len(self._indexed) >= _INDEX_CACHE_MAX:
                self._indexed = {k: t for k, t in self._indexed.items() if now - t < self.ttl_s}
        self._index(session_id, add=holder)

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
            "draft_label": record.draft_label,  # immutable too: a resumed session keeps its draft version
        }
        flat: list = []
        for k, v in fields.items():
            flat += [k, str(v)]
        packed = _pack(record.committed_token_ids)
        args = [record.verifier_id, fields["created_at"], len(flat), *flat, packed, self._ttl_ms]
        if self._run("create", record.session_id, args, durable=True) != lua.DONE:
            raise ValueError(f"session {record.session_id!r} exists")
        self._index(record.session_id, add=record.verifier_id)

    def get(self, session_id: str) -> SessionRecord | None:
        flat, tokens, logprobs = self._run("get", session_id, [])
        if not flat or tokens is None:
            return None
        h = {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}
        sampling = json.loads(h["sampling"])
        stopping = json.loads(h["stopping"])
        stopping["stop_token_ids"] = tuple(stopping.get("stop_token_ids", ()))
        stopping["stop_strings"] = tuple(stopping.get("stop_strings", ()))
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
            draft_label=h.get("draft_label", ""),
            output_logprobs=unpack_logprobs(logprobs),
        )

    def append_committed(self, session_id, expected_length, token_ids, seq, finished, finish_reason, now,
                         verifier_id=None, logprobs=None) -> int:
        packed = _pack(token_ids)
        reason = finish_reason.value if (finished and finish_reason is not None) else ""
        args = [lua.ANY_HOLDER if verifier_id is None else verifier_id, 4 * int(expected_length), packed, int(seq),
                "1" if finished else "0", reason, repr(float(now)), self._ttl_ms, pack_logprobs(logprobs)]
        result = self._run("append", session_id, args, durable=True)
        status, value = int(result[0]), result[1]
        if status == lua.COMMITTED:
            self._refresh_index(session_id, result[2])
            return int(value) // 4
        if status == lua.NOT_HOLDER:
            raise not_owner(session_id, verifier_id)
        if status == lua.LENGTH_MISMATCH:
            raise length_mismatch(session_id, expected_length, int(value) // 4)
        if status == lua.FINISHED:
            raise finished_error(session_id)
        raise not_found(session_id)

    def extend(self, session_id, expected_length, token_ids, sampling, stopping, now, verifier_id) -> int:
        packed = _pack(token_ids)
        args = [verifier_id, 4 * int(expected_length), packed, json.dumps(dataclasses.asdict(sampling)),
                json.dumps(dataclasses.asdict(stopping)), int(sampling.seed), repr(float(now)), self._ttl_ms]
        result = self._run("extend", session_id, args, durable=True)
        status, value = int(result[0]), result[1]
        if status == lua.COMMITTED:
            self._refresh_index(session_id, verifier_id)
            return int(value) // 4
        if status == lua.NOT_HOLDER:
            raise not_owner(session_id, verifier_id)
        if status == lua.LENGTH_MISMATCH:
            raise extend_conflict(session_id, expected_length, int(value) // 4)
        if status == lua.GENERATING:
            raise generating_error(session_id)
        raise not_found(session_id)

    def touch(self, session_id: str, now: float) -> bool:
        status, holder = self._run("touch", session_id, [lua.ANY_HOLDER, repr(float(now)), self._ttl_ms])
        if int(status) == lua.DONE:
            self._refresh_index(session_id, holder)
        return int(status) == lua.DONE

    def delete(self, session_id: str, verifier_id: str | None = None) -> bool:
        status, holder = self._run("delete", session_id, [lua.ANY_HOLDER if verifier_id is None else verifier_id])
        if int(status) == lua.DONE:
            self._index(session_id, remove=holder.decode())
        return int(status) == lua.DONE

    def claim(self, session_id: str, verifier_id: str, now: float) -> bool:
        status, old = self._run("claim", session_id, [lua.ANY_HOLDER, verifier_id, repr(float(now)), self._ttl_ms],
                                durable=True)
        if int(status) != lua.DONE:
            return False
        old = old.decode() if isinstance(old, bytes) else None
        self._index(session_id, add=verifier_id, remove=old or None)
        return True

    def disown(self, session_id: str, verifier_id: str) -> bool:
        status, _ = self._run("disown", session_id, [verifier_id], tokens=False)
        if int(status) == lua.DONE:
            self._index(session_id, remove=verifier_id)
        return int(status) == lua.DONE

    def session_ids_of(self, verifier_id: str) -> list[str]:
        """Ids of the live sessions held by ``verifier_id``: the index's members whose record names that
        holder (one ZRANGE, then one pipelined HGET per member; members found gone or moved are pruned)."""
        key = self.verifier_key(verifier_id)
        members = [m.decode() for m in self._call("index", self.client.zrange, key, 0, -1, key=key)]
        if not members:
            return []
        def holders():
            pipe = self.client.pipeline(transaction=False)
            for sid in members:
                pipe.hget(self.session_key(sid), "verifier_id")
            return pipe.execute()

        owners = self._call("index", holders)
        live = [sid for sid, owner in zip(members, owners) if owner is not None and owner.decode() == verifier_id]
        live_set = set(live)
        gone = [sid for sid in members if sid not in live_set]
        if gone:  # expired sessions (or moved away): prune the set
            self._call("index", self.client.zrem, key, *gone, key=key)
        return live

    def ping(self) -> bool:
        """True when the store can take a session: the master answers (under Sentinel), every slot of a Cluster is
        served (:func:`~cloud_verifier.store.redis_connect.cluster_serves_every_slot`: a PING would pass while
        the cluster is still forming), and, with ``wait_replicas`` on standalone/Sentinel, the master has that many
        replicas connected (else every commit would be unconfirmed). No retry: the health task asks again."""
        try:
            if self.target.kind == CLUSTER:
                return cluster_serves_every_slot(self.client)
            if self.wait_replicas:
                return int(self.client.info("replication").get("connected_slaves", 0)) >= self.wait_replicas
            return bool(self.client.ping())
        except Exception:  # noqa: BLE001 - any failure means "not answering"
            return False

    def close(self) -> None:
        self.client.close()
