"""Rejection sampler (common.rejection): certain outcomes from hand-built logits, then statistical losslessness.

Statistical part. A small Markov "language" over V = 8 tokens: the target p and the draft q at each position
depend on the previous token (P0/Q0 at position 0, rows P[prev]/Q[prev] after), so the joint law of the first
two committed tokens under target-only sampling is P0(c0) · P[c0](c1). The full edge/verifier loop is simulated
with γ = 2 blocks: the edge drafts from q (top-k sparse q with k = vocab or k = 3, or greedy one-hot q) with
draws independent of the verifier's, keyed by position like the DRAFT_SAMPLE stream; the verifier runs
verify_sampled with target rows conditioned on the drafted prefix; tokens are committed, and the loop repeats
until 3 (or 2, see N_TOKENS) tokens are committed. One seed per session, sessions 0..N−1. Checked (Leviathan et al. 2023: Appendix A.1, the output is distributed as p;
Theorem 3.5, a draft token is accepted with probability β = Σ_x min(p(x), q(x))):

- the first committed token ~ P0, the pair (c0, c1) ~ P0·P[c0], the third token's marginal ~ P0·P·P (it is
  often the bonus token), by total-variation distance and a chi-square test;
- TV shrinks with more samples (2k vs 32k, nested) and at 32k lies under a bound derived from multinomial
  noise: E[TV] + 6 sd, with E|p̂_i − p_i| ≈ sqrt(2/π) σ_i, σ_i = sqrt(p_i (1 − p_i) / N);
- the acceptance rate of position 0 is α = Σ_x min(p(x), q(x)), and position 1's follows the same rule;
- negative controls fail the same check: (a) accepting every draft token (output ~ q); (b) on rejection
  resampling from p instead of the residual norm(max(0, p − q)).

Chi-square critical values use the Wilson–Hilferty approximation (scipy not required), at significance 1e-4.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import pytest

from specdec_runtime.common.rejection import RejectionResult, verify_greedy, verify_sampled
from specdec_runtime.common.sampling import (
    Stream,
    dense_draft_probs,
    normalize_sparse,
    sample_from,
    draft_topk_from_probs,
    uniform,
)
from specdec_runtime.common.types import SparseDraftProbs

# --------------------------------------------------------------------------------------- certain outcomes

V = 10


def _logits_with_argmax(argmaxes: list[int], vocab: int = V, seed: int = 0) -> np.ndarray:
    """[len(argmaxes), vocab] float32 random logits whose row i has its maximum at argmaxes[i]."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(len(argmaxes), vocab)).astype(np.float32)
    for i, a in enumerate(argmaxes):
        logits[i, a] = logits[i].max() + 1.0
    return logits


def test_greedy_accepts_all_and_bonus():
    draft = [3, 1, 4, 1]
    res = verify_greedy(draft, _logits_with_argmax(draft + [7]))
    assert res == RejectionResult(num_accepted=4, next_token_id=7)
    assert res.committed == 5


@pytest.mark.parametrize("reject_at", [0, 2, 3])
def test_greedy_rejects_at_first_mismatch(reject_at):
    draft = [3, 1, 4, 1]
    target_argmax = list(draft) + [7]
    target_argmax[reject_at] = 9
    target_argmax[reject_at + 1] = 5  # later rows must not matter
    res = verify_greedy(draft, _logits_with_argmax(target_argmax))
    assert res.num_accepted == reject_at
    assert res.next_token_id == 9  # recovered = target argmax at the first mismatch
    assert res.committed == reject_at + 1


def test_greedy_empty_block_gives_target_argmax():
    assert verify_greedy([], _logits_with_argmax([6])) == RejectionResult(0, 6)


def _one_hot(ids: list[int], vocab: int = V) -> np.ndarray:
    p = np.zeros((len(ids), vocab))
    p[np.arange(len(ids)), ids] = 1.0
    return p


SEEDS = range(200)


def test_sampled_one_hot_q_equal_to_p_always_accepted():
    draft = [2, 5, 8]
    target = _one_hot(draft + [4])  # p is one-hot on each draft token, bonus certain
    sparse = SparseDraftProbs(np.array(draft, dtype=np.int64)[:, None], np.ones((3, 1), dtype=np.float32))
    for draft_probs in (None, sparse):
        for seed in SEEDS:
            assert verify_sampled(draft, draft_probs, target, seed, 17) == RejectionResult(3, 4)


def test_sampled_q_equal_to_p_always_accepted():
    # Dyadic probabilities are exact in float32, so q == p exactly after the wire round trip.
    row = np.array([0.5, 0.25, 0.125, 0.0625, 0.0625])
    ids = np.array([6, 0, 3, 9, 1], dtype=np.int64)
    p = np.zeros(V)
    p[ids] = row
    draft = [0, 9]  # not the most likely tokens: acceptance must still be certain
    sparse = SparseDraftProbs(np.stack([ids, ids]), np.stack([row, row]).astype(np.float32))
    target = np.stack([p, p, p])
    bonuses = set()
    for seed in SEEDS:
        res = verify_sampled(draft, sparse, target, seed, 0)
        assert res.num_accepted == 2
        assert p[res.next_token_id] > 0
        bonuses.add(res.next_token_id)
    assert len(bonuses) >= 3  # the bonus is sampled from p, not fixed


@pytest.mark.parametrize("reject_at", [0, 1])
def test_sampled_zero_target_prob_always_rejected(reject_at):
    draft = [4, 7]
    q_row_ids = np.array([[4, 1, 2], [7, 1, 2]], dtype=np.int64)
    q_rows = np.array([[0.6, 0.3, 0.1], [0.6, 0.3, 0.1]], dtype=np.float32)
    target = np.full((3, V), 1.0 / V)
    if reject_at == 1:
        target[0] = _one_hot([4])[0]  # position 0 accepted with certainty (p(x) = 1 >= q(x))
    target[reject_at, draft[reject_at]] = 0.0
    target[reject_at] /= target[reject_at].sum()
    recovered = set()
    for seed in SEEDS:
        res = verify_sampled(draft, SparseDraftProbs(q_row_ids, q_rows), target, seed, 5)
        assert res.num_accepted == reject_at
        assert res.next_token_id != draft[reject_at]
        assert target[reject_at, res.next_token_id] > 0
        recovered.add(res.next_token_id)
    # The recovered token comes from the residual max(0, p − q): every token with p > q turns up, and token 1
    # (q = 0.3 > p = 1/9) never does although p(1) > 0 (resampling from p would produce it).
    q_dense = np.zeros(V)
    q_dense[q_row_ids[reject_at]] = q_rows[reject_at]
    assert recovered == set(np.flatnonzero(target[reject_at] > q_dense).tolist())
    assert 1 not in recovered and target[reject_at, 1] > 0


def test_greedy_drafting_with_sampled_target():
    draft = [3, 8]  # greedy drafting: q is one-hot on each draft token (draft_probs None)
    target = np.full((3, V), 1.0 / V)
    target[0] = _one_hot([3])[0]  # p(x0) = 1 → always accepted
    target[1, 8] = 0.0  # p(x1) = 0 → always rejected; recovered from p without x1
    target[1] /= target[1].sum()
    seen = set()
    for seed in SEEDS:
        res = verify_sampled(draft, None, target, seed, 40)
        assert res.num_accepted == 1 and res.next_token_id != 8
        seen.add(res.next_token_id)
    assert seen == set(range(V)) - {8}


def test_sampled_reproducible_and_keyed_by_position():
    rng = np.random.default_rng(3)
    target = rng.dirichlet(np.ones(V), size=4)
    draft = [1, 2, 3]
    results = [verify_sampled(draft, None, target, 11, pos) for pos in range(50)]
    assert results == [verify_sampled(draft, None, target, 11, pos) for pos in range(50)]
    assert len(set(results)) > 5  # the draws depend on the absolute position
    assert len({verify_sampled(draft, None, target, s, 0) for s in range(50)}) > 5  # ... and on the seed


# --------------------------------------------------------------------------------------- statistical
SV = 8  # vocabulary of the statistical model
GAMMA = 2
N_SMALL, N_LARGE = 2_000, 32_000
CHI2_Z = 3.719  # one-sided normal quantile of 1e-4


def _model():
    """P0, P [SV, SV] (target, rows with one exact zero each) and Q0, Q (draft, strictly positive)."""
    rng = np.random.default_rng(20240607)
    p = rng.dirichlet(np.full(SV, 1.5), size=SV + 1)
    p[np.arange(SV + 1), rng.integers(0, SV, size=SV + 1)] = 0.0
    p /= p.sum(axis=1, keepdims=True)
    q = rng.dirichlet(np.full(SV, 1.5), size=SV + 1)
    return p[0], p[1:], q[0], q[1:]


P0, P, Q0, Q = _model()


def _draft_next(prefix: list[int]) -> np.ndarray:
    return Q0 if not prefix else Q[prefix[-1]]


@functools.lru_cache(maxsize=None)
def _sparse_q(state: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-k draft distribution of a state (-1 = empty prefix): ids [k] int64, wire probs [k] float32, and the
    float64 distribution the edge samples from (normalize_sparse of the wire probs)."""
    ids, probs = draft_topk_from_probs(Q0 if state < 0 else Q[state], k)
    return ids, probs, normalize_sparse(probs)


def drafting_distribution(prefix: list[int], mode: str) -> np.ndarray:
    """Dense q [SV] the edge actually samples from in ``mode`` ("greedy" or "top<k>")."""
    if mode == "greedy":
        q = np.zeros(SV)
        q[int(np.argmax(_draft_next(prefix)))] = 1.0
        return q
    ids, _, q_sparse = _sparse_q(prefix[-1] if prefix else -1, int(mode[3:]))
    q = np.zeros(SV)
    q[ids] = q_sparse
    return q


@functools.lru_cache(maxsize=None)
def _greedy_draft(state: int) -> int:
    return int(np.argmax(Q0 if state < 0 else Q[state]))


@functools.lru_cache(maxsize=None)
def _sparse_block(state: int, first: int, k: int) -> SparseDraftProbs:
    """SparseDraftProbs [γ=2, k] of a block drafted after ``state`` whose first token is ``first``."""
    (ids0, p0, _), (ids1, p1, _) = _sparse_q(state, k), _sparse_q(first, k)
    return SparseDraftProbs(np.stack([ids0, ids1]), np.stack([p0, p1]))


@functools.lru_cache(maxsize=None)
def _target_block(state: int, d0: int, d1: int) -> np.ndarray:
    """target_probs [γ + 1, SV] of the block (d0, d1) drafted after ``state``: rows conditioned on the prefix."""
    return np.stack([P0 if state < 0 else P[state], P[d0], P[d1]])


# The edge's draft draws: independent of the verifier's ACCEPT/TARGET_SAMPLE streams, as the DRAFT_SAMPLE
# stream is (a table instead of common.sampling.uniform only to keep the test fast).
_DRAFT_U = np.random.default_rng(99).random((N_LARGE, 16))


def draft_block(prefix: list[int], mode: str, seed: int) -> tuple[list[int], SparseDraftProbs | None]:
    """γ = 2 draft tokens from the committed ``prefix``, sampled from q as the edge samples them."""
    state = prefix[-1] if prefix else -1
    if mode == "greedy":
        d0 = _greedy_draft(state)
        return [d0, _greedy_draft(d0)], None
    k = int(mode[3:])
    ids0, _, q0 = _sparse_q(state, k)
    d0 = int(ids0[sample_from(q0, _DRAFT_U[seed, len(prefix)])])
    ids1, _, q1 = _sparse_q(d0, k)
    d1 = int(ids1[sample_from(q1, _DRAFT_U[seed, len(prefix) + 1])])
    return [d0, d1], _sparse_block(state, d0, k)


def verify_accept_all(draft_token_ids, draft_probs, target_probs, seed, start_position) -> RejectionResult:
    """Negative control (a): every draft token accepted, bonus from p (output ~ q)."""
    gamma = len(draft_token_ids)
    u = uniform(seed, start_position + gamma, Stream.TARGET_SAMPLE)
    return RejectionResult(gamma, sample_from(target_probs[gamma], u))


def verify_resample_from_target(draft_token_ids, draft_probs, target_probs, seed, start_position):
    """Negative control (b): the rejection rule of verify_sampled, but resampling from p after a rejection."""
    gamma = len(draft_token_ids)
    vocab = target_probs.shape[-1]
    for i in range(gamma):
        x = int(draft_token_ids[i])
        q = dense_draft_probs(draft_token_ids, draft_probs, i, vocab)
        if uniform(seed, start_position + i, Stream.ACCEPT) * q[x] < target_probs[i, x]:
            continue
        return RejectionResult(i, sample_from(target_probs[i], uniform(seed, start_position + i, Stream.TARGET_SAMPLE)))
    u = uniform(seed, start_position + gamma, Stream.TARGET_SAMPLE)
    return RejectionResult(gamma, sample_from(target_probs[gamma], u))


@dataclass
class Runs:
    """Outcomes of N independent sessions (first verify step for the acceptance flags)."""

    committed: np.ndarray  # [N, n_tokens] int64
    accepted_pos0: np.ndarray  # [N] bool
    accepted_pos1: np.ndarray  # [N] bool


def simulate(verify, mode: str, n: int, n_tokens: int = 3) -> Runs:
    """Run the edge/verifier loop for seeds 0..n-1 until ``n_tokens`` tokens are committed in each."""
    committed = np.zeros((n, n_tokens), dtype=np.int64)
    acc0 = np.zeros(n, dtype=bool)
    acc1 = np.zeros(n, dtype=bool)
    for seed in range(n):
        out: list[int] = []
        first = True
        while len(out) < n_tokens:
            draft, sparse = draft_block(out, mode, seed)
            assert len(draft) == GAMMA
            target = _target_block(out[-1] if out else -1, draft[0], draft[1])
            res = verify(draft, sparse, target, seed, len(out))
            if first:
                acc0[seed], acc1[seed], first = res.num_accepted >= 1, res.num_accepted >= 2, False
            out += draft[: res.num_accepted] + [res.next_token_id]
        committed[seed] = out[:n_tokens]
    return Runs(committed, acc0, acc1)


@dataclass
class Check:
    tv: float
    tv_bound: float
    chi2: float
    chi2_critical: float
    impossible: int  # samples that fell on zero-probability outcomes

    @property
    def passed(self) -> bool:
        return self.impossible == 0 and self.tv < self.tv_bound and self.chi2 < self.chi2_critical


def chi2_critical(df: int, z: float = CHI2_Z) -> float:
    """Upper quantile of chi-square(df) by Wilson–Hilferty: df (1 − 2/(9df) + z sqrt(2/(9df)))³."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def tv_noise_bound(p: np.ndarray, n: int) -> float:
    """E[TV] + 6 sd of the TV distance between p and the empirical law of n multinomial samples."""
    p = p[p > 0]
    sigma = np.sqrt(p * (1 - p) / n)
    mean = 0.5 * math.sqrt(2 / math.pi) * sigma.sum()
    sd = 0.5 * math.sqrt(((1 - 2 / math.pi) * sigma**2).sum())
    return mean + 6 * sd


def check(samples: np.ndarray, p: np.ndarray) -> Check:
    """Compare ``samples`` (int [N], outcomes indexing the flattened ``p``) with the distribution ``p``.

    Chi-square over outcomes of p > 0, pooling those with expected count < 5 into one cell.
    """
    p = p.ravel()
    n = len(samples)
    counts = np.bincount(samples, minlength=len(p)).astype(np.float64)
    tv = 0.5 * np.abs(counts / n - p).sum()
    expected = p * n
    big = expected >= 5
    obs = list(counts[big])
    exp = list(expected[big])
    small = (~big) & (p > 0)
    if small.any():
        obs.append(counts[small].sum())
        exp.append(expected[small].sum())
    obs_a, exp_a = np.array(obs), np.array(exp)
    chi2 = float(((obs_a - exp_a) ** 2 / exp_a).sum())
    return Check(tv, tv_noise_bound(p, n), chi2, chi2_critical(len(obs) - 1), int(counts[p == 0].sum()))


JOINT = P0[:, None] * P  # [SV, SV] law of (c0, c1)
THIRD = JOINT.sum(axis=0) @ P  # [SV] marginal law of c2


def _checks(runs: Runs, n: int) -> dict[str, Check]:
    """Checks of the first n sessions: "first" (c0 ~ P0), "pair" ((c0, c1) ~ JOINT), "third" (c2 ~ THIRD)."""
    c = runs.committed[:n]
    checks = {"first": check(c[:, 0], P0), "pair": check(c[:, 0] * SV + c[:, 1], JOINT)}
    if c.shape[1] > 2:
        checks["third"] = check(c[:, 2], THIRD)
    return checks


MODES = ["top8", "top3", "greedy"]  # top-k sparse q with k = vocab, k < vocab, one-hot q
# Committed tokens simulated per session: the third token (often a bonus token) is checked in one mode only,
# to keep the suite fast (sessions that need a second verify step cost twice as much).
N_TOKENS = {"top8": 3, "top3": 2, "greedy": 2}


@functools.lru_cache(maxsize=None)
def _runs(verify_name: str, mode: str, n: int = N_LARGE, n_tokens: int | None = None) -> Runs:
    verify = {
        "verify_sampled": verify_sampled,
        "accept_all": verify_accept_all,
        "resample_from_p": verify_resample_from_target,
    }[verify_name]
    return simulate(verify, mode, n, n_tokens or N_TOKENS[mode])


def test_statistical_model_is_nontrivial():
    """The draft differs enough from the target that the negative controls can be told apart."""
    for mode in MODES:
        q0 = drafting_distribution([], mode)
        assert 0.25 < 0.5 * np.abs(P0 - q0).sum()
    assert (P0 == 0).sum() == 1 and (Q0 > 0).all()


@pytest.mark.parametrize("mode", MODES)
def test_verify_sampled_is_lossless(mode):
    runs = _runs("verify_sampled", mode)
    small, large = _checks(runs, N_SMALL), _checks(runs, N_LARGE)
    assert len(large) == N_TOKENS[mode]
    for name in large:
        assert large[name].passed, (name, large[name])
        assert small[name].tv > large[name].tv, (name, small[name], large[name])  # shrinks with N
        assert small[name].impossible == 0


@pytest.mark.parametrize("mode", MODES)
def test_acceptance_rate_matches_theory(mode):
    """α = Σ_x min(p(x), q(x)) at position 0; position 1 (given x0 accepted) has α(x0) of its own rows."""
    runs = _runs("verify_sampled", mode)
    q0 = drafting_distribution([], mode)
    alpha0 = np.minimum(P0, q0).sum()
    # P(x0 drafted and accepted) = min(p0, q0)(x0); then x1 is accepted with prob Σ min(P[x0], q(·|x0)).
    alpha1 = sum(
        np.minimum(P0[x], q0[x]) * np.minimum(P[x], drafting_distribution([x], mode)).sum() for x in range(SV)
    )
    for rate, expected in ((runs.accepted_pos0.mean(), alpha0), (runs.accepted_pos1.mean(), alpha1)):
        sigma = math.sqrt(expected * (1 - expected) / N_LARGE)
        assert abs(rate - expected) < 5 * sigma, (rate, expected)
    assert 0.05 < alpha0 < 0.95  # a rate that could be wrong either way


@pytest.mark.parametrize("control", ["accept_all", "resample_from_p"])
def test_negative_controls_fail_the_same_check(control):
    runs = _runs(control, "top8", N_LARGE, 2)
    large = _checks(runs, N_LARGE)
    for name in ("first", "pair"):
        c = large[name]
        assert not c.passed
        assert c.tv > 3 * c.tv_bound and c.chi2 > 3 * c.chi2_critical, (name, c)


def test_resample_control_fails_with_greedy_drafting():
    c = _checks(_runs("resample_from_p", "greedy", 8_000, 2), 8_000)["first"]
    assert not c.passed and c.tv > 2 * c.tv_bound, c


def test_chi2_critical_approximation():
    """Wilson–Hilferty against tabulated chi-square quantiles at 1 − 1e-4 (scipy.stats.chi2.ppf)."""
    for df, exact in ((3, 21.1075), (7, 29.8775), (20, 52.3860), (63, 113.5050)):
        assert exact <= chi2_critical(df) < exact * 1.04
