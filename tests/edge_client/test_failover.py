"""The SDK's failover and device fallback, against real verifiers (gRPC on 127.0.0.1, the tiny target, a real
Redis shared by two replicas).

- address lists, the retry policy (bounded, jittered, exponential), rebuilding a verdict from the store;
- a block committed by a replica that then went away: the retry is refused (committed length mismatch) and
  reconciled from the store: counted and streamed once;
- a late verdict: a replica past the attempt deadline loses the session to another one; its commit is refused
  by the store (owner check) and its answer is ignored;
- device fallback: an unreachable cloud (closed port) gives only unverified tokens (flagged, counted); a
  verifier that appears later takes over verified; the CLI's --fallback device / none.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import uuid

import grpc
import pytest

from _cluster import ROOT, ForwardGate, ServerOnPort, free_port, wait_until
from _reference import hf_greedy
from specdec_runtime.common.errors import InvalidRequestError, UnsupportedByDrafterError, VerifierUnavailableError
from specdec_runtime.common.types import DraftBlock, FinishReason, OpenRequest, SamplingParams, StoppingCriteria
from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy, parse_addresses, verdict_from_store

pytestmark = pytest.mark.timeout(300)

PROMPT = "Tell me a story about a robot who learns to paint."
WAIT_S = 60.0


# ---------------------------------------------------------------------------------------------- units


def test_parse_addresses():
    assert parse_addresses("a:1, b:2,,") == ["a:1", "b:2"]
    assert parse_addresses(["[::1]:50051", "dns:///svc:50051"]) == ["[::1]:50051", "dns:///svc:50051"]
    for bad in ("", " , ", "host", "host:port"):
        with pytest.raises(InvalidRequestError):
            parse_addresses(bad)


def test_retry_policy_backoff_is_bounded_jittered_exponential():
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0, multiplier=2.0)
    rng = random.Random(0)
    for retry, cap in ((0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (10, 1.0)):
        waits = [policy.backoff_s(retry, rng) for _ in range(200)]
        assert all(0.0 <= w <= cap for w in waits)
        assert max(waits) > 0.8 * cap and min(waits) < 0.2 * cap  # jittered over [0, cap]
    assert policy.max_call_s >= policy.attempt_timeout_s + policy.budget_s
    for bad in (dict(max_attempts=0), dict(multiplier=0.5), dict(attempt_timeout_s=0), dict(budget_s=-1)):
        with pytest.raises(ValueError):
            RetryPolicy(**bad).validate()


def test_verdict_from_store():
    prompt = [1, 2, 3]
    # 2 of 3 accepted, then a recovered token
    v = verdict_from_store([7, 8, 9], 3, prompt + [7, 8, 5], False, None, seq=4)
    assert (v.num_accepted, v.next_token_id, v.is_bonus, v.committed_token_ids, v.committed_length, v.seq) == \
        (2, 5, False, [7, 8, 5], 6, 4)
    v = verdict_from_store([7, 8], 3, prompt + [7, 8, 6], False, None, seq=1)  # all accepted + bonus
    assert (v.num_accepted, v.next_token_id, v.is_bonus) == (2, 6, True)
    v = verdict_from_store([7, 8, 9], 3, prompt + [7], True, FinishReason.EOS, seq=1)  # a stop inside the block
    assert (v.num_accepted, v.next_token_id, v.finished, v.finish_reason) == (1, -1, True, FinishReason.EOS)
    v = verdict_from_store([], 3, prompt + [4], False, None, seq=1)  # target-only step
    assert (v.num_accepted, v.next_token_id, v.committed_token_ids) == (0, 4, [4])
    for ids in (prompt, prompt + [7, 8, 9, 1, 2]):  # nothing committed / more than one verdict
        with pytest.raises(InvalidRequestError):
            verdict_from_store([7, 8, 9], 3, ids, False, None, seq=1)


def test_chunks_never_pass_unverified_text_as_verified(smollm2_tokenizer_dir):
    """A character split across an unverified and a verified token is flagged unverified."""
    from transformers import AutoTokenizer

    from specdec_runtime.edge_client.output import TextOutput

    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    ids = tok("日本 ok", add_special_tokens=False)["input_ids"]
    assert len(ids) >= 3
    out = TextOutput(tok, ())
    chunks = out.push(ids[:1], verified=False) + out.push(ids[1:], verified=True) + out.finish(None)
    text = "".join(c.text for c in chunks)
    assert text == "日本 ok"
    first_char_chunk = next(c for c in chunks if c.text)
    assert first_char_chunk.text.startswith("日") and not first_char_chunk.verified
    assert chunks[-1].verified and chunks[-1].text.endswith("ok")


# ---------------------------------------------------------------------------------------------- two replicas


@pytest.fixture(scope="module")
def runners(tiny_pair):
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner

    return TargetRunner(tiny_pair.target_dir), TargetRunner(tiny_pair.target_dir)


@pytest.fixture(scope="module")
def prompt_ids(tiny_pair):
    from specdec_runtime.edge_client.client import encode_prompt
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    return encode_prompt(OnnxDraftModel(tiny_pair.draft_dir).tokenizer, PROMPT)


@pytest.fixture(scope="module")
def expected(tiny_pair, prompt_ids):
    return hf_greedy(tiny_pair.target_dir, prompt_ids, 60)


@pytest.fixture()
def replicas(runners, redis_url):
    """Two embedded verifier servers (replica-a, replica-b) sharing Redis under a private prefix."""
    from specdec_runtime.cloud_verifier.store import RedisSessionStore
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec.embedded import EmbeddedServer

    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    stores = [RedisSessionStore(redis_url, prefix=prefix, ttl_s=60) for _ in range(2)]
    # fixed verification: these cases are built on whole blocks (a block's committed length is asserted), which an
    # adaptive cut, decided by the measured cost of a step, may shorten
    verifiers = [Verifier(runner, store, verifier_id=f"replica-{n}", max_batch_wait_ms=1.0, verify_policy="fixed")
                 for runner, store, n in zip(runners, stores, "ab")]
    servers = [EmbeddedServer(verifier=v, grace_s=1.0) for v in verifiers]
    addresses = [s.start(timeout_s=WAIT_S) for s in servers]
    yield addresses, verifiers, servers, stores[0]
    for s in servers:
        s.stop(timeout_s=WAIT_S)
    keys = list(stores[0].client.scan_iter(match=f"{prefix}*"))
    if keys:
        stores[0].client.delete(*keys)
    for st in stores:
        st.close()


@pytest.mark.redis
def test_block_committed_before_the_failure_is_reconciled_once(replicas, prompt_ids, expected):
    """Replica A commits a block and goes away before its verdict reaches the client: the retry on B (same seq,
    same committed length) is refused, and the verdict is rebuilt from the store — not committed twice."""
    from specdec_runtime.common.wire import block_to_proto
    from specdec_runtime.common.v1 import verifier_pb2_grpc as pb_grpc

    (addr_a, addr_b), _, (server_a, _), store = replicas
    backend = FailoverBackend([addr_a, addr_b], policy=RetryPolicy(connect_timeout_s=2.0, budget_s=20.0))
    try:
        opened = backend.open_session(OpenRequest(prompt_ids, SamplingParams(),
                                                  StoppingCriteria(max_new_tokens=30, ignore_eos=True)))
        length = opened.committed_length
        block = DraftBlock([expected[0], expected[1], (expected[2] + 1) % 1000])  # 2 accepted, then a rejection
        with grpc.insecure_channel(addr_a) as ch:  # A commits; the verdict is "lost" (never given to the backend)
            lost = pb_grpc.VerifierStub(ch).VerifyBlock(block_to_proto(opened.session_id, 1, length, block),
                                                        timeout=WAIT_S)
        assert lost.committed_length == length + 3
        server_a.stop(timeout_s=WAIT_S)  # A goes away
        verdict = backend.submit(opened.session_id, 1, length, block).result(timeout=WAIT_S)
        assert verdict.committed_token_ids == expected[:3]
        assert (verdict.num_accepted, verdict.next_token_id, verdict.committed_length) == \
            (lost.num_accepted, lost.next_token_id, lost.committed_length)
        assert backend.num_failovers == 1
        v2 = backend.submit(opened.session_id, 2, verdict.committed_length, DraftBlock(expected[3:5])).result(WAIT_S)
        assert store.get(opened.session_id).committed_token_ids == prompt_ids + expected[:3 + len(v2.committed_token_ids)]
        assert backend.address == addr_b
    finally:
        backend.close()


@pytest.mark.redis
def test_late_verdict_of_a_replica_that_lost_the_session_is_refused_and_ignored(replicas, runners, prompt_ids,
                                                                               expected):
    """A is stuck in the forward pass past the attempt deadline: the block goes to B, which resumes the session
    and commits it; A's late commit is refused by the store (B holds the session); nothing is counted twice."""
    (addr_a, addr_b), (verifier_a, verifier_b), _, store = replicas
    policy = RetryPolicy(connect_timeout_s=2.0, attempt_timeout_s=0.5, budget_s=20.0)
    backend = FailoverBackend([addr_a, addr_b], policy=policy)
    try:
        opened = backend.open_session(OpenRequest(prompt_ids, SamplingParams(),
                                                  StoppingCriteria(max_new_tokens=30, ignore_eos=True)))
        length = opened.committed_length
        block = DraftBlock(expected[:3])
        with ForwardGate(runners[0]) as gate:  # A's forward pass holds the block
            t0 = time.monotonic()
            verdict = backend.submit(opened.session_id, 1, length, block).result(timeout=WAIT_S)
            assert gate.entered.is_set() and time.monotonic() - t0 >= 0.5
        assert verdict.committed_token_ids == expected[:4]
        assert backend.num_failovers == 1
        # A's block ends now: refused by the store (B holds the session), A drops its stale copy
        assert wait_until(lambda: verifier_a.num_sessions == 0, WAIT_S)
        record = store.get(opened.session_id)
        assert record.verifier_id == "replica-b"
        assert record.committed_token_ids == prompt_ids + expected[:4]
        v2 = backend.submit(opened.session_id, 2, verdict.committed_length, DraftBlock(expected[4:6])).result(WAIT_S)
        assert store.get(opened.session_id).committed_token_ids == prompt_ids + expected[:4 + len(v2.committed_token_ids)]
    finally:
        backend.close()


# ---------------------------------------------------------------------------------------------- device fallback


def _client(backend, draft_dir, **kw):
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    model = OnnxDraftModel(draft_dir)
    return EdgeClient(backend, ModelDrafter(model, draft_top_k=4), model.tokenizer, **kw)


def _unreachable(port: int) -> FailoverBackend:
    policy = RetryPolicy(max_attempts=2, budget_s=1.0, connect_timeout_s=0.5, initial_backoff_s=0.01)
    return FailoverBackend(f"127.0.0.1:{port}", policy=policy, connect=False)


def test_unreachable_cloud_device_fallback_is_unverified(tiny_pair, prompt_ids, expected):
    port = free_port()  # nothing listens there
    with _client(_unreachable(port), tiny_pair.draft_dir, fallback="device", reconnect_interval_s=0.2) as client:
        chunks = list(client.stream_chunks(PROMPT, max_new_tokens=40, ignore_eos=True))
        result = client.last_result
        assert result.num_unverified_tokens == result.stats.num_generated_tokens == 40
        assert chunks and not any(c.verified for c in chunks)
        assert "".join(c.text for c in chunks) == result.text
        # the draft's own greedy decoding (the tiny draft carries the target's weights: the same tokens)
        assert result.token_ids == expected[:40]
        assert result.stats.num_drafts == 0 and result.num_failovers == 0
        assert result.route["fallback"].startswith("no verifier answers: ")  # edge_cloud.fallback_reason
        # seeded sampling on the device is reproducible
        a = client.generate(PROMPT, max_new_tokens=20, temperature=0.8, seed=5, ignore_eos=True).token_ids
        b = client.generate(PROMPT, max_new_tokens=20, temperature=0.8, seed=5, ignore_eos=True).token_ids
        assert a == b and len(a) == 20
    with _client(_unreachable(port), tiny_pair.draft_dir) as client:  # fallback "none": the error
        with pytest.raises(VerifierUnavailableError, match=f"127.0.0.1:{port}"):
            client.generate(PROMPT, max_new_tokens=8)
    with _client(_unreachable(port), tiny_pair.draft_dir, fallback="device") as client:
        client.drafter = None  # target-only decoding cannot fall back: refused before anything is sent
        with pytest.raises(UnsupportedByDrafterError, match="fallback='device'") as e:
            client.generate(PROMPT, max_new_tokens=8)
        assert e.value.capability == "DecodesAlone"


def test_device_fallback_returns_to_the_cloud_when_it_answers(tiny_pair, runners, prompt_ids, expected):
    """Unverified tokens while nothing listens; a verifier appears on the address; a new session (prompt =
    everything committed) goes on verified; the output is the target's greedy output."""
    from specdec_runtime.cloud_verifier.verifier import Verifier

    port = free_port()
    server = None
    with _client(_unreachable(port), tiny_pair.draft_dir, fallback="device", reconnect_interval_s=0.1) as client:
        stream = client.stream_chunks(PROMPT, max_new_tokens=60, ignore_eos=True)
        head = [next(stream) for _ in range(5)]
        assert not any(c.verified for c in head)
        verifier = Verifier(runners[1], verifier_id="late-replica")
        server = ServerOnPort(verifier, port)  # the cloud answers from now on
        time.sleep(1.0)  # the probe thread (every 0.1 s) runs while the stream is not pulled: it finds the server
        try:
            rest = list(stream)
        finally:
            server.stop()
        result = client.last_result
    assert rest[-1].verified and any(c.verified for c in rest)
    flags = [c.verified for c in head + rest]
    assert flags == sorted(flags)  # unverified first, then verified: never the other way
    assert 5 <= result.num_unverified_tokens < result.stats.num_generated_tokens == 60
    assert result.stats.num_drafts > 0
    assert result.token_ids == expected[:60]


def test_cli_unreachable_cloud_fallback_device_and_none(tiny_pair, tmp_path):
    port = free_port()
    base = [sys.executable, "-m", "specdec.cli", "generate", PROMPT, "--server", f"127.0.0.1:{port}", "--draft",
            str(tiny_pair.draft_dir), "--max-new-tokens", "24", "--ignore-eos", "--temperature", "0"]
    run = subprocess.run([*base, "--fallback", "device", "--reconnect-interval-s", "0.5", "--json"],
                         capture_output=True, text=True, timeout=180, cwd=str(ROOT))
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["num_unverified_tokens"] == out["num_generated_tokens"] == 24 and out["num_failovers"] == 0
    notice = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(notice) == 1 and notice[0].startswith("notice: 24 of 24 tokens"), run.stderr
    run = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=180, cwd=str(ROOT))
    assert run.returncode == 2 and run.stdout == ""
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot reach verifier at 127.0.0.1:{port}"), run.stderr
