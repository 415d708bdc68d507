"""What the verifier does besides plain greedy verification, under tensor parallelism: TP=2 (this test process is
rank 0, one spawned gloo rank) against TP=1, each through a real :class:`Verifier` (adaptive verification, the
default policy, on both) over the same tiny targets.

- Tiny Llama (GQA 4/2), a KV pool of 10 pages of 16 tokens for 6 concurrent sessions of 4 pages each: recompute
  preemption drops pages on rank 0's allocator while every rank's pool holds the KV; most draft blocks half
  rejected; one session with no draft (cloud decode). Every session token-identical to HF greedy, on both.
- The same runners through the edge client: logprobs (top 2) equal to TP=1's within 1e-4 and their token ids
  identical; a regex grammar; the ``cloud`` and ``cloud-first`` routes: token ids identical to TP=1's.
- A tiny hybrid LFM2 under the same preemption load at TP=2: identical to HF greedy (its short-conv state is
  sharded along its channels and dropped and rebuilt with the pages).
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from specdec_runtime.cloud_verifier.parallel import RankSpec, start_parallel_runner
from specdec_runtime.common.types import DraftBlock, SamplingParams, StoppingCriteria
from specdec.bench.chaos.procs import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BS = 16  # KV page size, tokens
POOL_PAGES = 10
SESSIONS = 6
PROMPT = 30  # tokens
NEW = 24  # tokens per session: 54 positions, 4 pages each, 24 for the 6 (of 10)
EDGE_PROMPT = [1, 504, 3458, 314, 253, 1789, 30, 357, 4564, 2517, 28, 2145]


async def _session(verifier, prompt: list[int], reference: list[int], rng: random.Random, gamma: int) -> list[int]:
    """Open, then verify blocks of the reference continuation, most with one token made wrong; γ = 0 is cloud
    decode. Returns the committed output."""
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


def _references(model_dir, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def _under_preemption(backend, prompts, references) -> list[list[int]]:
    verifier = backend.verifier

    async def everyone():
        return await asyncio.gather(*(_session(verifier, p, r, random.Random(i), gamma=0 if i == 2 else 4)
                                      for i, (p, r) in enumerate(zip(prompts, references))), return_exceptions=True)

    outputs = backend._call(everyone(), 300.0)
    assert not [o for o in outputs if isinstance(o, BaseException)], outputs
    assert verifier.batcher.kv.num_preemptions > 0, "the pool was never short: no preemption exercised"
    return outputs


def _through_edge(backend, draft_dir) -> dict:
    from specdec_runtime.common.grammar import GrammarSpec
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    model = OnnxDraftModel(draft_dir)

    def gen(route: str = "speculative", **options):
        client = EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=4, route=route)
        return client.generate(EDGE_PROMPT, max_new_tokens=16, **options)

    with_logprobs = gen(ignore_eos=True, logprobs=True, top_logprobs=2)
    return {"logprobs_ids": with_logprobs.token_ids,
            "logprobs": [(t.logprob, t.top_token_ids, t.top_logprobs) for t in with_logprobs.logprobs],
            "grammar": gen(grammar=GrammarSpec("regex", "[a-z ]{4,40}")).token_ids,
            "cloud": gen("cloud", ignore_eos=True).token_ids,
            "cloud_first": gen("cloud-first", ignore_eos=True).token_ids}


def _backend(runner):
    from specdec.embedded import LocalBackend
    from specdec_runtime.cloud_verifier.verifier import Verifier

    return LocalBackend(Verifier(runner, max_batch_wait_ms=2.0, prefill_chunk_tokens=32, max_num_speculative_tokens=4,
                                 cost_table_dir=False))


def _tp2(model_dir):
    spec = RankSpec(str(model_dir), 2, f"tcp://127.0.0.1:{free_port()}", "cpu", "float32", POOL_PAGES * BS, BS, 1)
    return start_parallel_runner(spec)


def test_tp2_preemption_cloud_decode_logprobs_grammar_routes_identical_to_tp1(tiny_pair):
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner

    rng = random.Random(3)
    prompts = [[1] + [rng.randrange(3, 49152) for _ in range(PROMPT - 1)] for _ in range(SESSIONS)]
    references = _references(tiny_pair.target_dir, prompts)
    results = []
    for runner in (TargetRunner(tiny_pair.target_dir, kv_page_size=BS, kv_cache_budget_tokens=POOL_PAGES * BS),
                   _tp2(tiny_pair.target_dir)):
        backend = _backend(runner)
        try:
            outputs = _under_preemption(backend, prompts, references)
            results.append(_through_edge(backend, tiny_pair.draft_dir))
        finally:
            backend.close()
            if getattr(runner, "parallel", None) is not None:
                assert runner.parallel.failure is None
                runner.parallel.close()
        for i, (got, want) in enumerate(zip(outputs, references)):
            assert got == want, f"session {i} differs from target-only greedy"
    one, two = results
    for key in ("logprobs_ids", "grammar", "cloud", "cloud_first"):
        assert two[key] == one[key], key
    text = _text(tiny_pair.target_dir, two["grammar"])
    assert text and all(c in "abcdefghijklmnopqrstuvwxyz " for c in text), text
    assert len(two["logprobs"]) == len(one["logprobs"]) == 16
    for (lp2, ids2, top2), (lp1, ids1, top1) in zip(two["logprobs"], one["logprobs"]):
        assert ids2 == ids1 and abs(lp2 - lp1) < 1e-4 and max(abs(a - b) for a, b in zip(top2, top1)) < 1e-4


def _text(model_dir, ids) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir)).decode(ids, skip_special_tokens=True)


def test_tp2_hybrid_under_preemption_identical_to_target_only(tmp_path, smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    from _architectures import make_tiny_model

    target = make_tiny_model("lfm2", tmp_path / "lfm2", AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir)))
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 49152) for _ in range(PROMPT)] for _ in range(SESSIONS)]
    references = _references(target, prompts)
    runner = _tp2(target)
    backend = _backend(runner)
    try:
        outputs = _under_preemption(backend, prompts, references)
        assert runner.parallel.failure is None
    finally:
        backend.close()
        runner.parallel.close()
    for i, (got, want) in enumerate(zip(outputs, references)):
        assert got == want, f"session {i} differs from target-only greedy"
