"""common.rejection at its edges: verify_block's wiring, the exact acceptance boundary, the residual guard,
bonus_drafted blocks, and RejectionResult.committed.

The reference here is written from Leviathan et al. 2023, Algorithm 1 directly: p is a plain numpy softmax of
logits / temperature (top-k and top-p off, so no warper is involved), q is the one-hot or sparse draft
distribution, and each acceptance test / recovered / bonus token uses the same counter-based draws
(common.sampling.uniform) the verifier uses. test_rejection.py holds the statistical (distributional) tests;
these pin single verdicts exactly, so they also serve scripts/mutation.sh (fast, every branch reached).
"""

from __future__ import annotations

import numpy as np
import pytest

from specdec_runtime.common.rejection import RejectionResult, verify_block, verify_greedy, verify_sampled
from specdec_runtime.common.sampling import Stream, uniform
from specdec_runtime.common.types import DraftBlock, SamplingParams, SparseDraftProbs

V = 12  # vocabulary (logit columns)


def softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def reference_verdict(draft, q_rows, p_rows, seed, start, bonus_drafted=False) -> RejectionResult:
    """Algorithm 1 with the verifier's draws: accept x_i iff u_i < p_i(x_i) / q_i(x_i); recovered token by
    inverse CDF of norm(max(0, p_i - q_i)); bonus by inverse CDF of p_γ (none when bonus_drafted)."""
    for i, x in enumerate(draft):
        u = uniform(seed, start + i, Stream.ACCEPT)
        if u < p_rows[i][x] / q_rows[i][x]:
            continue
        residual = np.maximum(p_rows[i] - q_rows[i], 0.0)
        cdf = np.cumsum(residual / residual.sum())
        return RejectionResult(i, int(np.searchsorted(cdf, uniform(seed, start + i, Stream.TARGET_SAMPLE), "right")))
    if bonus_drafted:
        return RejectionResult(len(draft), -1)
    cdf = np.cumsum(p_rows[len(draft)])
    return RejectionResult(len(draft), int(np.searchsorted(cdf, uniform(seed, start + len(draft),
                                                                          Stream.TARGET_SAMPLE), "right")))


def one_hot(ids) -> np.ndarray:
    q = np.zeros((len(ids), V))
    q[np.arange(len(ids)), ids] = 1.0
    return q


# ---------------------------------------------------------------------------------------------- small pieces


def test_num_scored_positions_and_committed():
    assert [DraftBlock([7] * n).num_scored_positions for n in (0, 1, 4)] == [1, 2, 5]
    assert [DraftBlock([7] * n, bonus_drafted=True).num_scored_positions for n in (1, 4)] == [1, 4]
    assert [DraftBlock([7] * n).num_speculative_tokens for n in (0, 4)] == [0, 4]
    assert [DraftBlock([7] * n, bonus_drafted=True).num_speculative_tokens for n in (1, 4)] == [0, 3]
    assert DraftBlock([5, 6, 7], bonus_drafted=True).scored_draft_token_ids == [5, 6]
    assert RejectionResult(3, 7).committed == 4
    assert RejectionResult(3, 0).committed == 4  # token id 0 is a token
    assert RejectionResult(3, -1).committed == 3
    assert RejectionResult(0, -1).committed == 0


# ---------------------------------------------------------------------------------------------- verify_block


def test_verify_block_rejects_logits_of_the_wrong_height():
    logits = np.zeros((3, V))
    with pytest.raises(ValueError, match="^target logits have 3 rows for a block scoring 4 positions$"):
        verify_block(DraftBlock([1, 2, 3]), logits, SamplingParams().seeded(0), 5)
    with pytest.raises(ValueError, match="^target logits have 3 rows for a block scoring 2 positions$"):
        verify_block(DraftBlock([1, 2], bonus_drafted=True), logits, SamplingParams().seeded(0), 5)
    verify_block(DraftBlock([1, 2, 3], bonus_drafted=True), logits, SamplingParams().seeded(0), 5)


def test_verify_block_greedy_and_padding():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, V))
    argmax = logits.argmax(-1)
    greedy = SamplingParams(temperature=0.0)
    draft = [int(argmax[0]), int(argmax[1]), (int(argmax[2]) + 1) % V]
    assert verify_block(DraftBlock(draft), logits, greedy.seeded(0), 9) == RejectionResult(2, int(argmax[2]))
    full = [int(t) for t in argmax[:3]]
    assert verify_block(DraftBlock(full), logits, greedy.seeded(0), 9) == RejectionResult(3, int(argmax[3]))
    assert verify_block(DraftBlock(full, bonus_drafted=True), logits[:3], greedy.seeded(0), 9) == RejectionResult(3, -1)
    # a padded column (id >= valid_vocab_size) with the largest logit is never the verdict's token
    padded = logits.copy()
    padded[:, V - 1] = 100.0
    valid = V - 1
    expect = padded[:, :valid].argmax(-1)
    assert verify_block(DraftBlock([]), padded[:1], greedy.seeded(0), 9, valid) == RejectionResult(0, int(expect[0]))
    assert verify_block(DraftBlock([]), padded[:1], greedy.seeded(0), 9) == RejectionResult(0, V - 1)
    assert verify_greedy([], padded[:1], valid) == RejectionResult(0, int(expect[0]))
    for seed in range(20):  # sampled: the padded column has probability 0 whatever the draws
        r = verify_block(DraftBlock([]), padded[:1], SamplingParams(temperature=1.0).seeded(seed), 9, valid)
        assert r.num_accepted == 0 and 0 <= r.next_token_id < valid


@pytest.mark.parametrize("drafting", ["greedy", "topk"])
@pytest.mark.parametrize("bonus_drafted", [False, True])
def test_verify_block_sampled_equals_algorithm_1(drafting, bonus_drafted):
    """Many seeded blocks: verify_block's verdict equals the reference's, draw for draw (seed, absolute start
    position, temperature and the bonus rule all reach verify_sampled)."""
    rng = np.random.default_rng(1)
    gamma, temperature = 3, 0.7
    seen = set()
    for trial in range(200):
        logits = rng.normal(scale=1.5, size=(gamma + 1, V))
        p_rows = softmax(logits, temperature)
        if drafting == "greedy":
            draft = [int(rng.choice(V, p=p_rows[i])) for i in range(gamma)]
            q_rows, draft_probs = one_hot(draft), None
        else:
            ids = np.stack([rng.permutation(V)[:4] for _ in range(gamma)])
            probs = rng.dirichlet(np.ones(4), size=gamma).astype(np.float32)
            draft = [int(ids[i, rng.choice(4, p=probs[i] / probs[i].sum())]) for i in range(gamma)]
            draft_probs = SparseDraftProbs(ids.astype(np.int64), probs)
            q_rows = np.zeros((gamma, V))
            for i in range(gamma):
                q_rows[i, ids[i]] = probs[i].astype(np.float64) / probs[i].astype(np.float64).sum()
        seed, start = 1000 + trial, 17 + trial % 5
        rows = gamma if bonus_drafted else gamma + 1
        block = DraftBlock(draft, draft_probs, bonus_drafted=bonus_drafted)
        got = verify_block(block, logits[:rows], SamplingParams(temperature=temperature).seeded(seed), start)
        assert got == reference_verdict(draft, q_rows, p_rows, seed, start, bonus_drafted), trial
        seen.add(got.num_accepted)
    assert seen == set(range(gamma + 1))  # every branch: rejections at each position, and full blocks


# ---------------------------------------------------------------------------------------------- verify_sampled edges


def test_acceptance_is_strict_at_u_times_q_equal_p():
    """Accept iff u * q(x) < p(x): when p(x) equals u * q(x) exactly the draft token is rejected (with p(x) = 0
    and u = 0 accepting would commit a token the target never produces)."""
    seed, start, x = 3, 40, 5
    u = uniform(seed, start, Stream.ACCEPT)
    p = np.full((2, V), 0.0)
    p[0, x] = u  # p(x) = u * q(x) with q one-hot
    p[0, 2] = 1.0 - u
    p[1, 0] = 1.0
    assert verify_sampled([x], None, p, seed, start) == RejectionResult(0, 2)
    p[0, x], p[0, 2] = np.nextafter(u, 1.0), 1.0 - np.nextafter(u, 1.0)
    assert verify_sampled([x], None, p, seed, start) == RejectionResult(1, 0)


def test_residual_without_mass_falls_back_to_p():
    """Rejected where max(0, p - q) has no mass (p <= q everywhere: only by rounding in practice): the recovered
    token is sampled from p itself, never from an empty residual."""
    seed, start, x = 11, 7, 4
    u = uniform(seed, start, Stream.ACCEPT)
    q = SparseDraftProbs(np.asarray([[x, 6]], np.int64), np.asarray([[0.5, 0.5]], np.float32))
    p = np.zeros((2, V))
    p[0, x], p[0, 6] = 0.25 * u, 0.5  # below q everywhere, and p(x) / q(x) = u / 2 < u: rejected
    p[1, 1] = 1.0
    got = verify_sampled([x], q, p, seed, start)
    t = uniform(seed, start, Stream.TARGET_SAMPLE)
    assert got == RejectionResult(0, x if t * (0.25 * u + 0.5) < 0.25 * u else 6)


def test_bonus_drafted_full_block_has_no_bonus_token():
    p = np.zeros((2, V))
    p[0, 3] = p[1, 4] = 1.0
    assert verify_sampled([3, 4], None, p, 5, 0, bonus_drafted=True) == RejectionResult(2, -1)
    assert verify_greedy([3, 4], np.log(p + 1e-9), bonus_drafted=True) == RejectionResult(2, -1)
    p3 = np.vstack([p, np.eye(V)[7]])
    assert verify_sampled([3, 4], None, p3, 5, 0) == RejectionResult(2, 7)
    assert verify_greedy([3, 4], np.log(p3 + 1e-9)) == RejectionResult(2, 7)
