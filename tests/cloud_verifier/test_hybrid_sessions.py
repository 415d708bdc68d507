"""Hybrid targets (cloud_verifier/kv/recurrent_state.py) under load: 8 concurrent sessions of a tiny hybrid target
share forward passes, most of their blocks half rejected, while the paged KV pool is far too small for all of them
(recompute preemption drops a session's pages and its recurrent state; its next row recomputes both from the
committed ids). Every session's output is token-identical to target-only HF greedy decoding. A conversation
extended (ExtendSession) on one replica and resumed on another (same Redis) is too.

Tiny random hybrids from tests/_architectures.py (2 layers, hidden 64); prompts of random token ids; a pool of 14
pages of 16 tokens for 8 sessions of 5 pages each."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from _architectures import make_tiny_model
from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow
from specdec_runtime.cloud_verifier.kv.recurrent_state import RecurrentStateError
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.types import DraftBlock, ExtendRequest, OpenRequest, SamplingParams, StoppingCriteria
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


def _verify_to_end(backend, session_id: str, length: int, seq: int, reference: list[int],
                   rng: random.Random) -> tuple[list[int], int]:
    """Blocks of 4 reference tokens, most with one made wrong, to the session's end; (output ids, last seq)."""
    out = []
    while True:
        draft = list(reference[len(out) : len(out) + 4])
        if draft and rng.random() < 0.7:
            j = rng.randrange(len(draft))
            draft[j] = 3 + (draft[j] + 1) % 49000
        v = backend.submit(session_id, seq, length, DraftBlock(draft)).result(60.0)
        out += v.committed_token_ids
        length = v.committed_length
        if v.finished:
            return out, seq
        seq += 1


@pytest.mark.redis
@pytest.mark.parametrize("arch", ("lfm2", "bamba"))
def test_hybrid_conversation_extends_and_resumes_on_another_replica(tmp_path, smollm2_tokenizer_dir, redis_url,
                                                                      arch):
    """Replica A runs turn 1 and prefills turn 2 (ExtendSession, 3 chunks: the state after each chunk carries to the
    next); replica B (same Redis) resumes the session at its next block, rebuilding the recurrent state from the
    committed ids, then extends it again. Every turn equals HF greedy decoding of the whole history."""
    import uuid

    from specdec_runtime.cloud_verifier.store import RedisSessionStore

    target_dir = make_tiny_model(arch, tmp_path / arch, AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir)))
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    def greedy(ids: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()

    rng = random.Random(3)
    prompt, appended, more = ([rng.randrange(3, 49152) for _ in range(k)] for k in (20, 40, 7))
    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    stores = [RedisSessionStore(redis_url, prefix=prefix, ttl_s=60) for _ in range(2)]
    a, b = (LocalBackend(Verifier(TargetRunner(target_dir), store, verifier_id=f"replica-{name}",
                                  prefill_chunk_tokens=16, max_num_speculative_tokens=4))
            for store, name in zip(stores, "ab"))
    stopping = lambda n: StoppingCriteria(max_new_tokens=n, ignore_eos=True)  # noqa: E731
    try:
        opened = a.open_session(OpenRequest(prompt, SamplingParams(), stopping(10)))
        out1, seq = _verify_to_end(a, opened.session_id, len(prompt), 1, greedy(prompt, 10), rng)
        assert out1 == greedy(prompt, 10)
        history = prompt + out1 + appended
        ext = a.extend_session(ExtendRequest(opened.session_id, len(prompt + out1), appended, SamplingParams(),
                                             stopping(12)))
        out2, seq = _verify_to_end(b, opened.session_id, ext.committed_length, seq + 1, greedy(history, 12), rng)
        assert out2 == greedy(history, 12)
        assert stores[0].get(opened.session_id).verifier_id == "replica-b"  # resumed on B
        history += out2 + more
        ext = b.extend_session(ExtendRequest(opened.session_id, len(history) - len(more), more, SamplingParams(),
                                             stopping(8)))
        out3, _ = _verify_to_end(b, opened.session_id, ext.committed_length, seq + 1, greedy(history, 8), rng)
        assert out3 == greedy(history, 8)
    finally:
        a.close()
        b.close()
        keys = list(stores[0].client.scan_iter(match=f"{prefix}*"))
        if keys:
            stores[0].client.delete(*keys)
        for st in stores:
            st.close()


def test_a_row_past_the_held_state_is_refused_and_the_scheduler_is_told(tmp_path, smollm2_tokenizer_dir):
    """The state after a row of n tokens at c reaches c..c+n only: a row elsewhere (but at 0) raises one line, and
    ``state_reaches`` (what the KV scheduler asks before each pass) says so; a preemption drops the state."""
    runner = TargetRunner(make_tiny_model("lfm2", tmp_path / "lfm2",
                                          AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))))
    kv = runner.allocate(64)
    runner.forward([ForwardRow(kv, list(range(3, 13)), 0, "none")])
    runner.forward([ForwardRow(kv, [5, 6, 7, 8], 10, "all")])
    assert [runner.state_reaches(kv, p) for p in (0, 9, 10, 12, 14, 15)] == [True, False, True, True, True, False]
    with pytest.raises(RecurrentStateError) as info:
        runner.forward([ForwardRow(kv, [5], 15, "all")])
    assert "past its recurrent state (positions 10..14)" in str(info.value) and "\n" not in str(info.value)
    runner.preempt(kv)
    assert kv.recurrent is None and runner.state_reaches(kv, 0) and not runner.state_reaches(kv, 12)
    runner.free(kv)
