"""common.sampling: logits processing against HF transformers' warpers, counter-based uniforms, inverse-CDF
sampling, sparse (top-k) draft distributions.

Reference for logits processing: transformers.generation.logits_process TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper applied in that order (HF generate's order), then softmax.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from common.sampling import (
    Stream,
    dense_draft_probs,
    logits_to_probs,
    normalize_sparse,
    sample_from,
    topk_draft_distribution,
    uniform,
)
from common.types import SamplingParams, SparseDraftProbs


def hf_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """[n, vocab] float64 probabilities from HF's warpers (float64 scores), then softmax."""
    scores = torch.from_numpy(np.asarray(logits, dtype=np.float64))
    input_ids = torch.zeros((scores.shape[0], 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(input_ids, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(input_ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(input_ids, scores)
    return torch.softmax(scores, dim=-1).numpy()


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, 0, 1.0),
        (0.7, 0, 1.0),
        (1.5, 5, 1.0),
        (1.0, 0, 0.9),
        (0.8, 10, 0.8),
        (0.5, 3, 0.5),
        (2.0, 0, 0.3),
        (1.0, 64, 0.95),  # top_k >= vocab: off
        (1.0, 1, 1.0),
    ],
)
def test_logits_to_probs_matches_hf_warpers(temperature, top_k, top_p):
    rng = np.random.default_rng(int(temperature * 100) + top_k * 7 + int(top_p * 1000))
    logits = (rng.normal(size=(32, 50)) * 3).astype(np.float32)
    ours = logits_to_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    ref = hf_probs(logits, temperature, top_k, top_p)
    assert ours.shape == (32, 50) and ours.dtype == np.float64
    np.testing.assert_array_equal(ours == 0, ref == 0)  # same kept set, token for token
    np.testing.assert_allclose(ours, ref, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(ours.sum(axis=-1), 1.0, rtol=0, atol=1e-12)
    if top_k == 5 or top_p <= 0.5:
        assert ((ours > 0).sum(axis=-1) < 50).all()  # the filter actually removed tokens


def test_top_k_keeps_ties_at_the_kth_value_like_hf():
    logits = np.array([[3.0, 1.0, 2.0, 2.0, 2.0, 0.5]], dtype=np.float32)
    ours = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (ours[0] > 0).tolist() == [True, False, True, True, True, False]
    np.testing.assert_allclose(ours, hf_probs(logits, 1.0, 2, 1.0), atol=1e-12)


def test_greedy_is_one_hot_argmax():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(6, 40)).astype(np.float32)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0, top_k=3, top_p=0.5))
    expected = np.zeros((6, 40))
    expected[np.arange(6), logits.argmax(axis=-1)] = 1.0
    np.testing.assert_array_equal(probs, expected)
    one = logits_to_probs(logits[0], SamplingParams())  # a 1-D row gives [1, vocab]
    assert one.shape == (1, 40) and one[0, logits[0].argmax()] == 1.0


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_k=4, top_p=0.9)])
def test_valid_vocab_size_masks_padded_columns(params):
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(4, 24)).astype(np.float32)
    logits[:, 20:] = 50.0  # padded embedding rows with the largest logits must never win
    probs = logits_to_probs(logits, params, valid_vocab_size=20)
    assert (probs[:, 20:] == 0).all()
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, atol=1e-12)
    ref = logits_to_probs(logits[:, :20], params)
    np.testing.assert_allclose(probs[:, :20], ref, atol=1e-12)
    assert (logits[:, 20:] == 50.0).all()  # the caller's array is not modified


def test_uniform_is_deterministic_in_range_and_keyed():
    a = uniform(7, 100, Stream.ACCEPT)
    assert a == uniform(7, 100, Stream.ACCEPT)
    assert 0.0 <= a < 1.0
    others = {
        uniform(8, 100, Stream.ACCEPT),
        uniform(7, 101, Stream.ACCEPT),
        uniform(7, 100, Stream.TARGET_SAMPLE),
        uniform(7, 100, Stream.DRAFT_SAMPLE),
    }
    assert a not in others and len(others) == 4
    assert 0.0 <= uniform(2**64 - 1, 2**40, Stream.DRAFT_SAMPLE) < 1.0


def test_uniform_draws_look_uniform_and_independent():
    n = 2000
    acc = np.array([uniform(123, pos, Stream.ACCEPT) for pos in range(n)])
    tgt = np.array([uniform(123, pos, Stream.TARGET_SAMPLE) for pos in range(n)])
    seeds = np.array([uniform(s, 0, Stream.ACCEPT) for s in range(n)])
    for draws in (acc, tgt, seeds):
        assert len(set(draws.tolist())) == n
        assert abs(draws.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n)
        hist = np.bincount((draws * 10).astype(int), minlength=10)
        assert ((hist - n / 10) ** 2 / (n / 10)).sum() < 33.7  # chi-square(9) at 1e-4
    assert abs(np.corrcoef(acc, tgt)[0, 1]) < 5 / math.sqrt(n)  # streams uncorrelated at equal positions
    assert abs(np.corrcoef(acc[:-1], acc[1:])[0, 1]) < 5 / math.sqrt(n)  # nor at neighbouring positions


def test_sample_from_inverse_cdf_and_never_zero_probability():
    probs = np.array([0.0, 0.2, 0.0, 0.3, 0.0, 0.5, 0.0])
    cases = {
        0.0: 1,
        0.1999: 1,
        0.2: 3,  # a boundary belongs to the next token with mass, never to the zero-mass one at 2
        0.4999: 3,
        0.5: 5,
        np.nextafter(1.0, 0.0): 5,  # top end with trailing zeros
    }
    for u, expected in cases.items():
        assert sample_from(probs, u) == expected, u
        assert sample_from(probs * 7.0, u) == expected, u  # unnormalized input
    rng = np.random.default_rng(5)
    for _ in range(300):
        p = rng.random(12) * (rng.random(12) < 0.4)
        if not p.any():
            continue
        for u in (0.0, rng.random(), np.nextafter(1.0, 0.0)):
            assert p[sample_from(p, u)] > 0


def test_sample_from_frequencies_follow_probs():
    probs = np.array([0.1, 0.0, 0.45, 0.25, 0.2])
    n = 1000
    counts = np.bincount([sample_from(probs, (i + 0.5) / n) for i in range(n)], minlength=5)
    np.testing.assert_allclose(counts, probs * n, atol=1)  # stratified u: exact up to one sample


def test_sample_from_raises_without_mass():
    with pytest.raises(ValueError):
        sample_from(np.zeros(4), 0.3)


def test_topk_draft_distribution():
    probs = np.array([0.05, 0.4, 0.0, 0.1, 0.3, 0.15])
    ids, q = topk_draft_distribution(probs, 3)
    assert ids.dtype == np.int64 and q.dtype == np.float32
    assert ids.tolist() == [1, 4, 5]  # most likely first
    np.testing.assert_allclose(q, np.array([0.4, 0.3, 0.15]) / 0.85, rtol=1e-6)
    assert abs(float(normalize_sparse(q).sum()) - 1.0) < 1e-12
    ids, q = topk_draft_distribution(probs, 100)  # k past the support shrinks to the non-zero tokens
    assert sorted(ids.tolist()) == [0, 1, 3, 4, 5] and (q > 0).all()
    ids, q = topk_draft_distribution(probs, 1)
    assert ids.tolist() == [1] and q.tolist() == [1.0]


def test_dense_draft_probs_and_normalize_sparse():
    q_greedy = dense_draft_probs([3, 1], None, 1, 6)
    assert q_greedy.tolist() == [0, 1, 0, 0, 0, 0]
    wire = np.array([[0.7, 0.2, 0.1000001], [0.5, 0.5, 0.0]], dtype=np.float32)  # not summing to 1 exactly
    sparse = SparseDraftProbs(np.array([[4, 0, 2], [1, 5, 3]], dtype=np.int64), wire)
    q = dense_draft_probs([4, 1], sparse, 0, 6)
    assert q.dtype == np.float64 and abs(q.sum() - 1.0) < 1e-15
    np.testing.assert_allclose(q[[4, 0, 2]], wire[0] / wire[0].sum(dtype=np.float64), rtol=1e-15)
    assert q[[1, 3, 5]].tolist() == [0, 0, 0]
    wire64 = wire.astype(np.float64)
    np.testing.assert_array_equal(normalize_sparse(wire), wire64 / wire64.sum(axis=1, keepdims=True))
