"""Hybrid targets (cloud_verifier/recurrent_state.py) under load: 8 concurrent sessions of a tiny hybrid target
share forward passes, most of their blocks half rejected, while the paged KV pool is far too small for all of them
(recompute preemption drops a session's pages and its recurrent state; its next row recomputes both from the
committed ids). Every session's output is token-identical to target-only HF greedy decoding.

Tiny random hybrids from tests/_architectures.py (2 layers, hidden 64); prompts of random token ids; a pool of 14
pages of 16 tokens for 8 sessions of 5 pages each."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from _architectures import make_tiny_model
from cloud_verifier.target import TargetRunner
from cloud_verifier.verifier import Verifier
from common.types import DraftBlock, SamplingParams, StoppingCriteria
from specdec.embedded import LocalBackend

pytestmark = pytest.mark.timeout(600)

BS = 16  # KV page size, tokens
POOL_PAGES = 14
SESSIONS = 8
PROMPT = 30  # tokens
NEW = 40  # tokens generated per session: 70 positions, 5 pages each, 40 for the 8 (of 14)
WAIT_S = 300.0
FAMILIES = ("lfm2", "bamba", "qwen3_next")  # short conv, Mamba2, gated delta rule


async def _session(verifier, prompt: list[int], reference: list[int], rng: random.Random, gamma: int) -> list[int]:
    """Open, then verify blocks of the reference continuation, most with one token made wrong (rejections: the
    recurrent state replayed to the accepted prefix); γ = 0 is cloud decode. Returns the committed output."""
    opened = await verifier.open_session(prompt, SamplingParams(), StoppingCriteria(max_new_tokens=NEW,
                                                                                   ignore_eos=True))
    out, seq, length = [], 1, opened.committed_length
    while True:
        draft = list(reference[len(out) : len(out) + min(gamma, PROMPT + NEW - length)])
        if draft and rng.random() < 0.7:
            j = rng.randrange(len(draft))
            draft[j] = 3 + (draft[j] + 1) % 49000
        v = await verifier.verify(opened.session_id, seq, length, DraftBlock(draft))
        out += v.committed_token_ids
        length, seq = v.committed_length, seq + 1
        await asyncio.sleep(rng.random() * 0.002)  # the round trip: sessions fall out of step
        if v.finished:
            verifier.close_session(opened.session_id)
            return out


@pytest.mark.parametrize("arch", FAMILIES)
def test_concurrent_hybrid_sessions_with_preemption_token_identical(tmp_path, smollm2_tokenizer_dir, arch):
    target_dir = make_tiny_model(arch, tmp_path / arch, AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir)))
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 49152) for _ in range(PROMPT)] for _ in range(SESSIONS)]
    with torch.inference_mode():
        references = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                  pad_token_id=0)[0, PROMPT:].tolist() for p in prompts]
    runner = TargetRunner(target_dir, kv_page_size=BS, kv_cache_budget_tokens=POOL_PAGES * BS)
    backend = LocalBackend(Verifier(runner, max_batch_wait_ms=2.0, prefill_chunk_tokens=32,
                                    max_num_speculative_tokens=4))
    verifier = backend.verifier
    batch_sizes: list[int] = []
    forward = runner.forward

    def observed_forward(rows, *args, **kwargs):
        batch_sizes.append(len(rows))
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
    assert not [o for o in outputs if isinstance(o, BaseException)], outputs
    for i, (got, want) in enumerate(zip(outputs, references)):
        assert got == want, f"session {i} differs from target-only greedy"
    assert verifier.batcher.kv.num_preemptions > 0, "the pool was never short: the test does not exercise preemption"
    assert max(batch_sizes) >= 4, "the sessions never shared a forward pass"
    assert not runner.prefix_cache.enabled  # hybrids share no prefix
    assert runner.kv_pool.pages.num_used == 0
