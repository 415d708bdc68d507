"""Sampled speculative decoding end to end is lossless: the real edge loop against the real verifier produces
the target's own processed distribution (temperature → top-k → top-p), computed independently.

Setting. The real :class:`EdgeClient` with a real ONNX :class:`ModelDrafter` (top-k drafting) drives an in-process
:class:`Verifier` over the tiny random Llama target (conftest ``tiny_pair``: 2 layers, the real 49,152-token
vocabulary). Many sessions with different seeds generate ``MAX_NEW_TOKENS = 3`` tokens after one short fixed prompt,
``GAMMA = 2`` draft tokens per block, with temperature, top-k and top-p all active. Two drafts, pooled:

- "accepting": the target's own weights in ONNX with ``draft_top_k = 4``: q is the target's top-4 renormalised, so
  a draft token is accepted with probability p(x)/q(x) ≈ 0.3–0.45: acceptance, rejection (recovered tokens from the
  residual max(0, p − q), which here is p outside the draft's top 4) and bonus tokens all happen;
- "rejecting": the differently seeded tiny model: its top-8 never meets the target's nucleus (p(x) = 0 for every
  draft token), so every block is rejected at position 0: two recovered tokens from two verify steps, then a plain
  decoding step (empty block: a block may not pass max_new_tokens).

Reference. HF transformers' own warpers (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``)
on the logits of the plain HF model (SDPA attention, no KV cache) give p(· | prefix) for every prefix that occurs;
the second token is conditioned on the first, the third on the first two.

Checks (deterministic: fixed seeds; chi-square critical values at significance 1e-4, Wilson–Hilferty):

1. support: every generated token has p(t | prefix) > 0 (top-k / top-p are respected at every step);
2. first token: chi-square of the empirical law of t1 against p(· | prompt) (cells of expected count < 5 pooled),
   total-variation distance under a multinomial-noise bound;
3. joint law of (t1, t2, t3): randomized probability integral transforms v_j = F_j(t_j−) + w_j p_j(t_j) under the
   conditional laws (token-id order; Rosenblatt 1952) are i.i.d. U(0, 1) exactly when the tokens follow the target's
   conditionals; chi-square on a 3×3×3 grid of (v1, v2, v3) and on 10 bins of each v_j;
4. acceptance: a draft token the target gives probability 0 is never accepted (the rejecting draft offers ~600
   of them: a verifier accepting 3 % too often accepts some with probability 1 − 0.97^600 > 1 − 1e-7); the
   others are accepted with probability min(1, p_i(x_i) / q_i(x_i)) each given the past (Leviathan et al. 2023,
   Algorithm 1; q the sparse distribution the draft sent): the number accepted minus the sum of these
   probabilities, over its standard deviation, stays within ±Z_ACCEPT.

Both block rules run, each a full set of sessions and checks (the ``runs`` fixture's parameter): classic blocks
(γ draft tokens, the bonus token sampled from p after a full block) and bonus_drafted blocks
(``DraftBlock.bonus_drafted``, what the client sends for sampled sessions: γ + 1 draft tokens, the last one
drafted for the bonus position and verified by the rejection rule like the others; no bonus token).

Negative controls (the same statistics must reject): the first token against the target without top-p, against the
accepting draft's q and against the rejecting draft's distribution; acceptance against probabilities 6 points
higher or lower; the joint-law test on synthetic samples drawn from the reference with the same uniform reused at every step
(and it accepts synthetic samples drawn correctly).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.edge_client.client import EdgeClient
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import LocalBackend

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = [504, 6376, 314]  # "The sky is" in the SmolLM2 tokenizer (no chat template)
TEMPERATURE, TOP_K, TOP_P = 1.0, 30, 0.8  # the target's nucleus after the prompt: 20 tokens, top one 0.25
GAMMA = 2
MAX_NEW_TOKENS = 3
N_ACCEPTING = 900  # sessions with the accepting draft (seeds 0..N-1)
N_REJECTING = 300  # sessions with the rejecting draft (seeds SEED_OFFSET + 0..N-1)
SEED_OFFSET = 1_000_000
CHI2_Z = 3.719  # one-sided normal quantile of 1e-4
Z_ACCEPT = 4.0  # acceptance calibration: |z| bound
ACCEPT_BIAS = 0.03  # the acceptance bias the calibration check must see (negative control)


# ---------------------------------------------------------------------------------------------- reference


@dataclass
class SparseDist:
    """A processed distribution: token ids in ascending order, their probabilities (float64, sum 1)."""

    ids: np.ndarray
    probs: np.ndarray

    def prob(self, token: int) -> float:
        i = int(np.searchsorted(self.ids, token))
        return float(self.probs[i]) if i < len(self.ids) and self.ids[i] == token else 0.0

    def cdf_below(self, token: int) -> float:
        """Mass of the tokens with id < token."""
        return float(self.probs[: int(np.searchsorted(self.ids, token))].sum())

    def dense_on(self, cells: np.ndarray) -> np.ndarray:
        return np.array([self.prob(int(t)) for t in cells])


class HFReference:
    """p(· | prefix) of a plain HF causal LM through HF transformers' own logits warpers, cached per prefix."""

    def __init__(self, model, temperature: float, top_k: int, top_p: float):
        self.model = model
        self.warpers = [TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)]
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))
        self.cache: dict[tuple[int, ...], SparseDist] = {}

    def __call__(self, prefix) -> SparseDist:
        key = tuple(int(t) for t in prefix)
        if key not in self.cache:
            self.prepare([key])
        return self.cache[key]

    @torch.inference_mode()
    def prepare(self, prefixes, batch: int = 128) -> None:
        """Compute the distributions of all ``prefixes`` not cached yet (batched by length, no padding)."""
        todo = sorted({tuple(int(t) for t in p) for p in prefixes} - self.cache.keys())
        by_len: dict[int, list[tuple[int, ...]]] = {}
        for p in todo:
            by_len.setdefault(len(p), []).append(p)
        for group in by_len.values():
            for begin in range(0, len(group), batch):
                chunk = group[begin : begin + batch]
                ids = torch.tensor(chunk, dtype=torch.long)
                scores = self.model(input_ids=ids, logits_to_keep=1).logits[:, -1].double()
                for w in self.warpers:
                    scores = w(ids, scores)
                probs = torch.softmax(scores, dim=-1).numpy()
                for p, row in zip(chunk, probs):
                    support = np.flatnonzero(row > 0)
                    self.cache[p] = SparseDist(support, row[support] / row[support].sum())


# ---------------------------------------------------------------------------------------------- the runs


class RecordingDrafter:
    """The real drafter, observed: delegates every call and records (committed ids, block) it proposed."""

    def __init__(self, inner: ModelDrafter):
        self.inner = inner
        self.blocks: list = []

    def propose(self, committed_token_ids, num_speculative_tokens, sampling, min_confidence=0.0, **kw):
        block = self.inner.propose(committed_token_ids, num_speculative_tokens, sampling,
                                   min_confidence=min_confidence, **kw)
        self.blocks.append((list(committed_token_ids), block))
        return block

    def reset(self) -> None:  # Resettable: a seeded session starts from a fresh draft state
        self.inner.reset()


@dataclass
class Session:
    config: str
    seed: int
    tokens: list[int]  # the generated tokens
    blocks: list = field(default_factory=list)  # (committed ids, DraftBlock) of every non-empty block
    num_accepted: int = 0  # as counted by the client
    num_drafts: int = 0  # verify steps (empty blocks included)


@dataclass
class Runs:
    sessions: list[Session]
    seconds: float
    bonus_drafted: bool = False  # the block rule the sessions ran with

    @property
    def tokens(self) -> np.ndarray:  # [N, MAX_NEW_TOKENS]
        return np.array([s.tokens for s in self.sessions], dtype=np.int64)


@pytest.fixture(scope="module", params=["classic", "bonus_drafted"])
def runs(tiny_pair, request) -> Runs:
    bonus_drafted = request.param == "bonus_drafted"
    runner = TargetRunner(tiny_pair.target_dir)
    backend = LocalBackend(Verifier(runner, max_num_speculative_tokens=GAMMA, max_batch_wait_ms=0.0))
    sessions: list[Session] = []
    t0 = time.monotonic()
    try:
        for config, draft_dir, draft_top_k, n, seed0 in (
            ("accepting", tiny_pair.draft_dir, 4, N_ACCEPTING, 0),
            ("rejecting", tiny_pair.other_draft_dir, 8, N_REJECTING, SEED_OFFSET),
        ):
            model = OnnxDraftModel(draft_dir)
            drafter = RecordingDrafter(ModelDrafter(model, draft_top_k=draft_top_k))
            client = EdgeClient(backend, drafter, model.tokenizer, num_speculative_tokens=GAMMA, timeout_s=60.0,
                                bonus_drafted=bonus_drafted)
            for i in range(n):
                drafter.blocks = []
                res = client.generate(PROMPT, max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE, top_k=TOP_K,
                                      top_p=TOP_P, seed=seed0 + i, ignore_eos=True, chat=False)
                assert len(res.token_ids) == MAX_NEW_TOKENS and res.finish_reason.value == "length"
                sessions.append(Session(config, seed0 + i, list(res.token_ids), drafter.blocks,
                                        res.stats.num_accepted_tokens, res.stats.num_drafts))
    finally:
        backend.close()
    return Runs(sessions, time.monotonic() - t0, bonus_drafted)


@pytest.fixture(scope="module")
def hf_target(tiny_pair):
    return AutoModelForCausalLM.from_pretrained(tiny_pair.target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(hf_target, runs) -> HFReference:
    ref = HFReference(hf_target, TEMPERATURE, TOP_K, TOP_P)
    prefixes = [PROMPT + s.tokens[:j] for s in runs.sessions for j in range(MAX_NEW_TOKENS)]
    for s in runs.sessions:
        for committed, block in s.blocks:
            prefixes += [committed + list(block.draft_token_ids[:i]) for i in range(len(block))]
    ref.prepare(prefixes)
    return ref


# ---------------------------------------------------------------------------------------------- statistics


def chi2_critical(df: int, z: float = CHI2_Z) -> float:
    """Upper quantile of chi-square(df) by Wilson–Hilferty: df (1 − 2/(9df) + z sqrt(2/(9df)))³."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


@dataclass
class Chi2:
    stat: float
    df: int

    @property
    def critical(self) -> float:
        return chi2_critical(self.df)

    @property
    def rejected(self) -> bool:
        return not self.stat < self.critical


def chi2_categorical(samples: np.ndarray, dist: SparseDist) -> Chi2:
    """Chi-square of integer samples against ``dist``; cells of expected count < 5 pooled, and one cell for every
    token outside the support (expected 0: any sample there makes the statistic infinite)."""
    n = len(samples)
    expected = dist.probs * n
    big = expected >= 5
    tokens, counts = np.unique(samples, return_counts=True)
    count_of = dict(zip(tokens.tolist(), counts.tolist()))
    obs = [count_of.get(int(t), 0) for t in dist.ids[big]]
    exp = list(expected[big])
    if (~big).any():
        obs.append(sum(count_of.get(int(t), 0) for t in dist.ids[~big]))
        exp.append(expected[~big].sum())
    outside = n - sum(obs)
    stat = float(sum((o - e) ** 2 / e for o, e in zip(obs, exp)))
    if outside:
        stat = math.inf
    return Chi2(stat, len(obs) - 1)


def tv_distance(samples: np.ndarray, dist: SparseDist) -> float:
    tokens, counts = np.unique(samples, return_counts=True)
    emp = dict(zip(tokens.tolist(), (counts / len(samples)).tolist()))
    keys = set(emp) | set(dist.ids.tolist())
    return 0.5 * sum(abs(emp.get(k, 0.0) - dist.prob(k)) for k in keys)


def tv_noise_bound(dist: SparseDist, n: int) -> float:
    """E[TV] + 6 sd of the TV distance between ``dist`` and the empirical law of n samples."""
    sigma = np.sqrt(dist.probs * (1 - dist.probs) / n)
    return 0.5 * math.sqrt(2 / math.pi) * sigma.sum() + 6 * 0.5 * math.sqrt(((1 - 2 / math.pi) * sigma**2).sum())


def pit(tokens: np.ndarray, cond, rng_seed: int = 12345) -> np.ndarray:
    """Randomized probability integral transforms [N, T] of token rows [N, T] under ``cond(prefix) -> SparseDist``
    (NaN where the token has probability 0)."""
    w = np.random.default_rng(rng_seed).random(tokens.shape)
    v = np.empty(tokens.shape)
    for r, row in enumerate(tokens):
        for j, t in enumerate(row):
            d = cond(PROMPT + row[:j].tolist())
            p = d.prob(int(t))
            v[r, j] = d.cdf_below(int(t)) + w[r, j] * p if p > 0 else np.nan
    return v


def uniformity_chi2(v: np.ndarray, bins: int) -> Chi2:
    """Chi-square of points v [N, d] in [0, 1)^d against the uniform law on a grid of bins^d cells."""
    n, d = v.shape
    cells = np.clip((v * bins).astype(int), 0, bins - 1)
    index = np.ravel_multi_index(cells.T, (bins,) * d)
    counts = np.bincount(index, minlength=bins**d)
    e = n / bins**d
    return Chi2(float(((counts - e) ** 2 / e).sum()), bins**d - 1)


def joint_checks(v: np.ndarray) -> dict[str, Chi2]:
    out = {"grid3": uniformity_chi2(v, 3)}
    for j in range(v.shape[1]):
        out[f"v{j + 1}"] = uniformity_chi2(v[:, j : j + 1], 10)
    return out


@dataclass
class Acceptance:
    """Verified draft positions: whether each was accepted, and π = min(1, p(x)/q(x)) (its acceptance
    probability under the rejection rule given everything before it)."""

    accepted: np.ndarray  # [M] bool
    pis: np.ndarray  # [M]

    def z(self, bias: float = 0.0) -> float:
        """z of the acceptances at positions with 0 < π < 1 against π + ``bias`` (capped to [0, 1])."""
        inner = (self.pis > 0) & (self.pis < 1)
        pis = np.clip(self.pis[inner] + bias, 0.0, 1.0)
        return float((self.accepted[inner].sum() - pis.sum()) / math.sqrt(max(float((pis * (1 - pis)).sum()), 1e-12)))


def acceptance(runs: Runs, ref: HFReference) -> Acceptance:
    """Every verified draft position: accepted or not (read from the committed tokens), and π = min(1, p/q)."""
    accepted, pis = [], []
    for s in runs.sessions:
        final = PROMPT + s.tokens
        for committed, block in s.blocks:
            x = [int(t) for t in block.draft_token_ids]
            after = final[len(committed) :]
            n = 0
            while n < len(x) and after[n] == x[n]:
                n += 1
            ids, probs = np.asarray(block.draft_probs.token_ids), np.asarray(block.draft_probs.probs, np.float64)
            for i in range(min(n + 1, len(x))):
                row_q = probs[i] / probs[i].sum()
                q = float(row_q[ids[i] == x[i]][0])
                p = ref(committed + x[:i]).prob(x[i])
                pis.append(min(1.0, p / q))
                accepted.append(i < n)
    return Acceptance(np.array(accepted), np.array(pis))


# ---------------------------------------------------------------------------------------------- tests


def test_runs_exercise_acceptance_rejection_and_several_steps(runs):
    by = {c: [s for s in runs.sessions if s.config == c] for c in ("accepting", "rejecting")}
    assert len(by["accepting"]) == N_ACCEPTING and len(by["rejecting"]) == N_REJECTING
    acc_rate = sum(s.num_accepted for s in by["accepting"]) / sum(len(b) for s in by["accepting"] for _, b in s.blocks)
    assert 0.1 < acc_rate < 0.7, acc_rate  # both outcomes common
    # the accepting draft: some sessions end in one block (2 accepted + bonus), others need 2 or 3 steps
    steps = [s.num_drafts for s in by["accepting"]]
    assert min(steps) == 1 and max(steps) == MAX_NEW_TOKENS
    assert any(s.num_accepted == GAMMA for s in by["accepting"])
    # the rejecting draft: nothing accepted, one token per step (two recovered tokens, then a plain decoding
    # step: the block may not pass max_new_tokens, so the last one is empty; with bonus_drafted blocks the
    # last one holds the bonus_drafted token alone, rejected too: three recovered tokens)
    num_blocks = MAX_NEW_TOKENS if runs.bonus_drafted else 2
    assert all(s.num_accepted == 0 and s.num_drafts == MAX_NEW_TOKENS and len(s.blocks) == num_blocks
               for s in by["rejecting"])
    # the sessions differ (seeds are used) and all blocks were top-k drafted (q travels)
    assert len({tuple(s.tokens) for s in runs.sessions}) > len(runs.sessions) // 4
    assert all(b.draft_probs is not None for s in runs.sessions for _, b in s.blocks)
    # the block rule: bonus_drafted blocks carry γ + 1 draft tokens
    assert max(len(b) for s in runs.sessions for _, b in s.blocks) == GAMMA + runs.bonus_drafted
    assert all(b.bonus_drafted == runs.bonus_drafted for s in runs.sessions for _, b in s.blocks)
    print(f"\n{len(runs.sessions)} sessions in {runs.seconds:.1f} s; acceptance {acc_rate:.3f}")


def test_every_token_in_the_target_support(runs, reference):
    bad = [(s.config, s.seed, j, t) for s in runs.sessions for j, t in enumerate(s.tokens)
           if reference(PROMPT + s.tokens[:j]).prob(t) == 0.0]
    assert not bad, f"{len(bad)} tokens outside top-k/top-p support, e.g. {bad[:5]}"


def test_first_token_distribution(runs, reference):
    first = runs.tokens[:, 0]
    p1 = reference(PROMPT)
    assert 10 <= len(p1.ids) <= TOP_K and p1.probs.max() < 0.5  # a support the sample size can resolve
    c = chi2_categorical(first, p1)
    tv, bound = tv_distance(first, p1), tv_noise_bound(p1, len(first))
    print(f"\nfirst token: chi2 {c.stat:.1f} (df {c.df}, critical {c.critical:.1f}); TV {tv:.4f} (bound {bound:.4f})")
    assert not c.rejected, c
    assert tv < bound
    for config in ("accepting", "rejecting"):  # each draft on its own, too
        sub = np.array([s.tokens[0] for s in runs.sessions if s.config == config])
        assert not chi2_categorical(sub, p1).rejected, config


def test_joint_law_of_three_tokens(runs, reference):
    """(t1, t2, t3) follow the target's conditionals: the Rosenblatt transforms are i.i.d. uniform."""
    v = pit(runs.tokens, reference)
    assert not np.isnan(v).any()
    checks = joint_checks(v)
    print("\n" + ", ".join(f"{k}: {c.stat:.1f}/{c.critical:.1f}" for k, c in checks.items()))
    for name, c in checks.items():
        assert not c.rejected, (name, c)
    assert abs(np.corrcoef(v[:, 0], v[:, 1])[0, 1]) < 4 / math.sqrt(len(v))
    assert abs(np.corrcoef(v[:, 1], v[:, 2])[0, 1]) < 4 / math.sqrt(len(v))


def test_acceptance_matches_the_rejection_rule(runs, reference):
    """Draft tokens the target gives probability 0 are never accepted; the others are accepted with probability
    min(1, p/q) each (z-test over all of them)."""
    a = acceptance(runs, reference)
    zero, inner = a.pis == 0, (a.pis > 0) & (a.pis < 1)
    print(f"\nacceptance: {a.accepted.sum()} of {len(a.pis)} verified draft positions; {zero.sum()} with p(x) = 0, "
          f"{a.accepted[zero].sum()} of them accepted; 0 < π < 1: {a.accepted[inner].sum()} accepted, expected "
          f"{a.pis[inner].sum():.1f}, z = {a.z():.2f} (against +{ACCEPT_BIAS}: {a.z(ACCEPT_BIAS):.2f})")
    assert zero.sum() >= 2 * N_REJECTING and inner.sum() >= N_ACCEPTING
    assert not a.accepted[zero].any(), "a draft token of target probability 0 was accepted"
    assert a.accepted[a.pis >= 1].all()
    assert abs(a.z()) < Z_ACCEPT, a.z()


# ---------------------------------------------------------------------------------------------- negative controls


def test_negative_control_first_token_against_wrong_distributions(runs, reference, hf_target, tiny_pair):
    first = runs.tokens[:, 0]
    no_top_p = HFReference(hf_target, TEMPERATURE, TOP_K, 1.0)(PROMPT)
    p1 = reference(PROMPT)
    top4 = np.argsort(-p1.probs, kind="stable")[:4]  # the accepting draft's q: the target's top 4, renormalised
    order = np.argsort(p1.ids[top4])
    accepting_q = SparseDist(p1.ids[top4][order], p1.probs[top4][order] / p1.probs[top4].sum())
    other = AutoModelForCausalLM.from_pretrained(tiny_pair.other_target_dir, dtype=torch.float32).eval()
    rejecting_q = HFReference(other, TEMPERATURE, TOP_K, TOP_P)(PROMPT)
    for name, wrong in (("target without top-p", no_top_p), ("accepting draft q", accepting_q),
                        ("rejecting draft", rejecting_q)):
        c = chi2_categorical(first, wrong)
        assert c.rejected and c.stat > 3 * c.critical, (name, c)
        assert tv_distance(first, wrong) > tv_noise_bound(wrong, len(first)), name
    # the top-p cut is not marginal: a verifier that forgot it would put this much mass outside the support
    assert 1 - sum(no_top_p.prob(int(t)) for t in p1.ids) > 0.1


def test_negative_control_acceptance_bias(runs, reference):
    """A verifier accepting 3 points too often is caught: at the positions of target probability 0 it would
    accept some (the chance of none is below 1e-7); elsewhere the z-test resolves about ±5 points at this
    sample size (a 3-point bias moves z by about 2.5 sd)."""
    a = acceptance(runs, reference)
    assert (1 - ACCEPT_BIAS) ** int((a.pis == 0).sum()) < 1e-7
    assert a.z(2 * ACCEPT_BIAS) < -Z_ACCEPT, a.z(2 * ACCEPT_BIAS)
    assert a.z(-2 * ACCEPT_BIAS) > Z_ACCEPT, a.z(-2 * ACCEPT_BIAS)


def _synthetic(reference: HFReference, n: int, reuse_uniform: bool, seed: int = 7) -> np.ndarray:
    """n token rows sampled from the reference conditionals by inverse CDF in token-id order, with independent
    uniforms, or with one uniform reused at every step (the bug of a random stream not keyed by position)."""
    rng = np.random.default_rng(seed)
    rows = np.empty((n, MAX_NEW_TOKENS), dtype=np.int64)
    for r in range(n):
        u0 = rng.random()
        prefix = list(PROMPT)
        for j in range(MAX_NEW_TOKENS):
            u = u0 if reuse_uniform else rng.random()
            d = reference(prefix)
            k = min(int(np.searchsorted(np.cumsum(d.probs), u, side="right")), len(d.ids) - 1)
            prefix.append(int(d.ids[k]))
            rows[r, j] = d.ids[k]
    return rows


def test_negative_control_joint_law_sees_reused_draws(runs, reference):
    n = len(runs.sessions)
    good = joint_checks(pit(_synthetic(reference, n, reuse_uniform=False), reference))
    assert not any(c.rejected for c in good.values()), good
    bad = joint_checks(pit(_synthetic(reference, n, reuse_uniform=True), reference))
    assert bad["grid3"].rejected and bad["grid3"].stat > 3 * bad["grid3"].critical, bad
    # the marginals alone would not have seen it: the dependence between steps is what gives it away
    assert not bad["v1"].rejected


def test_chi2_critical_approximation():
    """Wilson–Hilferty against tabulated chi-square quantiles at 1 − 1e-4 (scipy.stats.chi2.ppf)."""
    for df, exact in ((9, 33.7199), (20, 52.3860), (26, 60.7014)):
        assert exact <= chi2_critical(df) < exact * 1.04
