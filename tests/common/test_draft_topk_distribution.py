"""``draft_topk_distribution`` (the edge's top-k drafting q straight from raw logits) against the reference
composition ``draft_topk_from_probs(logits_to_probs(...))``: the same token ids in the same order, q equal up
to float rounding, on random logits with ties, -inf, tiny and huge temperatures, top-k, top-p near 0 and 1,
and a padded vocabulary. Breaking its tie rule (lowest ids first at the top-p boundary instead of the
reference's highest) or its top-p test (<= instead of <) fails ``test_matches_the_reference``."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_runtime.common.sampling import draft_topk_distribution, logits_to_probs, draft_topk_from_probs
from specdec_runtime.common.types import SamplingParams

VOCAB = 4096


def _logits(rng: np.random.Generator, kind: int) -> np.ndarray:  # [VOCAB] float32
    if kind == 0:
        return rng.normal(0, 3, VOCAB).astype(np.float32)
    if kind == 1:  # heavy tail
        return (rng.standard_t(2, VOCAB) * 4).astype(np.float32)
    if kind == 2:  # many exact ties
        return np.round(rng.normal(0, 2, VOCAB)).astype(np.float32)
    if kind == 3:  # nearly flat
        return rng.normal(0, 0.01, VOCAB).astype(np.float32)
    if kind == 4:  # a few tokens tied at the top
        x = rng.normal(0, 3, VOCAB).astype(np.float32)
        x[rng.choice(VOCAB, 5, replace=False)] = 20.0
        return x
    x = rng.normal(0, 3, VOCAB).astype(np.float32)  # masked columns
    x[rng.choice(VOCAB, 100, replace=False)] = -np.inf
    return x


CASES = [(kind, t, top_k, top_p, k, valid)
         for kind in range(6)
         for t, top_k, top_p, k, valid in [
             (0.7, 0, 0.9, 8, None), (1.0, 0, 1.0, 8, VOCAB - 52), (1e-4, 0, 0.9, 8, None),
             (3.0, 0, 0.95, 4, None), (0.7, 5, 1.0, 8, None), (0.7, 50, 0.9, 16, VOCAB - 7),
             (1.0, 3, 0.5, 8, None), (0.05, 0, 1e-3, 8, None), (2.0, 0, 0.999, 1, None), (0.7, 8, 0.9, 8, None),
         ]]


@pytest.mark.parametrize("kind,temperature,top_k,top_p,k,valid", CASES)
def test_matches_the_reference(kind, temperature, top_k, top_p, k, valid):
    rng = np.random.default_rng(1000 * kind + int(temperature * 100) + top_k + k)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    for _ in range(5):
        logits = _logits(rng, kind)
        ref_ids, ref_q = draft_topk_from_probs(logits_to_probs(logits[None], params, valid)[0], k)
        ids, q = draft_topk_distribution(logits, params, k, valid)
        assert ids.dtype == np.int64 and q.dtype == np.float32
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_allclose(q, ref_q, rtol=1e-6, atol=1e-9)
        assert q[0] > 0 and (q >= 0).all() and abs(float(q.sum()) - 1.0) < 1e-5  # float32 may underflow to 0


def test_top_p_boundary_ties_keep_the_highest_ids():
    """Five tokens tied at the top, each 1/5 of the mass after top-k 5: top-p 0.5 keeps three of them, the
    reference's rule keeps the three highest ids; q (k = 2) then takes the two lowest of those."""
    logits = np.full(VOCAB, -1e4, dtype=np.float32)
    tied = np.array([7, 100, 2000, 3000, 4000])
    logits[tied] = 5.0
    params = SamplingParams(temperature=1.0, top_k=5, top_p=0.5)
    ids, q = draft_topk_distribution(logits, params, 2)
    assert ids.tolist() == [2000, 3000]
    np.testing.assert_allclose(q, [0.5, 0.5])


def test_non_finite_rows_and_greedy_follow_the_reference():
    logits = np.random.default_rng(0).normal(0, 1, VOCAB).astype(np.float32)
    bad = logits.copy()
    bad[3] = np.nan
    for row, params in ((bad, SamplingParams(temperature=0.7)), (logits, SamplingParams(temperature=0.0))):
        ref_ids, ref_q = draft_topk_from_probs(logits_to_probs(row[None], params)[0], 8)
        ids, q = draft_topk_distribution(row, params, 8)
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_array_equal(q, ref_q)
    with pytest.raises(ValueError):
        draft_topk_distribution(logits[None], SamplingParams(temperature=0.7), 8)


def test_top_p_drops_a_token_whose_preceding_mass_equals_top_p():
    """Four tied tokens of exactly 1/4 after top-k 4: with top-p 0.5 the reference drops the two whose ascending
    cumulative mass is <= 0.5 (1/4, 2/4, exact in binary): two are kept, not three."""
    logits = np.full(VOCAB, -1e4, dtype=np.float32)
    logits[[10, 20, 30, 40]] = 1.0
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.5)
    ref_ids, _ = draft_topk_from_probs(logits_to_probs(logits[None], params)[0], 4)
    ids, q = draft_topk_distribution(logits, params, 4)
    assert ids.tolist() == ref_ids.tolist() == [30, 40]
    np.testing.assert_array_equal(q, [0.5, 0.5])
