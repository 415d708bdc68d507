"""Recompute preemption of the paged KV pool (cloud_verifier/kv/scheduler.py) on a real tiny target and verifier:
several concurrent sessions whose KV together needs far more pages than the pool has all finish, token-identical
to target-only HF greedy decoding (speculative blocks with rejections, and cloud-decode γ = 0 steps), while
later admitted sessions are preempted and their KV recomputed; no forward pass writes a page while it is
cached (shared); with preemption off, the same load stalls and is refused.

Tiny random Llama from conftest (2 layers); prompts of random token ids; a pool of 12 pages of 16 tokens."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from prometheus_client import REGISTRY
from transformers import AutoModelForCausalLM

from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.errors import CapacityError
from specdec_runtime.common.types import DraftBlock, SamplingParams, StoppingCriteria
from specdec.embedded import LocalBackend

pytestmark = pytest.mark.timeout(300)

BS = 16  # KV page size, tokens
POOL_PAGES = 12
PROMPT = 40  # tokens: 3 pages each at open, so 4 sessions fill the pool before any output
NEW = 60  # tokens generated per session: each needs 7 pages, 28 for the 5 (of 12)
WAIT_S = 120.0


@pytest.fixture(scope="module")
def hf_model(tiny_pair):
    return AutoModelForCausalLM.from_pretrained(tiny_pair.target_dir, dtype=torch.float32).eval()


def _reference(hf_model, prompt: list[int]) -> list[int]:
    """Target-only greedy decoding with plain HF generate()."""
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                pad_token_id=0)
    return out[0, len(prompt):].tolist()


async def _session(verifier, prompt: list[int], reference: list[int], rng: random.Random, gamma: int) -> list[int]:
    """Open, then verify blocks of the reference continuation (most with one token made wrong: rejections and
    roll backs); γ = 0 is cloud decode (empty blocks: the verifier's own token). Returns the committed output."""
    opened = await verifier.open_session(prompt, SamplingParams(), StoppingCriteria(max_new_tokens=NEW,
                                                                                   ignore_eos=True))
    out, seq, length = [], 1, opened.committed_length
    while True:
        draft = list(reference[len(out) : len(out) + min(gamma, PROMPT + NEW - length)])
        if draft and rng.random() < 0.6:
            j = rng.randrange(len(draft))
            draft[j] = 3 + (draft[j] + 1) % 49000
        v = await verifier.verify(opened.session_id, seq, length, DraftBlock(draft))
        out += v.committed_token_ids
        length, seq = v.committed_length, seq + 1
        await asyncio.sleep(rng.random() * 0.002)  # the round trip: sessions fall out of step
        if v.finished:
            verifier.close_session(opened.session_id)
            return out


def _run(tiny_pair, hf_model, preemption: bool):
    runner = TargetRunner(tiny_pair.target_dir, kv_page_size=BS, kv_cache_budget_tokens=POOL_PAGES * BS)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 49152) for _ in range(PROMPT)] for _ in range(5)]
    prompts[4][:2 * BS] = prompts[0][:2 * BS]  # the last one shares two pages with the first (prefix cache)
    references = [_reference(hf_model, p) for p in prompts]
    backend = LocalBackend(Verifier(runner, max_batch_wait_ms=1.0, prefill_chunk_tokens=32,
                                    max_num_speculative_tokens=4))
    verifier = backend.verifier
    verifier.batcher.kv.preemption = preemption
    written_cached: list[int] = []  # pages a forward pass wrote while they were cached
    forward = runner.forward

    def observed_forward(rows, *args, **kwargs):
        cache = runner.prefix_cache
        for row in rows:
            end = row.start_position + len(row.token_ids)
            written = {row.kv.pages[p // BS] for p in range(row.start_position, end)}
            written_cached.extend(b for b in written if cache.is_cached(b))
        return forward(rows, *args, **kwargs)

    runner.forward = observed_forward

    async def everyone():
        return await asyncio.gather(*(
            _session(verifier, p, r, random.Random(i), gamma=0 if i == 2 else 4)
            for i, (p, r) in enumerate(zip(prompts, references))), return_exceptions=True)

    try:
        outputs = backend._call(everyone(), WAIT_S)
    finally:
        del runner.forward
        backend.close()
    return outputs, references, verifier, written_cached, runner


def test_sessions_needing_more_pages_than_the_pool_all_finish_token_identical(tiny_pair, hf_model):
    before = REGISTRY.get_sample_value("specdec_kv_preemptions_total") or 0.0
    recomputed = REGISTRY.get_sample_value("specdec_kv_recomputed_tokens_total") or 0.0
    outputs, references, verifier, written_cached, runner = _run(tiny_pair, hf_model, preemption=True)
    assert not [o for o in outputs if isinstance(o, BaseException)], outputs
    for i, (got, want) in enumerate(zip(outputs, references)):
        assert got == want, f"session {i} differs from target-only greedy"
    assert verifier.batcher.kv.num_preemptions > 0, "the pool was never short: the test does not exercise preemption"
    assert REGISTRY.get_sample_value("specdec_kv_preemptions_total") - before == verifier.batcher.kv.num_preemptions
    assert REGISTRY.get_sample_value("specdec_kv_recomputed_tokens_total") > recomputed
    assert not written_cached, f"forward passes wrote cached (shared) pages {sorted(set(written_cached))}"
    assert runner.kv_pool.pages.num_used == 0  # every session closed: nothing held


def test_without_preemption_the_same_load_stalls_and_is_refused(tiny_pair, hf_model):
    outputs, _, verifier, _, _ = _run(tiny_pair, hf_model, preemption=False)
    refused = [o for o in outputs if isinstance(o, CapacityError)]
    assert refused and "KV cache full" in str(refused[0])
    assert verifier.batcher.kv.num_preemptions == 0
