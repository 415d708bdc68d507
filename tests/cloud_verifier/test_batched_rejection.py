"""The batched verdict (cloud_verifier.verdict.sampler, numerics.verify_rows) against its numpy reference
(numerics.verify_row → common.rejection.verify_block), row for row, on a corpus of LM-like logits; the guards
(a faulty row never touches the others); the counter-based draws bit for bit; and the output distribution of
the batched path itself (total variation to p, with a negative control).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec_runtime.common.draws import uniform_many
from specdec_runtime.cloud_verifier.verdict.numerics import verify_row, verify_rows
from specdec_runtime.cloud_verifier.verdict.sampler import BatchedRejectionSampler, VerifyRow
from specdec_runtime.cloud_verifier.verdict.scan_native import available as native_available
from specdec_runtime.common.errors import TargetOutputError
from specdec_runtime.common.sampling import Stream, logits_to_probs, uniform
from specdec_runtime.common.types import DraftBlock, SamplingParams, SparseDraftProbs

V = 2048  # vocabulary of the corpus (the last 3 ids are padding: valid_vocab_size = V - 3)
VALID = V - 3

SAMPLED = [
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=20),
    SamplingParams(temperature=0.5, min_p=0.1),
    SamplingParams(temperature=1.3, top_k=100, top_p=0.8),
    SamplingParams(temperature=1.0, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=0.7, top_p=0.0),
    SamplingParams(temperature=2.0, top_p=0.99),  # wide nuclei: the dense path
    SamplingParams(temperature=0.9, top_k=80),  # k past the candidates: the dense path
]


def lm_like_logits(rng: np.random.Generator, n: int, vocab: int = V, ties: bool = False) -> np.ndarray:
    """[n, vocab] float32 logits with an LM's spread: a Gaussian body (σ 1-3) and a few tokens 4-14 above it
    (nuclei of 1 to a few hundred tokens at the temperatures above); ``ties``: rounded to 0.5 (many exact ties,
    at top-k and top-p boundaries too)."""
    x = rng.standard_normal((n, vocab)) * rng.uniform(1.0, 3.0, (n, 1))
    for i in range(n):
        peaks = rng.choice(vocab, int(rng.integers(1, 40)), replace=False)
        x[i, peaks] += rng.uniform(4.0, 14.0, len(peaks))
    if ties:
        x = np.round(x * 2) / 2
    return x.astype(np.float32)


def make_row(rng: np.random.Generator, sampling: SamplingParams, ties: bool = False) -> VerifyRow:
    """A block of 0-5 draft tokens (likely ones, sometimes padding ids), greedy or top-k drafted, classic or
    bonus_drafted, with its target logits."""
    gamma = int(rng.integers(0, 6))
    bonus_drafted = gamma > 0 and not sampling.greedy and bool(rng.integers(0, 2))
    n = gamma if bonus_drafted else gamma + 1
    logits = lm_like_logits(rng, n, ties=ties)
    order = np.argsort(-logits, axis=-1, kind="stable")
    ids = [int(order[i, rng.integers(0, 4)]) if rng.random() > 0.05 else VALID + 1 for i in range(gamma)]
    draft_probs = None
    if gamma and rng.random() < 0.6:  # top-k drafting: q over k ids including the draft token
        k = 6
        others = [rng.choice(np.setdiff1d(order[i, :40], [ids[i]]), k - 1, replace=False) for i in range(gamma)]
        token_ids = np.stack([np.concatenate([[ids[i]], others[i]]) for i in range(gamma)]).astype(np.int64)
        probs = rng.dirichlet(np.ones(k), gamma).astype(np.float32) + np.float32(1e-3)
        draft_probs = SparseDraftProbs(token_ids, probs)
    block = DraftBlock(ids, draft_probs, bonus_drafted=bonus_drafted)
    return VerifyRow(block, logits, sampling.seeded(int(rng.integers(0, 2**64, dtype=np.uint64))), int(rng.integers(1, 5000)))


def reference(row: VerifyRow, valid: int = VALID):
    try:
        return verify_row(row.block, row.logits, row.sampling, row.start_position, valid, "s")
    except TargetOutputError as e:
        return str(e)


def batched(rows: list[VerifyRow], valid: int = VALID) -> list:
    return [str(r) if isinstance(r, TargetOutputError) else r for r in verify_rows(rows, valid, ["s"] * len(rows))]


def test_draws_are_common_sampling_uniform_bit_for_bit():
    rng = np.random.default_rng(3)
    seeds = [int(s) for s in rng.integers(0, 2**64, 300, dtype=np.uint64)] + [0, 1, 2**64 - 1]
    positions = [int(p) for p in rng.integers(0, 10**7, len(seeds))]
    streams = [int(s) for s in rng.integers(0, 3, len(seeds))]
    got = uniform_many(seeds, positions, streams)
    want = [uniform(s, p, Stream(t)) for s, p, t in zip(seeds, positions, streams)]
    assert got.tolist() == want
    # a token id in the counter's third word (the Gumbel noise of drafter-invariant sessions): numpy's own
    token_ids = [int(x) for x in rng.integers(0, 200_000, len(seeds))]
    want = [float(np.random.Generator(np.random.Philox(key=s, counter=[p, t, x, 0])).random())
            for s, p, t, x in zip(seeds, positions, streams, token_ids)]
    assert uniform_many(np.asarray(seeds, dtype=np.uint64), positions, streams, token_ids).tolist() == want


def test_greedy_rows_token_identical_to_the_reference():
    """Greedy rows, ties included (logits rounded to 0.5: the lowest id wins), padding ids never chosen."""
    rng = np.random.default_rng(5)
    rows = [make_row(rng, SamplingParams(), ties=bool(i % 2)) for i in range(400)]
    assert batched(rows) == [reference(r) for r in rows]


def test_sampled_rows_give_the_reference_tokens_on_a_corpus():
    """2,000 rows of LM-like logits, every warper combination (and greedy rows mixed in), one batched call per
    100 rows: the reference's (num_accepted, next token) wherever float rounding does not decide a boundary.
    The batched path sums in a different order (a few ulps), so a decision can differ only within rounding of
    its boundary; on this corpus that happens for no row (asserted: at most 1 in 1,000)."""
    rng = np.random.default_rng(11)
    params = SAMPLED + [SamplingParams()]
    rows = [make_row(rng, params[i % len(params)], ties=i % 7 == 0) for i in range(2000)]
    got = [x for i in range(0, len(rows), 100) for x in batched(rows[i:i + 100])]
    want = [reference(r) for r in rows]
    differ = [(r.sampling, g, w) for r, g, w in zip(rows, got, want) if g != w]
    print(f"\nbatched vs reference: {len(differ)} of {len(rows)} rows differ")
    assert len(differ) <= 2, differ[:5]
    assert sum(isinstance(w, str) for w in want) == 0  # no faults in this corpus


def test_dense_and_sparse_paths_agree():
    """The fast path (64 candidates) and the general path alone (1 candidate: every position dense) agree."""
    rng = np.random.default_rng(2)
    rows = [make_row(rng, SAMPLED[i % len(SAMPLED)]) for i in range(300)]
    fast = BatchedRejectionSampler()(rows, VALID)
    dense = BatchedRejectionSampler(num_candidates=1)(rows, VALID)
    assert fast == dense


def test_every_scan_backend_gives_the_reference_tokens():
    """The scan's torch backend (CUDA's, exact float32 normaliser, two-level torch top-k) on the CPU, the numpy
    one and the compiled one (the CPU default where a C compiler is found): the same verdicts as the reference."""
    rng = np.random.default_rng(6)
    params = SAMPLED + [SamplingParams()]
    rows = [make_row(rng, params[i % len(params)], ties=i % 5 == 0) for i in range(300)]
    on_torch = BatchedRejectionSampler(scan_backend="torch")(rows, VALID)
    assert on_torch == BatchedRejectionSampler(scan_backend="numpy")(rows, VALID)
    if native_available():
        assert on_torch == BatchedRejectionSampler(scan_backend="native")(rows, VALID)
    assert [x if isinstance(x, str) else x for x in on_torch] == [reference(r) for r in rows]


def test_a_faulty_row_faults_alone_with_the_reference_message():
    rng = np.random.default_rng(4)
    good = [make_row(rng, p) for p in (SAMPLED[0], SamplingParams(), SAMPLED[2])]
    nan, posinf, neginf, overflow = (make_row(rng, SAMPLED[0]) for _ in range(4))
    nan.logits[-1, 7] = np.nan
    posinf.logits[0, 3] = np.inf
    neginf.logits[0, :] = -np.inf
    overflow.sampling = SamplingParams(temperature=1e-310, seed=overflow.sampling.seed)
    overflow.logits[:] = 1.0
    rows = [good[0], nan, good[1], posinf, neginf, overflow, good[2]]
    got = batched(rows)
    assert got == [reference(r) for r in rows]
    on_torch = BatchedRejectionSampler(scan_backend="torch")(rows, VALID)
    assert [isinstance(x, str) for x in on_torch] == [False, True, False, True, True, True, False]
    assert "NaN logits" in got[1] and "+inf logits" in got[3] and "no finite logit" in got[4]
    assert "no distribution to sample from after logits processing" in got[5]
    assert got[0] == reference(good[0]) and got[2] == reference(good[1]) and got[6] == reference(good[2])


def test_rows_as_torch_tensors_and_numpy_agree():
    rng = np.random.default_rng(8)
    rows = [make_row(rng, SAMPLED[i % 3]) for i in range(40)]
    as_tensors = [VerifyRow(r.block, torch.from_numpy(r.logits), r.sampling, r.start_position) for r in rows]
    assert batched(as_tensors) == batched(rows)


def _first_token_distribution(p_logits, q, claimed_q, sampling, trials, rng) -> np.ndarray:
    """Empirical distribution of the first committed token over ``trials`` one-token blocks verified in one
    batched call: the draft samples x ~ q, the block claims ``claimed_q`` (sparse over all ids)."""
    vocab = len(q)
    rows = []
    for t in range(trials):
        x = int(rng.choice(vocab, p=q))
        draft = SparseDraftProbs(np.arange(vocab)[None, :], claimed_q[None, :].astype(np.float32))
        rows.append(VerifyRow(DraftBlock([x], draft), np.tile(p_logits, (2, 1)), sampling.seeded(t), 10))
    counts = np.zeros(vocab)
    for x_block, r in zip(rows, BatchedRejectionSampler()(rows, vocab)):
        first = x_block.block.draft_token_ids[0] if r.num_accepted >= 1 else r.next_token_id
        counts[first] += 1
    return counts / trials


def test_batched_path_output_is_distributed_as_the_target_with_negative_control():
    """Leviathan et al.'s guarantee on the batched path: the first token of a block is distributed as p
    (target_probs after temperature, top-k, top-p), whatever q. 10,000 trials: TV < 0.025 (the sampling noise
    is ~0.008). Negative control: a block that claims a q other than the one its token was drawn from is not
    lossless, and the same statistic sees it (TV > 0.1)."""
    rng = np.random.default_rng(0)
    p_logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], dtype=np.float32)
    sampling = SamplingParams(temperature=0.9, top_k=6, top_p=0.95)
    p = logits_to_probs(p_logits[None, :], sampling)[0]
    q = np.array([0.05, 0.05, 0.1, 0.3, 0.3, 0.1, 0.05, 0.05])
    empirical = _first_token_distribution(p_logits, q, q, sampling, 10000, rng)
    assert 0.5 * np.abs(empirical - p).sum() < 0.025
    lying = _first_token_distribution(p_logits, q, np.full(8, 1 / 8), sampling, 10000, rng)
    assert 0.5 * np.abs(lying - p).sum() > 0.1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available (scripts/gpu_check.sh runs this on a GPU)")
def test_cuda_rows_match_the_reference():
    rng = np.random.default_rng(9)
    params = SAMPLED + [SamplingParams()]
    rows = [make_row(rng, params[i % len(params)]) for i in range(400)]
    on_gpu = [VerifyRow(r.block, torch.from_numpy(r.logits).cuda(), r.sampling, r.start_position)
              for r in rows]
    got, want = batched(on_gpu), [reference(r) for r in rows]
    differ = sum(g != w for g, w in zip(got, want))
    print(f"\nCUDA batched vs reference: {differ} of {len(rows)} rows differ")
    assert differ <= 2
