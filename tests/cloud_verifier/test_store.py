"""Session stores: the in-process one and Redis (a real server) pass the same tests."""

from __future__ import annotations

import time
import uuid

import pytest

from specdec_runtime.cloud_verifier.config import VerifierSettings
from specdec_runtime.cloud_verifier.store import (
    MemorySessionStore,
    RedisSessionStore,
    SessionRecord,
    make_store,
)
from specdec_runtime.common.errors import InvalidRequestError, PreconditionError, SessionNotFoundError
from specdec_runtime.common.types import FinishReason, SamplingParams, StoppingCriteria

pytestmark = pytest.mark.timeout(60)


def _redis_store(redis_url: str, ttl_s: float) -> RedisSessionStore:
    return RedisSessionStore(redis_url, prefix=f"specdec-test:{uuid.uuid4().hex}:", ttl_s=ttl_s)


def _cleanup(store) -> None:
    if isinstance(store, RedisSessionStore):
        keys = list(store.client.scan_iter(match=f"{store.prefix}*"))
        if keys:
            store.client.delete(*keys)
        store.close()


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def make(request):
    """Factory ``make(ttl_s=60) -> SessionStore``; Redis stores get a unique prefix and are cleaned up."""
    made = []

    def factory(ttl_s: float = 60):
        if request.param == "memory":
            store = MemorySessionStore(ttl_s=ttl_s)
        else:
            store = _redis_store(request.getfixturevalue("redis_url"), ttl_s)
        made.append(store)
        return store

    yield factory
    for store in made:
        _cleanup(store)


def _record(session_id: str = "s1", verifier_id: str = "v1", prompt=(1, 2, 3)) -> SessionRecord:
    now = time.time()
    return SessionRecord(
        session_id=session_id,
        verifier_id=verifier_id,
        model_id="tiny",
        prompt_length=len(prompt),
        committed_token_ids=list(prompt),
        sampling=SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=2**63 + 5),
        stopping=StoppingCriteria(max_new_tokens=32, stop_token_ids=(7, 8), stop_strings=("\n\n", "END"),
                                  ignore_eos=True),
        seed=2**63 + 5,
        created_at=now,
        last_seen_at=now,
    )


def _wait_until(pred, timeout_s: float = 5.0, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step_s)
    return pred()


def test_create_get_roundtrip(make):
    store = make()
    rec = _record()
    store.create(rec)
    got = store.get("s1")
    assert got == rec
    assert got.committed_length == 3 and got.output_token_ids == []
    assert store.get("nope") is None
    with pytest.raises(ValueError):
        store.create(_record())
    got.committed_token_ids.append(99)  # a copy: the store is unchanged
    assert store.get("s1").committed_length == 3


def test_append_committed_cas(make):
    store = make()
    store.create(_record())
    assert store.append_committed("s1", 3, [10, 11], seq=1, finished=False, finish_reason=None, now=100.0) == 5
    assert store.append_committed("s1", 5, [2**31 - 1], seq=2, finished=False, finish_reason=None, now=101.0) == 6
    got = store.get("s1")
    assert got.committed_token_ids == [1, 2, 3, 10, 11, 2**31 - 1]
    assert got.output_token_ids == [10, 11, 2**31 - 1]
    assert got.last_seq == 2 and got.last_seen_at == 101.0 and not got.finished
    assert store.append_committed("s1", 6, [5], seq=3, finished=True, finish_reason=FinishReason.EOS,
                                  now=102.0) == 7
    got = store.get("s1")
    assert got.finished and got.finish_reason is FinishReason.EOS and got.last_seq == 3
    with pytest.raises(PreconditionError):  # nothing is committed after the end
        store.append_committed("s1", 7, [6], seq=4, finished=False, finish_reason=None, now=103.0)
    assert store.get("s1").committed_length == 7


def test_stale_append_rejected_nothing_changed(make):
    store = make()
    store.create(_record())
    store.append_committed("s1", 3, [10], seq=1, finished=False, finish_reason=None, now=50.0)
    before = store.get("s1")
    for expected in (3, 5, 0):  # duplicate (stale) block, a block from the future, nonsense
        with pytest.raises(InvalidRequestError, match="committed length"):
            store.append_committed("s1", expected, [42, 43], seq=9, finished=True,
                                   finish_reason=FinishReason.LENGTH, now=60.0)
    assert store.get("s1") == before
    with pytest.raises(SessionNotFoundError):
        store.append_committed("gone", 3, [1], seq=1, finished=False, finish_reason=None, now=1.0)


@pytest.mark.redis
def test_every_key_has_ttl(redis_url):
    store = _redis_store(redis_url, ttl_s=30)
    try:
        _check_every_key_has_ttl(store)
    finally:
        _cleanup(store)


def _check_every_key_has_ttl(store: RedisSessionStore) -> None:
    store.create(_record())
    store.append_committed("s1", 3, [4], seq=1, finished=False, finish_reason=None, now=time.time())
    keys = list(store.client.scan_iter(match=f"{store.prefix}*"))
    assert {k.decode() for k in keys} == set(store.keys_of("s1", "v1"))
    for key in keys:
        pttl = store.client.pttl(key)
        assert 0 < pttl <= 30_000, (key, pttl)
    # the commit is an APPEND of little-endian int32s
    assert store.client.strlen(store.tokens_key("s1")) == 4 * 4


def test_expiry_removes_everything(make):
    store = make(ttl_s=0.4)
    store.create(_record())
    assert store.get("s1") is not None
    assert _wait_until(lambda: store.get("s1") is None, timeout_s=5.0)
    assert store.session_ids_of("v1") == []
    assert not store.touch("s1", time.time())
    with pytest.raises(SessionNotFoundError):
        store.append_committed("s1", 3, [1], seq=1, finished=False, finish_reason=None, now=time.time())
    if isinstance(store, RedisSessionStore):
        assert _wait_until(lambda: not list(store.client.scan_iter(match=f"{store.prefix}*")), timeout_s=5.0)


def test_touch_refreshes_ttl(make):
    store = make(ttl_s=0.6)
    store.create(_record())
    deadline = time.monotonic() + 1.5  # well past one TTL, kept alive by touches
    while time.monotonic() < deadline:
        assert store.touch("s1", now=123.0)
        time.sleep(0.1)
    got = store.get("s1")
    assert got is not None and got.last_seen_at == 123.0
    # appends refresh too
    deadline = time.monotonic() + 1.0
    n = 3
    while time.monotonic() < deadline:
        n = store.append_committed("s1", n, [9], seq=n, finished=False, finish_reason=None, now=124.0)
        time.sleep(0.1)
    assert store.get("s1") is not None
    assert _wait_until(lambda: store.get("s1") is None, timeout_s=5.0)


def test_session_ids_of_and_delete(make):
    store = make()
    store.create(_record("a", "v1"))
    store.create(_record("b", "v1"))
    store.create(_record("c", "v2"))
    assert sorted(store.session_ids_of("v1")) == ["a", "b"]
    assert store.session_ids_of("v2") == ["c"]
    assert store.session_ids_of("v3") == []
    assert store.delete("a")
    assert not store.delete("a")
    assert store.get("a") is None
    assert store.session_ids_of("v1") == ["b"]
    with pytest.raises(SessionNotFoundError):
        store.append_committed("a", 3, [1], seq=1, finished=False, finish_reason=None, now=1.0)
    assert store.delete("b") and store.delete("c")
    if isinstance(store, RedisSessionStore):
        assert not list(store.client.scan_iter(match=f"{store.prefix}*"))


def test_ping(make):
    assert make().ping()


@pytest.mark.redis
def test_redis_shared_between_replicas(redis_url):
    """Two store objects (two replicas) see the same sessions; the owner cache cannot go stale silently."""
    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    a = RedisSessionStore(redis_url, prefix=prefix, ttl_s=30)
    b = RedisSessionStore(redis_url, prefix=prefix, ttl_s=30)
    try:
        a.create(_record("s", "va"))
        assert b.append_committed("s", 3, [4], seq=1, finished=False, finish_reason=None, now=1.0) == 4
        assert a.append_committed("s", 4, [5], seq=2, finished=False, finish_reason=None, now=2.0) == 5
        # the same commit again is answered as the first (its answer may have been lost); another one is not
        assert b.append_committed("s", 4, [5], seq=2, finished=False, finish_reason=None, now=2.0) == 5
        with pytest.raises(InvalidRequestError):
            b.append_committed("s", 4, [6], seq=2, finished=False, finish_reason=None, now=2.0)
        # deleted by one replica and re-created under another owner with the same id: a's cache is refreshed
        assert b.delete("s")
        b.create(_record("s", "vb"))
        assert a.append_committed("s", 3, [6], seq=1, finished=False, finish_reason=None, now=3.0) == 4
        assert a.session_ids_of("vb") == ["s"] and a.session_ids_of("va") == []
    finally:
        _cleanup(a)
        b.close()


def test_redis_unreachable_is_unavailable():
    from specdec_runtime.common.errors import VerifierUnavailableError

    store = RedisSessionStore("redis://127.0.0.1:1/0", ttl_s=5, socket_timeout_s=0.5)
    assert not store.ping()
    with pytest.raises(VerifierUnavailableError, match="session store unreachable"):
        store.get("x")


def test_make_store(redis_url):
    assert isinstance(make_store(VerifierSettings(redis_url=None, metrics_port=0)), MemorySessionStore)
    store = make_store(VerifierSettings(redis_url=redis_url, redis_prefix="specdec-test:mk:", session_ttl_s=7))
    try:
        assert isinstance(store, RedisSessionStore) and store.ttl_s == 7 and store.prefix == "specdec-test:mk:"
        assert store.ping()
    finally:
        store.close()


def test_claim_moves_session_between_replicas(make):
    store = make()
    store.create(_record("s", "v1"))
    assert store.claim("s", "v2", now=77.0)
    got = store.get("s")
    assert got.verifier_id == "v2" and got.last_seen_at == 77.0
    assert store.session_ids_of("v1") == [] and store.session_ids_of("v2") == ["s"]
    # commits keep working after the move
    assert store.append_committed("s", 3, [4], seq=1, finished=False, finish_reason=None, now=78.0) == 4
    # the old replica's reaper cannot delete it any more; the holder can
    assert not store.delete("s", verifier_id="v1")
    assert store.get("s") is not None
    assert store.delete("s", verifier_id="v2")
    assert store.get("s") is None
    assert not store.claim("s", "v3", now=79.0)
    if isinstance(store, RedisSessionStore):
        assert not list(store.client.scan_iter(match=f"{store.prefix}*"))
