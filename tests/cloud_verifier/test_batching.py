"""Batched verification across sessions: a session's tokens do not depend on which sessions share its batches;
KV cache memory is budgeted, refused when full, and returns to idle after many sessions."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.errors import CapacityError
from specdec.embedded import LocalBackend
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel


@pytest.fixture(scope="module")
def runner(tiny_pair):
    return TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=8192)


def _sessions(tokenizer):
    """A mix: short and long prompts, greedy and seeded sampling, different γ and drafts."""
    rng = np.random.default_rng(0)
    long_prompt = rng.integers(3, 5000, size=300).tolist()  # several prefill chunks
    short = encode_prompt(tokenizer, "Hi")
    mid = encode_prompt(tokenizer, "Explain speculative decoding in one paragraph.")
    return [
        dict(prompt=short, gamma=4, draft="draft_dir", kw=dict(max_new_tokens=20)),
        dict(prompt=long_prompt, gamma=2, draft="other_draft_dir", kw=dict(max_new_tokens=16)),
        dict(prompt=mid, gamma=5, draft="draft_dir", kw=dict(max_new_tokens=24, temperature=0.8, seed=3)),
        dict(prompt=mid, gamma=3, draft="other_draft_dir", kw=dict(max_new_tokens=18, temperature=1.0, top_p=0.9, seed=11)),
        dict(prompt=short, gamma=1, draft="draft_dir", kw=dict(max_new_tokens=12, temperature=0.7, top_k=20, seed=5)),
        dict(prompt=long_prompt[:120], gamma=6, draft="draft_dir", kw=dict(max_new_tokens=20)),
    ]


def _run(backend, tiny_pair, spec):
    model = OnnxDraftModel(getattr(tiny_pair, spec["draft"]))
    client = EdgeClient(backend, ModelDrafter(model, draft_top_k=6), model.tokenizer,
                        num_speculative_tokens=spec["gamma"])
    return client.generate(spec["prompt"], ignore_eos=True, **spec["kw"])


@pytest.mark.slow  # 39-62 s measured
def test_session_output_independent_of_batching(tiny_pair, runner):
    tokenizer = OnnxDraftModel(tiny_pair.draft_dir).tokenizer
    specs = _sessions(tokenizer)

    # each session alone, one block per forward pass
    alone = LocalBackend(Verifier(runner, max_batch_size=1, prefill_chunk_tokens=64))
    try:
        expected = [_run(alone, tiny_pair, s).token_ids for s in specs]
    finally:
        alone.close()

    # all sessions at once, batched (and a long prompt prefilled in chunks meanwhile)
    verifier = Verifier(runner, max_batch_size=8, max_batch_wait_ms=20, prefill_chunk_tokens=64)
    seen_batch_sizes: list[int] = []
    real_apply = verifier.batcher._apply_verdict

    def spy(work, logits, queue_ms, forward_ms, batch_size):
        seen_batch_sizes.append(batch_size)
        return real_apply(work, logits, queue_ms, forward_ms, batch_size)

    verifier.batcher._apply_verdict = spy
    batched = LocalBackend(verifier)
    results: list = [None] * len(specs)
    errors: list = []

    def worker(i):
        try:
            results[i] = _run(batched, tiny_pair, specs[i]).token_ids
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(specs))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        batched.close()
    assert not errors, errors
    assert max(seen_batch_sizes) > 1, "the sessions were never batched together"
    for i, (got, want) in enumerate(zip(results, expected)):
        assert got == want, f"session {i} differs when batched"


def test_kv_budget_refuses_and_reuses(tiny_pair):
    small = TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=100)
    # identical prompts: the budget without sharing (prefix caching: tests/cloud_verifier/test_prefix_cache_sessions.py)
    backend = LocalBackend(Verifier(small, prefix_caching=False))
    try:
        model = OnnxDraftModel(tiny_pair.draft_dir)
        client = EdgeClient(backend, ModelDrafter(model), model.tokenizer)
        from specdec_runtime.common.types import OpenRequest, SamplingParams, StoppingCriteria

        # 7 KV pages of 16 tokens; a 30-token prompt holds 2 (its first 29 tokens), not prompt + max_new_tokens
        prompt, stopping = list(range(10, 40)), StoppingCriteria(max_new_tokens=50)
        opened = [backend.open_session(OpenRequest(prompt, SamplingParams(), stopping)) for _ in range(3)]
        assert small.kv_reserved_tokens == 3 * 32
        with pytest.raises(CapacityError, match="KV cache full"):
            backend.open_session(OpenRequest(prompt, SamplingParams(), stopping))
        for o in opened:
            backend.close_session(o.session_id)
        assert small.kv_reserved_tokens == 0
        res = client.generate(list(range(10, 40)), max_new_tokens=50, ignore_eos=True)  # fits again
        assert len(res.token_ids) == 50
    finally:
        backend.close()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_kv_memory_returns_to_idle_after_200_sessions(tiny_pair, runner):
    backend = LocalBackend(Verifier(runner, max_batch_size=8))
    try:
        model = OnnxDraftModel(tiny_pair.draft_dir)
        client = EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=3)
        client.generate(list(range(5, 60)), max_new_tokens=8, ignore_eos=True)  # warm up allocator
        idle_reserved = runner.kv_reserved_tokens
        rss_before = _rss_bytes()
        for i in range(200):
            client.generate(list(range(5, 60 + i % 7)), max_new_tokens=8, ignore_eos=True)
        assert runner.kv_reserved_tokens == idle_reserved == 0
        assert backend.verifier.num_sessions == 0
        growth = _rss_bytes() - rss_before
        per_session_kv = (60 + 8) * runner.kv_bytes_per_token
        # if nothing were freed, 200 sessions would hold 200 KV caches
        assert growth < 50 * per_session_kv + 32 * 2**20, f"RSS grew by {growth} bytes"
    finally:
        backend.close()


def test_chunked_prefill_interleaves_with_running_sessions(tiny_pair, runner):
    """A long prompt is prefilled one chunk per forward pass, interleaved with running sessions' verify steps."""
    verifier = Verifier(runner, max_batch_size=8, max_batch_wait_ms=1, prefill_chunk_tokens=32)
    batches: list[tuple[int, int]] = []  # (prefill rows, verify rows) per forward pass
    real_forward = runner.forward

    def spy(rows):
        batches.append((sum(r.logits == "none" for r in rows), sum(r.logits != "none" for r in rows)))
        return real_forward(rows)

    runner.forward = spy
    backend = LocalBackend(verifier)
    try:
        model = OnnxDraftModel(tiny_pair.draft_dir)
        client = EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=2)
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("a", client.generate(
            [5, 6, 7], max_new_tokens=120, ignore_eos=True)))
        t.start()
        import time

        deadline = time.monotonic() + 60
        while not any(v for _, v in batches) and time.monotonic() < deadline:  # wait until A is decoding
            time.sleep(0.001)
        long_prompt = np.random.default_rng(1).integers(3, 5000, size=32 * 12 + 1).tolist()
        from specdec_runtime.common.types import OpenRequest, SamplingParams, StoppingCriteria

        opened = backend.open_session(OpenRequest(long_prompt, SamplingParams(), StoppingCriteria(max_new_tokens=4)))
        t.join(timeout=300)
        backend.close_session(opened.session_id)
    finally:
        runner.forward = real_forward
        backend.close()
    assert max(p for p, _ in batches) == 1, "more than one prefill chunk in a forward pass"
    assert sum(p for p, _ in batches) >= 12
    first = next(i for i, (p, _) in enumerate(batches) if p and i > 0)
    last = max(i for i, (p, _) in enumerate(batches) if p)
    during = sum(1 for p, v in batches[first:last] if v)
    assert during >= 6, f"the running session stalled while the long prompt was prefilled: {batches}"
    assert len(result["a"].token_ids) == 120


def test_closing_a_session_with_a_block_in_flight_spares_the_batch(tiny_pair, runner):
    """A client that goes away mid-block (Ctrl-C) must not break the other sessions batched with it."""
    from specdec_runtime.common.errors import SessionNotFoundError
    from specdec_runtime.common.types import DraftBlock, OpenRequest, SamplingParams, StoppingCriteria

    backend = LocalBackend(Verifier(runner, max_batch_size=8, max_batch_wait_ms=50))
    try:
        prompt = list(range(10, 300))
        a = backend.open_session(OpenRequest(prompt, SamplingParams(), StoppingCriteria(max_new_tokens=64)))
        b = backend.open_session(OpenRequest(prompt, SamplingParams(), StoppingCriteria(max_new_tokens=64)))
        fa = backend.submit(a.session_id, 1, len(prompt), DraftBlock([5, 6, 7, 8]))
        fb = backend.submit(b.session_id, 1, len(prompt), DraftBlock([5, 6]))
        backend.close_session(a.session_id)  # while a's block is queued or in the forward pass
        vb = fb.result(timeout=60)  # the other session is unaffected
        assert vb.committed_length >= len(prompt) + 1
        try:
            fa.result(timeout=60)
        except SessionNotFoundError:
            pass
        backend.close_session(b.session_id)
        assert runner.kv_reserved_tokens == 0
    finally:
        backend.close()
