"""Every Redis write the store may send twice (its first answer lost, then retried after a failover) is
answered as the first time and changes nothing more: create, commit, extend, claim; the key layout keeps each
session's keys in one hash slot."""

from __future__ import annotations

import uuid

import pytest

from specdec_runtime.cloud_verifier.store import RedisSessionStore, SessionRecord
from specdec_runtime.common.errors import ConflictError
from specdec_runtime.common.types import SamplingParams, StoppingCriteria

pytestmark = pytest.mark.redis


@pytest.fixture()
def store(redis_url):
    st = RedisSessionStore(redis_url, prefix=f"specdec-test:{uuid.uuid4().hex}:", ttl_s=30)
    yield st
    keys = list(st.client.scan_iter(match=f"{st.prefix}*"))
    if keys:
        st.client.delete(*keys)
    st.close()


def _record(sid: str = "s", vid: str = "v1") -> SessionRecord:
    return SessionRecord(sid, vid, "m", 3, [1, 2, 3], SamplingParams(), StoppingCriteria(max_new_tokens=4),
                         seed=1, created_at=5.0, last_seen_at=5.0)


def test_one_hash_slot_per_session(store):
    from redis.cluster import key_slot

    meta, tokens, index = store.keys_of("abc", "v1")
    assert meta.endswith("{abc}:meta") and tokens.endswith("{abc}:tokens")
    assert key_slot(meta.encode()) == key_slot(tokens.encode()) != key_slot(index.encode())


def test_create_again_is_the_same_create(store):
    store.create(_record())
    store.create(_record())  # the same call again: answered as created
    with pytest.raises(ValueError, match="exists"):
        store.create(_record(vid="v2"))  # another replica's session with that id
    with pytest.raises(ValueError, match="exists"):
        store.create(SessionRecord(**{**_record().__dict__, "created_at": 6.0}))


def test_extend_again_is_the_same_extend(store):
    store.create(_record())
    store.append_committed("s", 3, [4, 5, 6, 7], seq=1, finished=True, finish_reason=None, now=6.0,
                           verifier_id="v1")
    args = ("s", 7, [8, 9], SamplingParams(seed=1), StoppingCriteria(max_new_tokens=4), 7.0, "v1")
    assert store.extend(*args) == 9
    assert store.extend(*args) == 9  # the same turn again: answered as the first, nothing appended
    got = store.get("s")
    assert got.committed_token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9] and got.prompt_length == 9
    with pytest.raises(ConflictError):  # another turn at the old length is still refused
        store.extend("s", 7, [8, 9], SamplingParams(seed=1), StoppingCriteria(max_new_tokens=4), 8.0, "v1")


def test_claim_again_is_the_same_claim(store):
    store.create(_record())
    assert store.claim("s", "v2", now=6.0)
    assert store.claim("s", "v2", now=6.0)
    assert store.get("s").verifier_id == "v2"
    assert store.session_ids_of("v2") == ["s"] and store.session_ids_of("v1") == []


def test_index_is_repaired_by_a_commit(store):
    """An index update lost (deleted here) comes back with the session's next commit after TTL / 4."""
    store.create(_record())
    store.client.delete(store.verifier_key("v1"))
    assert store.session_ids_of("v1") == []
    store._indexed.clear()  # as if the last refresh was long ago
    store.append_committed("s", 3, [4], seq=1, finished=False, finish_reason=None, now=6.0)
    assert store.session_ids_of("v1") == ["s"]
