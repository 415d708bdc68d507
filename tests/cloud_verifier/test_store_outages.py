"""A session store that fails for a moment changes nothing that was committed or will be: real redis-server
processes on 127.0.0.1, the tiny target behind a real gRPC server, the SDK with its retrying backend.

- Redis restarted mid-generation (data kept): blocks fail UNAVAILABLE while it is down, the SDK retries, and
  every generation ends with exactly the requested length, token-identical to target-only;
- a commit applied by Redis whose answer was lost (a proxy drops the reply, the store call times out): the retry
  of that block is answered with the committed verdict (the store is not appended twice, the stopping state does
  not count the block twice), output identical;
- the pieces on their own: the stopping state's checkpoint/restore and the idempotent compare-and-append.
"""

from __future__ import annotations

import shutil
import threading

import pytest

from _cluster import PrivateRedis, wait_until
from _reference import hf_greedy
from specdec_runtime.cloud_verifier.store import RedisSessionStore, SessionRecord
from specdec_runtime.common.errors import InvalidRequestError
from specdec_runtime.common.types import SamplingParams, StoppingCriteria

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "Tell me a story about a robot who learns to paint."


def _redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server binary (these tests stop and restart their own Redis)")
    return binary


@pytest.fixture(scope="module")
def runner(tiny_pair):
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner

    return TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=16384)


@pytest.fixture(scope="module")
def draft(tiny_pair):
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    return OnnxDraftModel(tiny_pair.draft_dir)


@pytest.fixture(scope="module")
def prompt_ids(draft):
    from specdec_runtime.edge_client.client import encode_prompt

    return encode_prompt(draft.tokenizer, PROMPT)


@pytest.fixture(scope="module")
def expected(tiny_pair, prompt_ids):
    return hf_greedy(tiny_pair.target_dir, prompt_ids, 160)


def _generate(verifier, draft, prompt_ids, max_new_tokens, during, after_chunks=4):
    """Greedy generation through a gRPC server over ``verifier``; ``during()`` runs after ``after_chunks``
    streamed chunks. Returns the SDK's result."""
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
    from specdec.embedded import EmbeddedServer

    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address:
        backend = FailoverBackend(address, policy=RetryPolicy(connect_timeout_s=2.0, budget_s=30.0,
                                                              max_attempts=50))
        with EdgeClient(backend, ModelDrafter(draft), draft.tokenizer, num_speculative_tokens=3) as client:
            stream = client.stream_chunks(prompt_ids, max_new_tokens=max_new_tokens, ignore_eos=True)
            for _ in range(after_chunks):
                next(stream)
            during()
            list(stream)
            return client.last_result


def _verifier(runner, store):
    from specdec_runtime.cloud_verifier.verifier import Verifier

    return Verifier(runner, store, verifier_id="outage-verifier", max_batch_wait_ms=1.0)


@pytest.mark.redis
@pytest.mark.parametrize("max_new_tokens", [40, 160])
def test_redis_restart_mid_generation_keeps_the_requested_length(runner, draft, prompt_ids, expected,
                                                                  max_new_tokens):
    """Redis down for 1.5 s (data kept): the output is the requested length, identical to target-only, in one
    session (nothing re-opened), and the store holds exactly those tokens once."""
    rd = PrivateRedis(_redis_binary()).start()
    store = RedisSessionStore(rd.url, prefix="specdec-test:", ttl_s=60, socket_timeout_s=0.5)
    restart = threading.Thread(target=rd.restart_keeping_data, args=(1.5,), daemon=True)

    def go_down():  # the generation goes on while Redis is down: its next blocks meet the outage
        restart.start()
        assert wait_until(lambda: rd.proc is None, 10.0)

    try:
        result = _generate(_verifier(runner, store), draft, prompt_ids, max_new_tokens, go_down)
        restart.join(30.0)
        assert result.num_failovers >= 1  # blocks did fail while Redis was down
        assert result.token_ids == expected[:max_new_tokens]
        assert result.finish_reason.value == "length" and result.num_sessions == 1
        assert result.num_unverified_tokens == 0
    finally:
        store.close()
        rd.stop()


@pytest.mark.redis
def test_lost_commit_reply_is_answered_once(runner, draft, prompt_ids, expected):
    """The commit ran in Redis, its reply was dropped (the store call timed out): the retried block gets the
    committed verdict; the output has the requested 40 tokens, identical to target-only, none twice."""
    from _proxy import ReplyDroppingProxy

    rd = PrivateRedis(_redis_binary()).start()
    proxy = ReplyDroppingProxy(rd.port)
    store = RedisSessionStore(f"redis://127.0.0.1:{proxy.port}/0", prefix="specdec-test:", ttl_s=60,
                              socket_timeout_s=0.5)
    verifier = _verifier(runner, store)
    try:
        result = _generate(verifier, draft, prompt_ids, 40, lambda: proxy.drop_reply_to(store._append.sha.encode()))
        assert proxy.num_dropped == 1
        assert result.token_ids == expected[:40]
        assert result.finish_reason.value == "length" and result.num_sessions == 1
    finally:
        store.close()
        proxy.close()
        rd.stop()


# ---------------------------------------------------------------------------------------------- the pieces


def test_stop_checker_restore_forgets_a_block(draft):
    """After checkpoint → append → restore, the checker answers the same block as a fresh one would: the
    length counter, the stop-string window and the finish state all went back (stop strings across tokens)."""
    from specdec_runtime.common.stopping import StopChecker

    ids = draft.tokenizer.encode(" the cat sat on the mat and the dog sat on the log", add_special_tokens=False)
    criteria = StoppingCriteria(len(ids) - 2, stop_strings=["dog sat"])
    fresh = StopChecker(draft.tokenizer, criteria, [], 4, 4096)
    checker = StopChecker(draft.tokenizer, criteria, [], 4, 4096)
    split = len(ids) // 3
    assert checker.append(ids[:split]) == fresh.append(ids[:split])
    state = checker.checkpoint()
    first = checker.append(ids[split:])
    assert first[1] is not None  # the block stops (the stop string lies in it)
    checker.restore(state)
    assert not checker.finished and checker.num_generated == split
    assert checker.append(ids[split:]) == fresh.append(ids[split:]) == first


@pytest.fixture
def store(memory_or_redis_store):
    return memory_or_redis_store


def test_the_same_commit_again_is_answered_as_the_first(store):
    """A commit sent twice (its first answer lost) appends once and answers the same length; a different block
    at the old length, or the same tokens under another seq, is still a mismatch."""
    record = SessionRecord("s1", "v1", "m", 3, [1, 2, 3], SamplingParams(), StoppingCriteria(8), 7, 0.0, 0.0)
    store.create(record)
    assert store.append_committed("s1", 3, [4, 5], 1, False, None, 1.0, verifier_id="v1") == 5
    assert store.append_committed("s1", 3, [4, 5], 1, False, None, 2.0, verifier_id="v1") == 5
    assert store.get("s1").committed_token_ids == [1, 2, 3, 4, 5]
    for tokens, seq in (([4, 6], 1), ([4, 5], 2), ([4], 1)):
        with pytest.raises(InvalidRequestError):
            store.append_committed("s1", 3, tokens, seq, False, None, 3.0, verifier_id="v1")
    assert store.get("s1").committed_token_ids == [1, 2, 3, 4, 5]
