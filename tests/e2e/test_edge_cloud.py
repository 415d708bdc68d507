"""The edge–cloud path end to end: EdgeClient + GrpcBackend over real gRPC on 127.0.0.1, a real Verifier with
its sessions in a real Redis. Exactness against target-only decoding for concurrent sessions, seeded sampling
equal to the in-process loop, TTL expiry, bytes on the wire."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from specdec.embedded import EmbeddedServer
from specdec_runtime.cloud_verifier.store import RedisSessionStore
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.errors import SessionNotFoundError
from specdec_runtime.common.types import DraftBlock, OpenRequest, SamplingParams, StoppingCriteria
from specdec.embedded import LocalBackend
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from _reference import hf_greedy

pytestmark = pytest.mark.redis

PROMPTS = [
    "Name a color.",
    "Tell me a story about a robot who learns to paint.",
    "What is 2 + 2?",
    "Translate 'good morning' to French.",
]


@pytest.fixture(scope="module")
def runner(tiny_pair):
    return TargetRunner(tiny_pair.target_dir)


@pytest.fixture()
def redis_store(redis_url):
    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    store = RedisSessionStore(redis_url, prefix=prefix, ttl_s=60)
    yield store
    keys = list(store.client.scan_iter(match=f"{prefix}*"))
    if keys:
        store.client.delete(*keys)
    store.close()


def _client(address, draft_dir, gamma=4, **kw):
    model = OnnxDraftModel(draft_dir)
    return EdgeClient(GrpcBackend(address), ModelDrafter(model, **kw), model.tokenizer, num_speculative_tokens=gamma)


def test_concurrent_clients_greedy_identical_to_target_only(tiny_pair, runner, redis_store):
    verifier = Verifier(runner, redis_store, max_batch_wait_ms=5.0)
    expected = {}
    tok = OnnxDraftModel(tiny_pair.draft_dir).tokenizer
    for p in PROMPTS:
        ids = encode_prompt(tok, p)
        expected[p] = hf_greedy(tiny_pair.target_dir, ids, 20)
    results, errors = {}, []
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address:

        def worker(i, prompt):
            draft = tiny_pair.draft_dir if i % 2 == 0 else tiny_pair.other_draft_dir
            try:
                with _client(address, draft, gamma=2 + i) as client:
                    results[prompt] = client.generate(prompt, max_new_tokens=20, ignore_eos=True)
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i, p)) for i, p in enumerate(PROMPTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert not errors, errors
    for p in PROMPTS:
        assert results[p].token_ids == expected[p], p
        assert results[p].bytes_sent > 0 and results[p].bytes_received > 0
    # closed sessions leave nothing in Redis
    assert list(redis_store.client.scan_iter(match=f"{redis_store.prefix}*")) == []


def test_seeded_sampling_over_grpc_equals_in_process(tiny_pair, runner, redis_store):
    kwargs = dict(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    local = LocalBackend(Verifier(runner))
    try:
        model = OnnxDraftModel(tiny_pair.other_draft_dir)
        in_process = EdgeClient(local, ModelDrafter(model, draft_top_k=5), model.tokenizer, num_speculative_tokens=3)
        want = in_process.generate(PROMPTS[1], **kwargs)
    finally:
        local.close()
    with EmbeddedServer(verifier=Verifier(runner, redis_store), grace_s=1.0) as address:
        with _client(address, tiny_pair.other_draft_dir, gamma=3, draft_top_k=5) as client:
            got = client.generate(PROMPTS[1], **kwargs)
    assert got.token_ids == want.token_ids
    assert got.stats.num_accepted_tokens == want.stats.num_accepted_tokens


def test_idle_session_expires_from_redis_and_verifier(tiny_pair, runner, redis_url):
    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    store = RedisSessionStore(redis_url, prefix=prefix, ttl_s=1)
    verifier = Verifier(runner, store, session_ttl_s=1, reap_interval_s=0.2)
    try:
        with EmbeddedServer(verifier=verifier, grace_s=1.0) as address:
            backend = GrpcBackend(address)
            opened = backend.open_session(OpenRequest([5, 6, 7, 8], SamplingParams(),
                                                      StoppingCriteria(max_new_tokens=8)))
            assert verifier.num_sessions == 1 and runner.kv_reserved_tokens > 0
            assert list(store.client.scan_iter(match=f"{prefix}*"))
            deadline = time.monotonic() + 10
            while (verifier.num_sessions or list(store.client.scan_iter(match=f"{prefix}*"))) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert verifier.num_sessions == 0
            assert list(store.client.scan_iter(match=f"{prefix}*")) == []
            assert runner.kv_reserved_tokens == 0
            with pytest.raises(SessionNotFoundError):
                backend.submit(opened.session_id, 1, 4, DraftBlock([9])).result(timeout=30)
            backend.close()
    finally:
        keys = list(store.client.scan_iter(match=f"{prefix}*"))
        if keys:
            store.client.delete(*keys)
        store.close()


def test_wire_bytes_greedy_vs_topk(tiny_pair, runner):
    """Greedy drafting sends token ids only; top-k drafting adds k (id, prob) pairs per draft token."""
    with EmbeddedServer(verifier=Verifier(runner), grace_s=1.0) as address:
        per_token = {}
        for name, kw, temp in (("greedy", {}, 0.0), ("top8", dict(draft_top_k=8), 1.0)):
            with _client(address, tiny_pair.draft_dir, gamma=4, **kw) as client:
                res = client.generate(PROMPTS[1], max_new_tokens=32, temperature=temp, seed=1, ignore_eos=True)
                per_token[name] = (res.bytes_sent + res.bytes_received) / len(res.token_ids)
    assert per_token["greedy"] < 40  # a few varint ids + headers per token
    assert per_token["top8"] > 2 * per_token["greedy"]
