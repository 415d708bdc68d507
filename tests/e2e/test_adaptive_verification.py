"""Adaptive verification end to end: a verifier that verifies only a prefix of each block (forced schedules:
k = 1 for every row, seeded random cuts, the adaptive policy on a steep cost model) stays exact.

The real EdgeClient loop with a real ONNX ModelDrafter against the real Verifier over the tiny Llama pair
(conftest ``tiny_pair``), in process (LocalBackend) and over real gRPC (EmbeddedServer: the verdict's
``num_verified_positions`` on the wire). Checks:

- greedy: token-identical to HF ``generate`` (target-only) under every schedule, γ fixed and adaptive with
  proactive drafting; the schedules really cut (unverified draft tokens counted on the edge);
- seeded sampled (bonus_drafted blocks): the same tokens under every schedule; a classic block of a seeded
  session is never cut (its edge relies on a timing-independent schedule);
- sampled, lossless: with every row cut to its first position, the law of the first token is the target's
  processed distribution (chi-square, fixed seeds); negative control: the draft token at the cut taken as it was
  drafted (from q, not judged) is rejected by the same statistic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats
from transformers import AutoModelForCausalLM

from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.cloud_verifier.verify_policy import AdaptiveVerifyPolicy, ForwardCostModel, VerifyPolicy
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import EmbeddedServer, LocalBackend
from _reference import hf_greedy

pytestmark = pytest.mark.timeout(900)

PROMPTS = ["Tell me a story about a robot who learns to paint.", "one two three four, one two three four, one two"]


class Schedule(VerifyPolicy):
    """A forced verify-length schedule: ``pick(block, rng)`` positions for every row (clamped to the block)."""

    def __init__(self, pick, seed: int = 0):
        super().__init__()
        self.pick, self.rng, self.cut = pick, np.random.default_rng(seed), 0

    def choose(self, blocks, fixed_tokens, fixed_rows=0):
        out = [max(1, min(b.num_scored_positions, int(self.pick(b, self.rng)))) for b in blocks]
        self.cut += sum(m < b.num_scored_positions for m, b in zip(out, blocks))
        return out


def steep_adaptive() -> AdaptiveVerifyPolicy:
    """The adaptive policy on a cost model where every token of a pass costs as much as the first (a verifier
    deep in its compute-bound regime): it cuts tails whose expected gain is small."""
    cost = ForwardCostModel()
    for rows, t in ((1, 1), (1, 16), (4, 16), (4, 64)):
        cost.observe(rows, t, 0.01 * t, forget=1.0)
    policy = AdaptiveVerifyPolicy(cost)
    policy.uses_cost_model = False  # keep the table above (no prior or background profile over it)
    return policy


SCHEDULES = {
    "k=1": lambda: Schedule(lambda b, rng: 1),
    "random": lambda: Schedule(lambda b, rng: rng.integers(1, b.num_scored_positions + 1), seed=7),
    "adaptive, steep cost": steep_adaptive,
}


@pytest.fixture(scope="module")
def runner(tiny_pair):
    return TargetRunner(tiny_pair.target_dir)


@pytest.fixture(scope="module")
def model(tiny_pair):
    return OnnxDraftModel(tiny_pair.draft_dir)


def _local(runner, policy) -> LocalBackend:
    return LocalBackend(Verifier(runner, max_num_speculative_tokens=8, max_batch_wait_ms=0.0, verify_policy=policy))


def _client(backend, model, **kw) -> EdgeClient:
    return EdgeClient(backend, ModelDrafter(model, draft_top_k=4), model.tokenizer, **kw)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_greedy_token_identical_whatever_the_cut(runner, model, tiny_pair, name):
    policy = SCHEDULES[name]()
    backend = _local(runner, policy)
    try:
        for prompt in PROMPTS:
            ids = encode_prompt(model.tokenizer, prompt)
            want = hf_greedy(tiny_pair.target_dir, ids, 32)
            for settings in (dict(num_speculative_tokens=6, adaptive=False),
                             dict(num_speculative_tokens=6, adaptive=True, proactive=True)):
                res = _client(backend, model, **settings).generate(ids, max_new_tokens=32, ignore_eos=True)
                assert res.token_ids == want, (name, prompt, settings)
    finally:
        backend.close()
    assert policy.verified_positions < policy.drafted_positions, name  # the schedule really cut blocks


def test_greedy_over_grpc_k1(runner, model, tiny_pair):
    """Every row cut to its first position, over real gRPC: the verdict says so on the wire and the edge resends
    the unjudged tail (counted in its stats)."""
    policy = Schedule(lambda b, rng: 1)
    server = EmbeddedServer(verifier=Verifier(runner, max_num_speculative_tokens=8, max_batch_wait_ms=1.0,
                                              verify_policy=policy), grace_s=1.0)
    address = server.start(timeout_s=30.0)
    try:
        ids = encode_prompt(model.tokenizer, PROMPTS[1])
        res = _client(GrpcBackend(address), model, num_speculative_tokens=4, adaptive=False).generate(
            ids, max_new_tokens=24, ignore_eos=True)
    finally:
        server.stop(timeout_s=30.0)
    assert res.token_ids == hf_greedy(tiny_pair.target_dir, ids, 24)
    assert policy.cut > 0 and res.stats.num_unjudged_draft_tokens > 0


SAMPLED = dict(temperature=0.7, top_k=20, ignore_eos=True)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_seeded_same_tokens_whatever_the_cut(runner, model, seed):
    ids = encode_prompt(model.tokenizer, PROMPTS[0])
    outs, cuts = {}, {}
    for name, make in [("whole", VerifyPolicy), *SCHEDULES.items()]:
        policy = make()
        backend = _local(runner, policy)
        try:
            res = _client(backend, model, num_speculative_tokens=5, bonus_drafted=True).generate(
                ids, max_new_tokens=32, seed=seed, **SAMPLED)
        finally:
            backend.close()
        outs[name], cuts[name] = res.token_ids, policy.drafted_positions - policy.verified_positions
    assert len({tuple(t) for t in outs.values()}) == 1, outs
    assert cuts["whole"] == 0 and cuts["k=1"] > 0 and cuts["random"] > 0, cuts


def test_classic_blocks_of_a_seeded_session_are_never_cut(runner, model):
    ids = encode_prompt(model.tokenizer, PROMPTS[0])
    policy = Schedule(lambda b, rng: 1)
    backend = _local(runner, policy)
    try:
        cut = _client(backend, model, num_speculative_tokens=4, bonus_drafted=False, adaptive=False).generate(
            ids, max_new_tokens=24, seed=5, **SAMPLED)
    finally:
        backend.close()
    whole_backend = _local(runner, VerifyPolicy())
    try:
        whole = _client(whole_backend, model, num_speculative_tokens=4, bonus_drafted=False, adaptive=False).generate(
            ids, max_new_tokens=24, seed=5, **SAMPLED)
    finally:
        whole_backend.close()
    assert cut.token_ids == whole.token_ids
    assert cut.stats.num_unjudged_draft_tokens == 0 and policy.cut == 0


class FirstDrafts:
    """A real backend, observed: the first draft token of each session's first block."""

    def __init__(self, inner):
        self.inner, self.first = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit(self, session_id, seq, committed_length, block):
        if seq == 1 and len(block):
            self.first.append(int(block.draft_token_ids[0]))
        return self.inner.submit(session_id, seq, committed_length, block)


def _chi2_pvalue(samples: list[int], p: np.ndarray) -> float:
    """Pearson chi-square of ``samples`` against ``p`` (cells of expected count < 5 pooled into one)."""
    n = len(samples)
    counts = np.bincount(samples, minlength=len(p)).astype(float)
    expected = p * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(scipy_stats.chisquare(obs[keep], exp[keep]).pvalue)


@pytest.mark.slow  # 22 s measured
def test_cut_rows_keep_the_target_distribution(runner, model, tiny_pair):
    """Every row cut to its first position: the first output token follows p (temperature 0.7, top-k 20, from
    the plain HF model's logits); the drafted token at the cut, taken unjudged, does not."""
    ids = encode_prompt(model.tokenizer, "Why is the sky blue?")
    hf = AutoModelForCausalLM.from_pretrained(tiny_pair.target_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([ids])).logits[0, -1].double() / SAMPLED["temperature"]
    top = torch.topk(logits, SAMPLED["top_k"])
    p = np.zeros(logits.shape[0])
    p[top.indices.numpy()] = torch.softmax(top.values, 0).numpy()
    policy = Schedule(lambda b, rng: 1)
    backend = FirstDrafts(_local(runner, policy))
    firsts = []
    try:
        client = _client(backend, model, num_speculative_tokens=3, bonus_drafted=True, adaptive=False)
        for seed in range(600):
            firsts.append(client.generate(ids, max_new_tokens=2, seed=1000 + seed, **SAMPLED).token_ids[0])
    finally:
        backend.inner.close()
    assert policy.cut > 0
    assert _chi2_pvalue(firsts, p) > 1e-4
    assert len(backend.first) == len(firsts)
    assert _chi2_pvalue(backend.first, p) < 1e-6  # negative control: the cut token from q, not judged
