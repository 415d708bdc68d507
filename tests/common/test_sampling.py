"""common.sampling: logits processing against HF transformers' warpers, counter-based uniforms, inverse-CDF
sampling, sparse (top-k) draft distributions.

Reference for logits processing: transformers.generation.logits_process TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper applied in that order (HF generate's order), then softmax. The fast path
(logits_to_probs: partial selection for top-p, common.top_p) must equal the full-sort reference
(specdec.logits_reference.logits_to_probs_reference) bit for bit: same kept set, same float64 probabilities.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import specdec_runtime.common.top_p as top_p_module
from specdec_runtime.common.sampling import (
    Stream,
    dense_draft_probs,
    logits_to_probs,
    normalize_sparse,
    sample_from,
    draft_topk_from_probs,
    uniform,
)
from specdec_runtime.common.types import SamplingParams, SparseDraftProbs
from specdec.logits_reference import logits_to_probs_reference


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


def test_draft_topk_from_probs():
    probs = np.array([0.05, 0.4, 0.0, 0.1, 0.3, 0.15])
    ids, q = draft_topk_from_probs(probs, 3)
    assert ids.dtype == np.int64 and q.dtype == np.float32
    assert ids.tolist() == [1, 4, 5]  # most likely first
    np.testing.assert_allclose(q, np.array([0.4, 0.3, 0.15]) / 0.85, rtol=1e-6)
    assert abs(float(normalize_sparse(q).sum()) - 1.0) < 1e-12
    ids, q = draft_topk_from_probs(probs, 100)  # k past the support shrinks to the non-zero tokens
    assert sorted(ids.tolist()) == [0, 1, 3, 4, 5] and (q > 0).all()
    ids, q = draft_topk_from_probs(probs, 1)
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


# ------------------------------------------------------------------ fast logits processing vs the reference
# logits_to_probs selects top-p candidates by partial selection and must reproduce logits_to_probs_reference
# (full stable argsort) bit for bit, ties and rounding included: the edge and the verifier must keep identical
# sets. top_p_drop_reference is the fast path's fallback (the only full sort left); counting the rows it gets
# shows which inputs the fast path decides itself.

LM_VOCAB = 49152  # SmolLM2's vocabulary


def assert_same_as_reference(logits, params: SamplingParams, valid_vocab_size=None) -> np.ndarray:
    fast = logits_to_probs(logits, params, valid_vocab_size)
    ref = logits_to_probs_reference(logits, params, valid_vocab_size)
    assert fast.shape == ref.shape and fast.dtype == ref.dtype == np.float64
    np.testing.assert_array_equal(fast > 0, ref > 0)  # the kept set, token for token (readable diff first)
    np.testing.assert_array_equal(fast.view(np.uint64), ref.view(np.uint64))  # every bit (-0.0 and NaN too)
    return fast


def lm_like_logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:  # [rows, vocab] float32
    """Peaked like SmolLM2's logits: Gaussian body (σ 3.5), top token ~22 above it, a head of 32 tokens."""
    logits = rng.normal(0.0, 3.5, size=(rows, vocab))
    head = min(32, vocab)
    for row in logits:
        ids = rng.choice(vocab, size=head, replace=False)
        gaps = np.concatenate([[0.0], rng.exponential(0.6, size=head - 1)])
        gaps[1] += rng.uniform(0.0, 3.0)
        row[ids] = 22.0 + rng.normal() - np.cumsum(gaps)
    return logits.astype(np.float32)


@pytest.fixture
def reference_rows(monkeypatch):
    """Counts the rows the fast path hands to the reference's full sort (list of row counts per call)."""
    calls: list[int] = []
    original = top_p_module.top_p_drop_reference

    def counting(probs, top_p):
        calls.append(len(probs))
        return original(probs, top_p)

    monkeypatch.setattr(top_p_module, "top_p_drop_reference", counting)
    return calls


SETTINGS = [  # (temperature, top_k, top_p); top_k None = vocab + 3 (>= vocab: off)
    (0.7, 0, 0.9),
    (0.7, 0, 0.95),
    (0.7, 50, 1.0),
    (0.7, 50, 0.9),
    (1.0, 0, 1.0),
    (1.0, 1, 0.9),  # top_k 1
    (1.0, None, 0.9),  # top_k >= vocab
    (1.0, 0, 1e-6),  # top_p near 0: only the most likely token
    (1.0, 0, 1e-17),  # 1 - top_p rounds to 1.0: everything but the forced most likely token is dropped
    (0.7, 0, 0.999999),  # top_p near 1: wide nuclei, widening
    (0.7, 0, 0.5),
    (1e-4, 0, 0.9),  # near-greedy: one or few tokens of non-zero probability
    (1e4, 0, 0.9),  # near-uniform: the nucleus is most of the vocabulary
    (1e4, 0, 0.999999),
]


@pytest.mark.parametrize("vocab", [2, 7, 50, 1000, LM_VOCAB])
@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_fast_path_equals_reference_fixed_seeds(vocab, temperature, top_k, top_p):
    rng = np.random.default_rng([vocab, int(temperature * 1e4), top_k or 0, int(top_p * 1e6)])
    logits = lm_like_logits(rng, 5, vocab)
    if vocab >= 7:
        logits[0, rng.choice(vocab, size=vocab // 3, replace=False)] = -np.inf  # masked tokens
        logits[1, 1:] = -np.inf  # one finite token
    params = SamplingParams(temperature=temperature, top_k=vocab + 3 if top_k is None else top_k, top_p=top_p)
    probs = assert_same_as_reference(logits, params)
    if vocab >= 7:
        assert_same_as_reference(logits, params, valid_vocab_size=vocab - 3)
    if top_p == 1e-6 or top_p == 1e-17 or top_k == 1:
        assert ((probs > 0).sum(axis=-1) == 1).all()


@pytest.mark.parametrize("first_candidates", [1, 2, 3, 64])
@pytest.mark.parametrize("vocab", [10, 100, 5000])
def test_fast_path_equals_reference_with_exact_ties(monkeypatch, first_candidates, vocab):
    """Logits on a coarse grid: every probability is shared by many tokens, so tied blocks straddle the top-k
    boundary, the top-p boundary and the edge of argpartition's candidate set (small first_candidates force
    splits of tied blocks and widening)."""
    monkeypatch.setattr(top_p_module, "_TOP_P_FIRST_CANDIDATES", first_candidates)
    rng = np.random.default_rng(vocab * 10 + first_candidates)
    for step in (1.0, 0.5, 0.25):
        logits = (rng.integers(-6, 3, size=(6, vocab)) * step).astype(np.float32)
        logits[0] = 0.0  # one tied block: the boundary falls inside it
        logits[1, : vocab // 2] = 1.0  # two tied blocks
        logits[2, rng.choice(vocab, size=vocab // 4, replace=False)] = -np.inf
        for temperature in (0.5, 1.0, 2.0):
            for top_k in (0, 1, 2, 3, vocab // 3, vocab - 1, vocab):
                for top_p in (1e-6, 0.1, 0.25, 0.3, 0.5, 0.75, 0.9, 0.999999, 1.0):
                    assert_same_as_reference(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))


def test_top_p_tie_rule_drops_lower_ids_first():
    """Equal probabilities on the top-p boundary: the higher ids are kept (stable ascending sort, prefix dropped)."""
    logits = np.zeros((1, 4), dtype=np.float32)  # each 0.25 exactly

    def kept(top_p):
        return np.flatnonzero(logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))[0]).tolist()

    assert kept(0.5) == [2, 3]  # cum 0.25, 0.5 <= 0.5: dropped (the boundary token itself goes)
    assert kept(0.6) == [1, 2, 3]  # cum 0.5 > 0.4: kept
    assert kept(0.75) == [1, 2, 3]
    assert kept(0.76) == [0, 1, 2, 3]
    assert kept(0.25) == [3]


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.62])
def test_top_p_tie_rule_in_a_full_vocabulary(reference_rows, top_p):
    """A head token and a block of 100 tied tokens, the rest ~0; the top-p boundary falls inside the block:
    exactly the highest-id tied tokens are kept, as in the reference, and by the fast path itself (the first
    64 candidates split the block arbitrarily, the widened 512 hold it all)."""
    rng = np.random.default_rng(3)
    logits = np.full((2, LM_VOCAB), -30.0, dtype=np.float32)
    logits[:, rng.choice(LM_VOCAB, size=LM_VOCAB // 2, replace=False)] = -31.0
    tied = np.sort(rng.choice(LM_VOCAB, size=101, replace=False))
    head, tied = tied[50], np.delete(tied, 50)
    logits[:, head] = 2.0
    logits[:, tied] = 0.0
    params = SamplingParams(temperature=1.0, top_p=top_p)
    probs = assert_same_as_reference(logits, params)
    kept = np.flatnonzero(probs[0])
    n_tied = len(kept) - 1  # the head is kept, and some of the block
    assert probs[0, head] > 0 and 0 < n_tied < 100
    np.testing.assert_array_equal(kept, np.sort(np.append(tied[100 - n_tied :], head)))  # the highest ids
    mass_head = np.exp(2.0) / (np.exp(2.0) + 100)  # the nucleus: the fewest tokens reaching top_p, + 1e-7 slack
    assert mass_head + (n_tied - 1) * (1 - mass_head) / 100 < top_p + 1e-7
    assert mass_head + n_tied * (1 - mass_head) / 100 >= top_p - 1e-7
    assert reference_rows == []


def test_boundary_decided_by_rounding_goes_to_the_reference(reference_rows):
    """Eight tokens of probability 1/8 and top_p 0.5: the cumulative mass hits 1 - top_p exactly, so only the
    reference's own rounding can decide; the fast path must hand that row over and still match."""
    logits = np.full((1, 1000), -np.inf, dtype=np.float32)
    logits[0, 100:108] = 0.0
    probs = assert_same_as_reference(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert np.flatnonzero(probs[0]).tolist() == [104, 105, 106, 107]
    assert reference_rows == [1]


def test_boundary_within_the_reference_rounding_drift(reference_rows):
    """Adversarial rounding: 49,151 equal tiny probabilities whose low bits make every addition of the
    reference's sequential cumsum round up (it ends ~9e-13 above the exact mass), and 1 - top_p placed between
    the exact mass and that float cum. Only the reference's rounding decides (it keeps the last tiny token too);
    a fast path with a tolerance under the drift decides from the exact mass and drops it."""
    n_tiny = LM_VOCAB - 1
    t = 2.0**-16 * (1 + 24585 * 2.0**-52)
    probs = np.full((1, LM_VOCAB), t)
    probs[0, 1234] = 1.0 - n_tiny * t  # the head
    cum = float(np.cumsum(np.full(n_tiny, t))[-1])  # the reference's cum at the last tiny token (id vocab - 1)
    assert float(Fraction(cum) - Fraction(t) * n_tiny) > 8e-13  # the drift this test is about
    thresh = cum - 1e-13
    top_p = 1.0 - thresh
    assert 1.0 - top_p == thresh
    drop = top_p_module.top_p_drop_reference(probs, top_p)
    assert np.flatnonzero(~drop[0]).tolist() == [1234, LM_VOCAB - 1]  # the head and the highest-id tiny token
    np.testing.assert_array_equal(top_p_module.top_p_keep(probs, top_p), ~drop)
    assert reference_rows == [1, 1]  # the check above, and the fast path's hand-over


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 0.9), (0.7, 0, 0.95), (1.0, 0, 0.9), (0.7, 50, 0.9)])
def test_no_full_sort_for_lm_like_logits(reference_rows, temperature, top_k, top_p):
    """The point of the fast path: realistic rows (a 49,152-token vocabulary, nuclei of a few to a few hundred
    tokens) are decided by partial selection; none reaches the full sort."""
    logits = lm_like_logits(np.random.default_rng(11), 9, LM_VOCAB)
    assert_same_as_reference(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert reference_rows == []


@pytest.mark.parametrize("first_candidates", [1, 4, 64])
def test_widening_until_the_nucleus_is_covered(monkeypatch, reference_rows, first_candidates):
    """Nuclei wider than the first candidate set (flat heads, top_p near 1) are found by widening, not sorting."""
    monkeypatch.setattr(top_p_module, "_TOP_P_FIRST_CANDIDATES", first_candidates)
    rng = np.random.default_rng(first_candidates)
    logits = lm_like_logits(rng, 4, LM_VOCAB)
    logits[1] = rng.normal(0.0, 3.5, size=LM_VOCAB)  # no head: nuclei of ~30 (top_p 0.5) and ~900 tokens (0.9)
    for top_p in (0.5, 0.9):
        assert_same_as_reference(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert reference_rows == []
    assert_same_as_reference(logits, SamplingParams(temperature=1.0, top_p=0.99))  # ~7000 tokens: maybe sorted


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 0.9), (0.7, 50, 0.95), (1.0, 0, 0.999999)])
def test_a_row_alone_equals_the_same_row_in_a_block(temperature, top_k, top_p):
    """The edge processes one row per draft token, the verifier a [γ + 1, vocab] block: same bits per row."""
    logits = lm_like_logits(np.random.default_rng(5), 9, LM_VOCAB)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    block = logits_to_probs(logits, params)
    for i in range(len(logits)):
        np.testing.assert_array_equal(logits_to_probs(logits[i], params)[0].view(np.uint64), block[i].view(np.uint64))


def test_exp64_is_element_for_element():
    """exp64 (torch's vectorised exp): a value does not depend on the array's size, offset, layout or thread
    count (vector body vs scalar tail), and is within an ulp of numpy's libm exp."""
    import torch

    from specdec_runtime.common.logits import exp64

    x = np.random.default_rng(8).normal(-20.0, 15.0, size=(5, 4099))  # odd width: tails in every row
    x[0, :7] = [0.0, -745.2, -746.0, 709.0, -np.inf, 1e-300, -1e-300]  # underflow, overflow edge, -inf
    full = exp64(x)
    np.testing.assert_allclose(full, np.exp(x), rtol=4e-16, atol=0)
    flat = x.ravel()
    for offset, size in ((0, 1), (3, 5), (7, 17), (1, 4099), (4098, 4100), (13, 9000)):
        np.testing.assert_array_equal(exp64(flat[offset:offset + size].copy()).view(np.uint64),
                                      full.ravel()[offset:offset + size].view(np.uint64))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        np.testing.assert_array_equal(exp64(x).view(np.uint64), full.view(np.uint64))
    finally:
        torch.set_num_threads(threads)
    out = x.copy()
    assert exp64(out, out=out) is out
    np.testing.assert_array_equal(out.view(np.uint64), full.view(np.uint64))


def test_memory_layout_does_not_change_the_result():
    logits = lm_like_logits(np.random.default_rng(6), 5, 3000)
    params = SamplingParams(temperature=0.8, top_k=0, top_p=0.9)
    expected = assert_same_as_reference(logits, params)
    transposed = np.asfortranarray(logits)  # same values, column-major
    strided = np.repeat(logits, 2, axis=1)[:, ::2]  # same values, non-contiguous rows
    for variant in (transposed, strided, logits.astype(np.float64)):
        np.testing.assert_array_equal(logits_to_probs(variant, params).view(np.uint64), expected.view(np.uint64))
        assert_same_as_reference(variant, params)


_TEMPERATURES = st.sampled_from([1e-4, 0.1, 0.7, 1.0, 3.0, 1e4]) | st.floats(0.05, 20.0)
_TOP_PS = st.sampled_from([1e-17, 1e-6, 0.1, 0.5, 0.9, 0.95, 0.999999, 1.0]) | st.floats(1e-6, 1.0)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fast_path_equals_reference_property(data):
    """Small vocabularies, ties on a grid, -inf, any params, any candidate-set size: bit for bit."""
    vocab = data.draw(st.integers(1, 300), label="vocab")
    rows = data.draw(st.integers(1, 5), label="rows")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    scale = data.draw(st.sampled_from([0.01, 1.0, 3.0, 30.0]), label="scale")
    logits = rng.normal(0.0, scale, size=(rows, vocab))
    grid = data.draw(st.sampled_from([None, 1.0, 0.25]), label="grid")  # None: no exact ties (continuous)
    if grid is not None:
        logits = np.round(logits / (grid * scale)) * grid
    logits[rng.random((rows, vocab)) < data.draw(st.sampled_from([0.0, 0.2, 0.95]), label="inf_frac")] = -np.inf
    params = SamplingParams(
        temperature=data.draw(_TEMPERATURES, label="temperature"),
        top_k=data.draw(st.integers(0, vocab + 2), label="top_k"),
        top_p=data.draw(_TOP_PS, label="top_p"),
    )
    valid = data.draw(st.none() | st.integers(1, vocab), label="valid_vocab_size")
    first = data.draw(st.sampled_from([1, 2, 3, 8, 64]), label="first_candidates")
    original = top_p_module._TOP_P_FIRST_CANDIDATES
    top_p_module._TOP_P_FIRST_CANDIDATES = first
    try:
        with np.errstate(invalid="ignore"):  # all -inf rows give NaN in both implementations
            assert_same_as_reference(logits.astype(np.float32), params, valid)
    finally:
        top_p_module._TOP_P_FIRST_CANDIDATES = original


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    temperature=_TEMPERATURES,
    top_k=st.sampled_from([0, 0, 1, 20, 50, 1000, LM_VOCAB]),
    top_p=_TOP_PS,
    rows=st.integers(1, 9),
)
def test_fast_path_equals_reference_property_full_vocabulary(seed, temperature, top_k, top_p, rows):
    logits = lm_like_logits(np.random.default_rng(seed), rows, LM_VOCAB)
    assert_same_as_reference(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))


def test_rows_with_different_supports_in_one_block(reference_rows):
    """A verifier block whose rows keep different numbers of tokens (top-k ties, -inf logits, underflow): the
    rows are selected together, short rows padded; each row equals the reference and its own edge call."""
    rng = np.random.default_rng(9)
    logits = np.full((4, LM_VOCAB), -np.inf, dtype=np.float32)
    for row, support in enumerate((1, 3, 10, 40)):
        logits[row, rng.choice(LM_VOCAB, size=support, replace=False)] = rng.normal(0.0, 2.0, size=support)
    for top_p in (0.3, 0.5, 0.9, 0.999):
        params = SamplingParams(temperature=1.0, top_p=top_p)
        block = assert_same_as_reference(logits, params)
        for i in range(len(logits)):
            alone = logits_to_probs(logits[i], params)[0]
            np.testing.assert_array_equal(alone.view(np.uint64), block[i].view(np.uint64))
    lm = lm_like_logits(rng, 3, LM_VOCAB)
    assert_same_as_reference(lm, SamplingParams(temperature=1.0, top_k=20, top_p=0.9))
    lm[1, :37] = lm[1].max() + 1.0  # 37 tied tokens at the top: top-k 20 keeps all of them, top-p 0.9 34
    probs = assert_same_as_reference(lm, SamplingParams(temperature=1.0, top_k=20, top_p=0.9))
    assert np.flatnonzero(probs[1]).tolist() == list(range(3, 37))  # the highest ids of the tied block
    assert reference_rows == []


def _topk_draft_reference(probs: np.ndarray, k: int) -> list[int]:
    """The spec of draft_topk_from_probs's ids: a full stable sort by descending probability (ties: ascending
    id), the first k of the tokens with positive probability."""
    order = np.lexsort((np.arange(len(probs)), -probs))
    return [int(i) for i in order[: max(1, min(k, int((probs > 0).sum())))]]


def test_draft_topk_from_probs_tie_rule():
    probs = np.array([0.1, 0.2, 0.2, 0.0, 0.2, 0.3])
    assert draft_topk_from_probs(probs, 2)[0].tolist() == [5, 1]  # of the tied 0.2, the lowest id
    assert draft_topk_from_probs(probs, 3)[0].tolist() == [5, 1, 2]
    assert draft_topk_from_probs(probs, 4)[0].tolist() == [5, 1, 2, 4]
    assert draft_topk_from_probs(probs, 6)[0].tolist() == [5, 1, 2, 4, 0]  # zero-probability ids dropped


@pytest.mark.parametrize("vocab", [8, 300, LM_VOCAB])
def test_draft_topk_from_probs_equals_a_full_sort(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(20):
        logits = np.round(rng.normal(0.0, 2.0, size=(1, vocab)) * 2) / 2  # a grid: ties
        params = SamplingParams(
            temperature=float(rng.choice([0.5, 1.0])),
            top_k=int(rng.choice([0, 5, 50])),
            top_p=float(rng.choice([0.5, 0.9, 1.0])),
        )
        probs = logits_to_probs(logits, params)[0]
        for k in (1, 4, 8, 64):
            ids, q = draft_topk_from_probs(probs, k)
            assert ids.tolist() == _topk_draft_reference(probs, k)
            np.testing.assert_array_equal(q, (probs[ids] / probs[ids].sum()).astype(np.float32))
