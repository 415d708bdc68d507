"""common.sampling at its edges: the counter-based stream is exactly the documented Philox draw, sampling
accumulates in float64 whatever the input's precision, a no-mass row's top-k draft distribution, and the
error's message. test_sampling.py holds the processing semantics (HF warpers, the fast path vs the reference).
"""

from __future__ import annotations

import numpy as np
import pytest

from specdec_runtime.common.sampling import Stream, sample_from, draft_topk_from_probs, uniform


@pytest.mark.parametrize("seed, position, stream", [(0, 0, Stream.ACCEPT), (5, 7, Stream.TARGET_SAMPLE),
                                                    (2**64 - 1, 123456, Stream.DRAFT_SAMPLE), (2**64 + 9, 3, 0)])
def test_uniform_is_the_documented_philox_draw(seed, position, stream):
    """Philox-4x64 keyed by the seed (mod 2**64), counter (position, stream, 0, 0): the first double of that
    generator. Edge and verifier must agree on this bit for bit (a resumed session redraws the same values)."""
    expected = np.random.Generator(np.random.Philox(key=seed % 2**64, counter=[position, int(stream), 0, 0])).random()
    assert uniform(seed, position, stream) == expected
    assert 0.0 <= expected < 1.0


def test_sample_from_accumulates_in_float64():
    """float32 probabilities (the wire's q) are summed in float64: many tiny masses after a large one are not
    rounded away (a float32 running sum would stay at 1.0 and never reach them)."""
    probs = np.asarray([1.0] + [1e-8] * 2000, dtype=np.float32)
    total = float(np.sum(probs, dtype=np.float64))
    u = 0.99999995  # lands among the tiny masses: u * total > 1.0
    assert u * total > 1.0
    idx = sample_from(probs, u)
    assert idx > 0
    cum = np.cumsum(probs, dtype=np.float64)
    assert idx == int(np.searchsorted(cum, u * total, side="right"))


def test_sample_from_without_mass_message():
    with pytest.raises(ValueError, match="^cannot sample from a distribution with no mass$"):
        sample_from(np.zeros(4), 0.5)


def test_draft_topk_from_probs_of_a_row_without_mass():
    """No token of positive probability: the argmax (id 0 of an all-zero row) with probability NaN, as the
    full sort gave; the types are the wire's (int64 ids, float32 probs)."""
    with np.errstate(invalid="ignore"):  # 0 / 0: the NaN
        ids, probs = draft_topk_from_probs(np.zeros(6), 3)
    assert ids.tolist() == [0] and ids.dtype == np.int64
    assert probs.shape == (1,) and np.isnan(probs[0]) and probs.dtype == np.float32
    with np.errstate(invalid="ignore"):
        ids, probs = draft_topk_from_probs(np.asarray([0.0, 0.0, -0.0, 0.0, 0.0]), 2)
    assert ids.tolist() == [0]
    ids, probs = draft_topk_from_probs(np.asarray([0.0, 0.0, 1.0, 0.0]), 3)  # one token of mass
    assert ids.tolist() == [2] and probs.tolist() == [1.0]


VOCAB_FAST = 200  # > 2 x 64 first candidates: the fast path runs (smaller vocabularies go to the full sort)
TOL = 8 * (VOCAB_FAST + 16) * 2.0**-53  # the fast path's rounding band at this vocabulary size


@pytest.mark.parametrize("top_p", [0.5 + 2.0**-50, 0.5 + TOL], ids=["inside-the-band", "on-the-band-edge"])
def test_top_p_boundary_within_rounding_at_the_second_most_likely_token(top_p):
    """Dyadic probabilities 0.5, 0.25, 0.125, 0.125 (and zeros): the ascending cumulative mass at the second most
    likely token is exactly 0.5, just above 1 - top_p, so the reference keeps it. The fast path's estimate there
    lies within its rounding band around the boundary (first case), or exactly on the band's upper edge (second
    case: 1 - top_p + tol == 0.5): either way the row must go to the reference, not be decided by the estimate."""
    from specdec_runtime.common.top_p import top_p_drop_reference, top_p_keep

    probs = np.zeros((1, VOCAB_FAST))
    probs[0, [7, 3, 11, 150]] = [0.5, 0.25, 0.125, 0.125]
    expected = ~top_p_drop_reference(probs, top_p)
    assert np.flatnonzero(expected[0]).tolist() == [3, 7]
    assert top_p_keep(probs, top_p).tolist() == expected.tolist()
