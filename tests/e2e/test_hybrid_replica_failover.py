"""A hybrid target under load and a replica crash, with real processes: two `specdec serve` replicas of a tiny LFM2
(short-conv layer, then attention: cloud_verifier/kv/recurrent_state.py) share a real Redis, each with a paged KV pool
far too small for its sessions (recompute preemption drops a session's pages and its recurrent state; its next
row recomputes both from the committed ids). Eight real :class:`EdgeClient` generations (threads, greedy, a tiny
Llama ONNX draft sharing the target's embeddings and tokenizer, ``FailoverBackend`` over both addresses) run
concurrently on the first replica; once each has verdicts and the pool has run short (a session preempted),
it is SIGKILLed. The second resumes every session from the store (rebuilding the recurrent state from the
committed ids) and finishes them under preemption too.

Checks: every output token-identical to target-only HF greedy decoding (tests/_reference.py), every session failed
over once and was resumed on the survivor, preemptions > 0 on both replicas, the sessions shared forward passes.

Sizes: prompts of 24 random token ids, 72 new tokens (96 positions: 6 pages of 16); pools of 20 pages for 8
sessions (48 pages at their end)."""

from __future__ import annotations

import random
import signal
import threading
import uuid

import pytest
from _cluster import kill, start_replicas, stop_process, wait_until
from _reference import hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(600)]

SESSIONS = 8
PROMPT = 24  # tokens
NEW = 72  # tokens generated per session
PAGE = 16  # KV page size, tokens
POOL_PAGES = 20  # per replica: 8 sessions need 16 for their prompts, 48 at their end
WAIT_S = 240.0


@pytest.fixture(scope="module")
def hybrid_pair(arch_models):
    """(tiny LFM2 target dir, its sibling Llama draft exported to ONNX): tests/e2e/conftest.py."""
    return arch_models("lfm2")


@pytest.fixture()
def hybrid_cluster(hybrid_pair, redis_url, tmp_path):
    """Two replicas of the hybrid target with small KV pools, sharing Redis under a private key prefix."""
    import redis

    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    env = {"SPECDEC_KV_PAGE_SIZE": str(PAGE), "SPECDEC_KV_CACHE_BUDGET_TOKENS": str(POOL_PAGES * PAGE),
           "SPECDEC_PREFILL_CHUNK_TOKENS": "32", "SPECDEC_MAX_BATCH_WAIT_MS": "2"}
    replicas = start_replicas(2, hybrid_pair[0], redis_url, prefix, tmp_path, env=env)
    yield replicas
    for r in replicas:
        stop_process(r.proc)
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


def _client(addresses, onnx_dir):
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    model = OnnxDraftModel(onnx_dir, intra_op_num_threads=1)
    backend = FailoverBackend(addresses, policy=RetryPolicy(connect_timeout_s=5.0, budget_s=60.0))
    return EdgeClient(backend, ModelDrafter(model, draft_top_k=4), model.tokenizer, num_speculative_tokens=4,
                      timeout_s=120.0)


def test_eight_hybrid_sessions_preempted_and_failed_over_are_token_identical(hybrid_pair, hybrid_cluster, capsys):
    target_dir, onnx_dir = hybrid_pair
    a, b = hybrid_cluster
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 49152) for _ in range(PROMPT)] for _ in range(SESSIONS)]
    expected = [hf_greedy(target_dir, p, NEW) for p in prompts]
    blocks = [0] * SESSIONS  # verdicts (chunks) received per session
    results, errors = {}, []

    def worker(i):
        try:
            with _client([a.address, b.address], onnx_dir) as client:
                for _ in client.stream_chunks(prompts[i], max_new_tokens=NEW, ignore_eos=True):
                    blocks[i] += 1
                results[i] = client.last_result
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((i, e))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(SESSIONS)]
    for t in threads:
        t.start()
    # the kill: once every session has a verdict from A and A's pool has run short (a session preempted)
    mid_run = lambda: min(blocks) >= 1 and a.metric("specdec_kv_preemptions_total") > 0
    assert wait_until(lambda: mid_run() or errors or results, WAIT_S), f"no progress on A: {blocks}"
    assert not errors and not results, (errors, blocks)  # every session is mid-generation
    preempted_on_a, blocks_at_kill = a.metric("specdec_kv_preemptions_total"), list(blocks)
    assert a.metric("specdec_spec_decode_num_drafts_total") > 0, "the sessions are not on the first replica"
    # read before the kill: a session failed over after it may reach B before a read made once A is dead
    assert b.metric("specdec_spec_decode_num_drafts_total") == 0, "a session left A before the kill"
    kill(a, signal.SIGKILL)
    a.proc.wait(timeout=30)
    for t in threads:
        t.join(timeout=WAIT_S)
    assert not any(t.is_alive() for t in threads), f"a generation did not end: {blocks}"
    assert not errors, errors
    for i in range(SESSIONS):
        assert results[i].token_ids == expected[i], f"session {i} differs from target-only greedy"
        assert results[i].num_failovers >= 1 and results[i].num_unverified_tokens == 0
    assert preempted_on_a > 0, "the first replica's pool was never short: no preemption before the kill"
    assert b.metric("specdec_kv_preemptions_total") > 0, "the survivor's pool was never short"
    assert b.metric("specdec_sessions_resumed_total") == SESSIONS
    passes = b.metric("specdec_batch_size_count")
    assert passes and b.metric("specdec_batch_size_sum") / passes > 1.5, "the sessions seldom shared a forward pass"
    assert wait_until(lambda: b.metric("specdec_kv_cache_pages_used") == 0, 30.0), "pages left held on the survivor"
    with capsys.disabled():
        print(f"\n[hybrid failover] verdicts per session at the kill {blocks_at_kill}; preemptions A {preempted_on_a:.0f}, "
              f"B {b.metric('specdec_kv_preemptions_total'):.0f}; mean batch on B {b.metric('specdec_batch_size_sum') / passes:.1f}")
