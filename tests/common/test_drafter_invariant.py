"""The drafter-invariant rule (common.rejection; Daliri, Musco & Suresh 2024): a verdict's tokens are the target's
own draws (what a cloud decode of the session commits: an empty block's verdict) whatever was drafted, in the numpy
reference (numerics.verify_row) and the batched sampler (numerics.verify_rows) alike; the own draw follows p (χ²);
and the draft's coupled draw (common.sampling.draft_token) is the target's own draw when its q is the target's p.
Negative controls: Algorithm 1 on the same rows, a draw from another distribution, the draft's own stream."""

from __future__ import annotations

import dataclasses

import numpy as np

from specdec_runtime.cloud_verifier.verdict.numerics import verify_row, verify_rows
from specdec_runtime.common.rejection import verify_sampled
from specdec_runtime.common.sampling import draft_token, logits_to_probs
from specdec_runtime.common.types import NO_TOKEN, DraftBlock, SamplingParams, SparseDraftProbs

V = 512  # vocabulary
PARAMS = [SamplingParams(temperature=1.0, top_k=8, drafter_invariant=True),
          SamplingParams(temperature=0.7, top_p=0.9, drafter_invariant=True),
          SamplingParams(temperature=1.3, drafter_invariant=True),  # wide: the batched dense path
          SamplingParams(temperature=0.9, top_k=100, min_p=0.02, drafter_invariant=True)]


def _logits(rng, n):
    x = rng.standard_normal((n, V)) * 2.0
    for i in range(n):
        x[i, rng.choice(V, 6, replace=False)] += rng.uniform(3.0, 8.0, 6)
    return x.astype(np.float32)


def _row(rng, sampling):
    """(block, logits [positions, V], seed, start): 1-5 draft tokens, top-k drafted, classic or bonus_drafted:
    the target's own draws up to a random position (a well-coupled draft), then likely tokens."""
    gamma = int(rng.integers(1, 6))
    bonus_drafted = bool(rng.integers(0, 2))
    logits = _logits(rng, gamma if bonus_drafted else gamma + 1)
    seed, start = int(rng.integers(0, 2**63)), int(rng.integers(1, 4000))
    order = np.argsort(-logits, axis=-1, kind="stable")
    own, agree = _own_draws(logits, sampling, seed, start), int(rng.integers(0, gamma + 1))
    ids = [own[i] if i < agree else int(order[i, rng.integers(0, 3)]) for i in range(gamma)]
    token_ids = np.stack([np.concatenate([[ids[i]], np.setdiff1d(order[i, :8], [ids[i]])[:3]]) for i in range(gamma)])
    probs = rng.dirichlet(np.ones(4), gamma).astype(np.float32) + np.float32(1e-3)
    block = DraftBlock(ids, SparseDraftProbs(token_ids.astype(np.int64), probs), bonus_drafted=bonus_drafted)
    return block, logits, seed, start


def _own_draws(logits, sampling, seed, start):
    """Target-only sampling at each scored position: the one-token verdict of an empty block (cloud decode)."""
    p = logits_to_probs(logits, sampling, V)  # [positions, V]
    return [verify_sampled([], None, p[t:t + 1], seed, start + t, drafter_invariant=True).next_token_id
            for t in range(len(p))]


def _tokens(block, result):
    out = list(block.draft_token_ids[:result.num_accepted])
    return out + ([result.next_token_id] if result.next_token_id != NO_TOKEN else [])


def _corpus(n=400, seed=7):
    rng = np.random.default_rng(seed)
    return [(PARAMS[i % len(PARAMS)], *_row(rng, PARAMS[i % len(PARAMS)])) for i in range(n)]


def test_verdicts_are_the_targets_own_draws_in_reference_and_batched_paths():
    rows = _corpus()
    from specdec_runtime.cloud_verifier.verdict.sampler import VerifyRow

    batched = verify_rows([VerifyRow(b, lg, s.seeded(seed), st) for s, b, lg, seed, st in rows], V)
    accepted = 0
    for (s, block, logits, seed, start), got in zip(rows, batched):
        own = _own_draws(logits, s, seed, start)
        ref = verify_row(block, logits, s.seeded(seed), start, V)
        assert got == ref
        tokens = _tokens(block, ref)
        assert tokens == own[:len(tokens)]  # every committed token is the target's own draw there
        n = ref.num_accepted  # and the block stops at the first draft token that is not
        assert block.draft_token_ids[:n] == own[:n]
        assert n == len(block.draft_token_ids) or block.draft_token_ids[n] != own[n]
        accepted += n
    assert accepted > len(rows) // 2  # the corpus accepts tokens: the rule is exercised past position 0


def test_negative_control_algorithm_1_on_the_same_rows_is_not_drafter_invariant():
    differ = 0
    for s, block, logits, seed, start in _corpus(200):
        s1 = dataclasses.replace(s, drafter_invariant=False)
        tokens = _tokens(block, verify_row(block, logits, s1.seeded(seed), start, V))
        differ += tokens != _own_draws(logits, s, seed, start)[:len(tokens)]
    assert differ > 20


def test_the_drafts_coupled_draw_is_the_targets_when_q_is_p():
    """Draft logits equal to the target's and top_k within the draft's k: q = p, so the coupled draw is the
    target's own at every position (acceptance 1); the draft's own stream matches it far less often."""
    rng = np.random.default_rng(3)
    s = SamplingParams(temperature=1.0, top_k=5, seed=9, drafter_invariant=True)
    logits = _logits(rng, 300)
    own = _own_draws(logits, s, 9, 100)
    coupled = [draft_token(logits[t], s.seeded(9), 5, V, 100 + t)[0] for t in range(300)]
    assert coupled == own
    apart = dataclasses.replace(s, drafter_invariant=False)
    independent = [draft_token(logits[t], apart.seeded(9), 5, V, 100 + t)[0] for t in range(300)]
    assert sum(a == b for a, b in zip(independent, own)) < 0.8 * len(own)


def test_the_own_draw_follows_p_with_a_negative_control():
    """Gumbel-max over seeds: 20,000 sessions' draws at one position against p (χ², 7 degrees of freedom, p-value
    above 1e-4), and against p² renormalised (what a wrong noise would give: rejected)."""
    from scipy.stats import chisquare

    from specdec_runtime.common.rejection import own_draw

    p = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    counts = np.bincount([own_draw(p, seed, 17) for seed in range(20000)], minlength=len(p))
    assert chisquare(counts, p * counts.sum()).pvalue > 1e-4
    wrong = p**2 / (p**2).sum()
    assert chisquare(counts, wrong * counts.sum()).pvalue < 1e-4


def test_the_option_travels_on_the_wire_and_in_the_store_form():
    import json

    from specdec_runtime.common.wire import sampling_from_proto, sampling_to_proto

    for value in (None, True, False):  # None: the edge's route decides; the verifier reads it as off
        params = SamplingParams(temperature=0.5, seed=5, drafter_invariant=value)  # 0.5: exact in float32
        assert sampling_from_proto(sampling_to_proto(params)) == params
        assert SamplingParams(**json.loads(json.dumps(dataclasses.asdict(params)))) == params
