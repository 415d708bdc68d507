"""A real gRPC L7 balancer: nginx with deploy/nginx/nginx.conf (consistent hash on the SDK's affinity header) in
front of two `specdec serve` replicas sharing a real Redis. Eight concurrent SDK clients go through nginx; the
replica holding most sessions is SIGKILLed mid-run. All eight must finish token-identical to target-only
greedy decoding, and the survivor must have resumed the dead replica's sessions from Redis
(``specdec_sessions_resumed_total`` on its /metrics)."""

from __future__ import annotations

import signal
import threading
import uuid

import pytest

from _cluster import kill, nginx_binary, start_nginx, start_replicas, stop_process, wait_until
from _reference import hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(600)]

PROMPTS = [
    "Name a color.",
    "Tell me a story about a robot who learns to paint.",
    "What is 2 + 2?",
    "Translate 'good morning' to French.",
    "Write a haiku about rain.",
    "List three fruits.",
    "Why is the sky blue?",
    "Describe a cat in one sentence.",
]
MAX_NEW_TOKENS = 160
WAIT_S = 300.0


def test_eight_clients_through_nginx_survive_a_sigkill(tiny_pair, redis_url, tmp_path, capsys):
    binary = nginx_binary()
    if binary is None:
        pytest.skip("no nginx binary found: install the Debian package nginx-light (see .ci/run)")
    from specdec_runtime.cloud_verifier.store import RedisSessionStore
    from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    store = RedisSessionStore(redis_url, prefix=prefix, ttl_s=60)
    replicas = start_replicas(2, tiny_pair.target_dir, redis_url, prefix, tmp_path)
    nginx = None
    try:
        nginx, port = start_nginx(binary, [r.address for r in replicas], tmp_path)
        balancer = f"127.0.0.1:{port}"
        tokenizer = OnnxDraftModel(tiny_pair.draft_dir).tokenizer
        prompt_ids = [encode_prompt(tokenizer, p) for p in PROMPTS]
        expected = [hf_greedy(tiny_pair.target_dir, ids, MAX_NEW_TOKENS) for ids in prompt_ids]

        results, errors, failover_ms = {}, [], []

        def worker(i: int) -> None:
            try:
                model = OnnxDraftModel(tiny_pair.draft_dir if i % 2 == 0 else tiny_pair.other_draft_dir)
                backend = FailoverBackend(balancer, policy=RetryPolicy(connect_timeout_s=5.0, budget_s=60.0))
                with EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=2) as client:
                    results[i] = client.generate(prompt_ids[i], max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
                    failover_ms.extend(backend.last_failover_ms)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append((i, e))

        drafts0 = sum(r.metric("specdec_spec_decode_num_drafts_total") for r in replicas)
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()

        def progressed() -> bool:
            drafts = sum(r.metric("specdec_spec_decode_num_drafts_total") for r in replicas) - drafts0
            return drafts >= 40 or not any(t.is_alive() for t in threads)

        assert wait_until(progressed, WAIT_S, step_s=0.02)
        held = {r.verifier_id: store.session_ids_of(r.verifier_id) for r in replicas}
        victim = max(replicas, key=lambda r: len(held[r.verifier_id]))
        survivor = next(r for r in replicas if r is not victim)
        victim_sessions = held[victim.verifier_id]
        assert victim_sessions, f"no session to move: {held}"
        kill(victim, signal.SIGKILL)
        for t in threads:
            t.join(timeout=WAIT_S)
        assert not any(t.is_alive() for t in threads), "a client did not finish"
        assert not errors, errors
        for i in range(len(PROMPTS)):
            assert results[i].token_ids == expected[i], PROMPTS[i]
            assert results[i].num_unverified_tokens == 0
        moved = sum(1 for r in results.values() if r.num_failovers)
        resumed = survivor.metric("specdec_sessions_resumed_total")
        assert moved >= len(victim_sessions)
        assert resumed >= len(victim_sessions), (resumed, victim_sessions)
        with capsys.disabled():
            ms = sorted(failover_ms)
            print(f"\n[balancer] {len(victim_sessions)} sessions on the killed replica, {moved} clients moved, "
                  f"survivor resumed {resumed:.0f}; failover (first failure -> verdict) ms: "
                  f"min {ms[0]:.1f}, median {ms[len(ms) // 2]:.1f}, max {ms[-1]:.1f}")
    finally:
        if nginx is not None:
            stop_process(nginx)
        for r in replicas:
            stop_process(r.proc)
        keys = list(store.client.scan_iter(match=f"{prefix}*"))
        if keys:
            store.client.delete(*keys)
        store.close()
