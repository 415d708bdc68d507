"""Failover end to end with real processes: two `specdec serve` replicas (tiny target) sharing a real Redis, the
SDK / CLI given both addresses. A replica is SIGKILLed or SIGTERMed mid-generation; the output must not change.

- SIGKILL under the CLI (``specdec generate --server A,B``): exit 0, ``num_failovers`` >= 1, token ids identical
  to target-only greedy decoding; the survivor resumed the session from Redis.
- SIGKILL under the SDK with seeded sampling: token ids identical to an uninterrupted run (the random stream is
  keyed by position); failover time (first failure -> verdict) measured.
- SIGTERM: health NOT_SERVING at once, clients move to the other replica without an error, the drained replica
  gives its sessions up in the store and the other one takes them at their next block.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from _cluster import ROOT, kill, start_replicas, stop_process, wait_until
from _reference import hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(600)]

PROMPT = "Tell me a story about a robot who learns to paint."
WAIT_S = 180.0


@pytest.fixture()
def cluster(tiny_pair, redis_url, tmp_path):
    """Two replicas (replica-a, replica-b) sharing Redis under a private key prefix."""
    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    replicas = start_replicas(2, tiny_pair.target_dir, redis_url, prefix, tmp_path)
    yield replicas, prefix
    for r in replicas:
        stop_process(r.proc)
    import redis

    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_pair.draft_dir))


def _drafts(replica) -> float:
    return replica.metric("specdec_spec_decode_num_drafts_total")


def _sdk_client(addresses, draft_dir, **kw):
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    model = OnnxDraftModel(draft_dir)
    backend = FailoverBackend(addresses, policy=RetryPolicy(connect_timeout_s=5.0, budget_s=30.0))
    return EdgeClient(backend, ModelDrafter(model, draft_top_k=4), model.tokenizer, **kw)


def test_cli_sigkill_mid_run_token_identical(cluster, tiny_pair, tokenizer, tmp_path):
    """`specdec generate --server A,B` with A SIGKILLed mid-run: exit 0, num_failovers >= 1, target-only output."""
    from specdec_runtime.edge_client.client import encode_prompt

    (a, b), _ = cluster
    n = 200
    expected = hf_greedy(tiny_pair.target_dir, encode_prompt(tokenizer, PROMPT), n)
    a0 = _drafts(a)
    out_path = tmp_path / "out.json"
    with open(out_path, "wb") as out, open(tmp_path / "err.txt", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specdec.cli", "generate", PROMPT, "--server", f"{a.address},{b.address}",
             "--draft", str(tiny_pair.draft_dir), "--temperature", "0", "--max-new-tokens", str(n), "--ignore-eos",
             "--fixed-gamma", "-g", "4", "--network-delay-ms", "5", "--json"],
            stdout=out, stderr=err, cwd=str(ROOT),
        )
    try:
        assert wait_until(lambda: _drafts(a) - a0 >= 10 or proc.poll() is not None, WAIT_S), "no progress on A"
        assert proc.poll() is None, "the generation ended before A could be killed"
        kill(a, signal.SIGKILL)
        assert proc.wait(timeout=WAIT_S) == 0, (tmp_path / "err.txt").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    result = json.loads(out_path.read_text())
    assert result["num_failovers"] >= 1
    assert result["num_unverified_tokens"] == 0
    assert result["token_ids"] == expected
    assert b.metric("specdec_sessions_resumed_total") >= 1


def test_sdk_seeded_sampling_identical_across_sigkill(cluster, tiny_pair, capsys):
    """Seeded sampled output with the holding replica SIGKILLed mid-run equals the uninterrupted output."""
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec.embedded import LocalBackend

    (a, b), _ = cluster
    kwargs = dict(max_new_tokens=160, temperature=0.9, top_p=0.95, seed=4321, ignore_eos=True)
    local = LocalBackend(Verifier(TargetRunner(tiny_pair.target_dir)))
    try:
        model = OnnxDraftModel(tiny_pair.other_draft_dir)
        reference = EdgeClient(local, ModelDrafter(model, draft_top_k=4), model.tokenizer,
                               num_speculative_tokens=3).generate(PROMPT, **kwargs)
    finally:
        local.close()
    with _sdk_client([a.address, b.address], tiny_pair.other_draft_dir, num_speculative_tokens=3) as client:
        chunks = client.stream_chunks(PROMPT, **kwargs)
        for _ in range(20):  # part of the output, from replica A
            next(chunks)
        assert _drafts(a) > 0
        kill(a, signal.SIGKILL)
        rest = list(chunks)
        result = client.last_result
        failover_ms = list(client.backend.last_failover_ms)
    assert rest and all(c.verified for c in rest)
    assert result.token_ids == reference.token_ids
    assert result.num_failovers >= 1 and result.num_unverified_tokens == 0
    assert b.metric("specdec_sessions_resumed_total") >= 1
    with capsys.disabled():
        print(f"\n[failover] SIGKILL, SDK [A,B]: first failure -> verdict {', '.join(f'{m:.1f}' for m in failover_ms)} ms")


def test_sigterm_drains_gives_up_sessions_and_clients_move(cluster, tiny_pair, tokenizer, redis_url):
    """SIGTERM on A: health NOT_SERVING at once; clients finish on B without an error and unchanged; A gives its
    sessions up in the store; B takes them at their next block."""
    from specdec_runtime.cloud_verifier.store import RedisSessionStore
    from specdec_runtime.common.types import DraftBlock, OpenRequest, SamplingParams, StoppingCriteria
    from specdec_runtime.edge_client.client import encode_prompt
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

    (a, b), prefix = cluster
    store = RedisSessionStore(redis_url, prefix=prefix, ttl_s=60)
    prompt_ids = encode_prompt(tokenizer, PROMPT)
    n = 160
    expected = hf_greedy(tiny_pair.target_dir, prompt_ids, n)
    idle_backend = GrpcBackend(a.address)  # a session opened on A and left idle
    idle = idle_backend.open_session(OpenRequest(prompt_ids, SamplingParams(),
                                                 StoppingCriteria(max_new_tokens=8, ignore_eos=True)))
    assert store.get(idle.session_id).verifier_id == a.verifier_id

    results, errors = {}, []

    def worker(i):
        try:
            with _sdk_client([a.address, b.address], tiny_pair.draft_dir, num_speculative_tokens=2) as client:
                results[i] = client.generate(prompt_ids, max_new_tokens=n, ignore_eos=True)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    channel = grpc.insecure_channel(a.address)
    watch = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service="specdec.v1.Verifier"), timeout=WAIT_S)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    a0 = _drafts(a)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert wait_until(lambda: _drafts(a) - a0 >= 20, WAIT_S), "no progress on A"
    kill(a, signal.SIGTERM)
    statuses = []
    try:
        for msg in watch:
            statuses.append(msg.status)
            if msg.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
    except grpc.RpcError:
        pass
    channel.close()
    for t in threads:
        t.join(timeout=WAIT_S)
    assert a.proc.wait(timeout=60) == 0, a.log()
    assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses  # announced on the Watch before it went away
    assert not errors, errors
    assert len(results) == 3 and all(r.token_ids == expected for r in results.values())
    assert sum(r.num_failovers for r in results.values()) >= 1
    assert "gave up" in a.log()
    record = store.get(idle.session_id)
    assert record.verifier_id == ""  # given up: held by no replica
    assert store.session_ids_of(a.verifier_id) == []
    resumed = b.metric("specdec_sessions_resumed_total")
    with GrpcBackend(b.address) as backend_b:  # the next block, on B: resumed there
        verdict = backend_b.submit(idle.session_id, 1, len(prompt_ids), DraftBlock([expected[0]])).result(timeout=60)
    assert verdict.committed_token_ids == expected[:2]
    assert store.get(idle.session_id).verifier_id == b.verifier_id
    assert b.metric("specdec_sessions_resumed_total") == resumed + 1
    idle_backend.close()
    store.close()
