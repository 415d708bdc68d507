"""Committed tokens' logprobs in the session stores (in-process and Redis): appended by the same write as the
tokens (a refused or repeated commit adds none), read back with the record, cleared by the next turn; under
Redis their key lives and dies with the session's other keys."""

from __future__ import annotations

import time

import pytest
import test_store
from test_store import _record, _redis_store, _wait_until

from specdec_runtime.cloud_verifier.store import RedisSessionStore
from specdec_runtime.cloud_verifier.store.redis import pack_logprobs, unpack_logprobs
from specdec_runtime.common.errors import InvalidRequestError, StaleSessionError
from specdec_runtime.common.types import SamplingParams, StoppingCriteria, TokenLogprobs

pytestmark = pytest.mark.timeout(60)

make = test_store.make  # the store factory fixture: the in-process store and Redis


def _lp(i: int, k: int = 2) -> TokenLogprobs:
    return TokenLogprobs(-0.5 - i / 7, tuple(100 + i + j for j in range(k)), tuple(-0.1 * (j + 1) - i for j in range(k)))


def test_pack_roundtrip():
    lps = [_lp(0, 0), _lp(1, 3), _lp(2, 20), TokenLogprobs(-1e-300, (2**31 - 1,), (-float("inf"),))]
    assert unpack_logprobs(pack_logprobs(lps)) == lps
    assert pack_logprobs(None) == b"" and unpack_logprobs(None) == [] and unpack_logprobs(b"") == []


def test_logprobs_committed_with_the_tokens(make):
    store = make()
    store.create(_record())  # prompt 1, 2, 3
    assert store.get("s1").output_logprobs == []
    store.append_committed("s1", 3, [4, 5], seq=1, finished=False, finish_reason=None, now=time.time(),
                           verifier_id="v1", logprobs=[_lp(0), _lp(1)])
    # the same commit again (its answer was lost): nothing appended, tokens or logprobs
    store.append_committed("s1", 3, [4, 5], seq=1, finished=False, finish_reason=None, now=time.time(),
                           verifier_id="v1", logprobs=[_lp(0), _lp(1)])
    with pytest.raises(InvalidRequestError):  # a stale block: refused, nothing appended
        store.append_committed("s1", 3, [9], seq=2, finished=False, finish_reason=None, now=time.time(),
                               verifier_id="v1", logprobs=[_lp(9)])
    with pytest.raises(StaleSessionError):  # another replica's commit: refused, nothing appended
        store.append_committed("s1", 5, [9], seq=2, finished=False, finish_reason=None, now=time.time(),
                               verifier_id="v2", logprobs=[_lp(9)])
    store.append_committed("s1", 5, [6], seq=2, finished=True, finish_reason=None, now=time.time(),
                           verifier_id="v1", logprobs=[_lp(2)])
    record = store.get("s1")
    assert record.committed_token_ids == [1, 2, 3, 4, 5, 6]
    assert record.output_logprobs == [_lp(0), _lp(1), _lp(2)]
    # the next turn has no output yet: no logprobs either
    store.extend("s1", 6, [7, 8], SamplingParams(logprobs=True, seed=1), StoppingCriteria(4), now=time.time(),
                 verifier_id="v1")
    assert store.get("s1").output_logprobs == []
    store.append_committed("s1", 8, [10], seq=3, finished=False, finish_reason=None, now=time.time(),
                           verifier_id="v1", logprobs=[_lp(5, 0)])
    assert store.get("s1").output_logprobs == [_lp(5, 0)]


def test_no_logprobs_asked_nothing_stored(make):
    store = make()
    store.create(_record())
    store.append_committed("s1", 3, [4], seq=1, finished=False, finish_reason=None, now=time.time())
    assert store.get("s1").output_logprobs == []
    if isinstance(store, RedisSessionStore):
        assert not store.client.exists(store.logprobs_key("s1"))


@pytest.mark.redis
def test_redis_logprobs_key_lives_with_the_session(redis_url):
    store = _redis_store(redis_url, ttl_s=1.5)
    try:
        store.create(_record())
        store.append_committed("s1", 3, [4], seq=1, finished=False, finish_reason=None, now=time.time(),
                               verifier_id="v1", logprobs=[_lp(0)])
        key = store.logprobs_key("s1")
        assert 0 < store.client.pttl(key) <= 1500
        for refresh in (lambda: store.touch("s1", time.time()), lambda: store.claim("s1", "v2", time.time())):
            time.sleep(0.8)
            refresh()  # refreshes every key's TTL, this one's too
            assert store.client.pttl(key) > 1000 and store.get("s1").output_logprobs == [_lp(0)]
        assert store.delete("s1")
        assert not store.client.exists(key)
        store.create(_record("s2"))
        store.append_committed("s2", 3, [4], seq=1, finished=False, finish_reason=None, now=time.time(),
                               logprobs=[_lp(0)])
        assert _wait_until(lambda: not list(store.client.scan_iter(match=f"{store.prefix}*")), timeout_s=5.0)
    finally:
        keys = list(store.client.scan_iter(match=f"{store.prefix}*"))
        if keys:
            store.client.delete(*keys)
        store.close()
