"""`specdec serve --tensor-parallel 2` as real processes: replica A shards a tiny Llama (GQA 4/2) over two gloo
ranks that serve started itself; replica B serves it on one rank (TP=1); both share a real Redis.

- A generation over gRPC on A alone is token-identical to target-only HF greedy decoding; A's /metrics report
  each rank's weight and KV bytes and the all-reduce time of its forward passes.
- Eight generations (``FailoverBackend`` over A then B) each hold a verdict from A and then pause in the client;
  rank 1 of A is SIGKILLed. A's health leaves SERVING, A (rank 0) exits non-zero with one line naming rank 1,
  no rank process is left, and every generation finishes on B token-identical to target-only greedy decoding.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import uuid

import pytest
from _cluster import health_status, start_replicas, stop_process, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(600)]

SESSIONS = 8
PROMPT = 12  # tokens
NEW = 32  # tokens generated per session
WAIT_S = 180.0


@pytest.fixture()
def cluster(tiny_pair, redis_url, tmp_path):
    import redis

    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    a = start_replicas(1, tiny_pair.target_dir, redis_url, prefix, tmp_path, names=["tp-a"],
                       env={"SPECDEC_TENSOR_PARALLEL": "2"}, wait_serving=False)[0]
    b = start_replicas(1, tiny_pair.target_dir, redis_url, prefix, tmp_path, names=["tp-b"], wait_serving=False)[0]
    try:
        for r in (a, b):
            assert wait_until(lambda r=r: health_status(r.address, timeout_s=0.5) == "SERVING" or not r.alive(),
                              WAIT_S), f"{r.verifier_id} did not start:\n{r.log()}"
            assert r.alive(), f"{r.verifier_id} exited:\n{r.log()}"
        yield a, b
    finally:
        for r in (a, b):
            stop_process(r.proc)
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()


def _client(addresses, onnx_dir):
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy

    model = OnnxDraftModel(onnx_dir, intra_op_num_threads=1)
    backend = FailoverBackend(addresses, policy=RetryPolicy(connect_timeout_s=5.0, budget_s=60.0))
    return EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=4, timeout_s=120.0)


def _hf_greedy_all(model_dir, prompts) -> list[list[int]]:
    """Target-only greedy decoding of each prompt with plain HF ``generate`` (tests/_reference.py's, one load)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def _pid_gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_tp2_serves_identically_and_a_killed_rank_takes_the_replica_down(tiny_pair, cluster):
    a, b = cluster
    rng = random.Random(5)
    prompts = [[1] + [rng.randrange(3, 49152) for _ in range(PROMPT - 1)] for _ in range(SESSIONS)]
    expected = _hf_greedy_all(tiny_pair.target_dir, prompts)
    with _client([a.address], tiny_pair.draft_dir) as client:
        alone = client.generate(prompts[0], max_new_tokens=NEW, ignore_eos=True)
    assert alone.token_ids == expected[0] and alone.num_failovers == 0
    assert a.metric('specdec_tp_world_size') == 2
    assert a.metric('specdec_tp_rank_weight_bytes{rank="1"}') > 0 and a.metric('specdec_tp_rank_kv_bytes{rank="1"}') > 0
    assert a.metric("specdec_tp_allreduce_seconds_count") > 0
    rank1 = int(re.search(r"started ranks 1 \(pids (\d+)\)", a.log_path.read_text()).group(1))

    first, go = threading.Semaphore(0), threading.Event()
    results, errors = {}, []

    def worker(i):
        try:
            with _client([a.address, b.address], tiny_pair.draft_dir) as client:
                for n, _ in enumerate(client.stream_chunks(prompts[i], max_new_tokens=NEW, ignore_eos=True)):
                    if n == 0:  # a verdict from A, then wait in the client: every session is mid-generation
                        first.release()
                        go.wait(WAIT_S)
                results[i] = client.last_result
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((i, e))
            first.release()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(SESSIONS)]
    for t in threads:
        t.start()
    for _ in range(SESSIONS):
        assert first.acquire(timeout=WAIT_S), "a session got no verdict from A"
    assert not errors, errors
    assert b.metric("specdec_spec_decode_num_drafts_total") == 0, "a session left A before the kill"
    os.kill(rank1, signal.SIGKILL)
    assert wait_until(lambda: health_status(a.address, timeout_s=0.5) != "SERVING", 30.0), "A still SERVING"
    go.set()
    assert wait_until(lambda: not a.alive(), 60.0), f"rank 0 did not exit:\n{a.log()}"
    assert a.proc.returncode != 0
    assert "tensor parallel: rank 1 exited" in a.log()
    assert wait_until(lambda: _pid_gone(rank1), 30.0)
    for t in threads:
        t.join(timeout=WAIT_S)
    assert not any(t.is_alive() for t in threads), "a generation did not end"
    assert not errors, errors
    for i in range(SESSIONS):
        assert results[i].token_ids == expected[i], f"session {i} differs from target-only greedy"
        assert results[i].num_failovers >= 1
    assert b.metric("specdec_sessions_resumed_total") == SESSIONS
