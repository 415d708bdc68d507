"""The history-dependent logits pipeline (common/logits_processors.py): HF's processors as the oracle, the
incremental state against a recount, and seeded sampling under speculation distributed as target-only sampling
per parameter (Leviathan et al. 2023, Algorithm 1, with processing at every position with its own history), with
a negative control that leaves the block's earlier draft tokens out of the history (SGLang's approximation)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import MinPLogitsWarper

from _hf_processors import hf_processors
from specdec_runtime.common.logits import logits_to_probs
from specdec_runtime.common.logits_processors import TokenHistory, process_block
from specdec_runtime.common.rejection import verify_block
from specdec_runtime.common.sampling import Stream, sample_from, uniform
from specdec_runtime.common.types import DraftBlock, SamplingParams, SparseDraftProbs
from specdec.logits_reference import logits_to_probs_reference

ALL = SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.7, frequency_penalty=0.4,
                     logit_bias={3: 2.0, 7: -1.5}, min_tokens=2)


def test_one_position_equals_hf_processors():
    rng = np.random.default_rng(0)
    vocab, prompt = 50, [5, 6, 7, 5]
    ids = prompt + [3, 3, 9, 0]
    for params in (ALL, SamplingParams(repetition_penalty=0.7), SamplingParams(presence_penalty=-1.0),
                   SamplingParams(frequency_penalty=2.0), SamplingParams(min_tokens=9)):
        logits = rng.normal(size=vocab).astype(np.float32) * 3
        h = TokenHistory(params, vocab, len(prompt), stop_token_ids=[0, 1], token_ids=ids)
        ours = h.apply(logits.copy())
        ref = hf_processors(params, len(prompt), [0, 1])(torch.tensor([ids]), torch.from_numpy(logits.copy())[None])
        np.testing.assert_allclose(ours, ref[0].numpy(), rtol=1e-6, atol=1e-5)


def test_incremental_state_equals_a_recount():
    rng = np.random.default_rng(1)
    vocab = 30
    h = TokenHistory(ALL, vocab, 3, [0], [4, 5, 6])
    for _ in range(200):
        ids = rng.integers(0, vocab, size=int(rng.integers(1, 12))).tolist()
        h.sync([4, 5, 6, *ids])
        fresh = TokenHistory(ALL, vocab, 3, [0], [4, 5, 6, *ids])
        x = rng.normal(size=vocab).astype(np.float32)
        np.testing.assert_array_equal(h.apply(x.copy()), fresh.apply(x.copy()))


def test_process_block_row_i_has_the_blocks_first_i_draft_tokens():
    rng = np.random.default_rng(2)
    vocab, committed, draft = 40, [1, 2, 3, 9, 9], [9, 4, 9]
    rows = rng.normal(size=(4, vocab)).astype(np.float32)
    h = TokenHistory(ALL, vocab, 2, [0], committed)
    out = process_block(h, rows.copy(), draft)
    for i in range(4):
        want = TokenHistory(ALL, vocab, 2, [0], committed + draft[:i]).apply(rows[i].copy())
        np.testing.assert_array_equal(out[i], want)
    assert h.token_ids == committed  # the draft tokens were popped again


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_equals_hf_and_the_reference(min_p):
    logits = np.random.default_rng(3).normal(size=(4, 1000)).astype(np.float32) * 2
    params = SamplingParams(temperature=0.8, top_p=0.95, min_p=min_p)
    ours = logits_to_probs(logits, params)
    np.testing.assert_array_equal(ours, logits_to_probs_reference(logits, params))  # bit for bit
    with np.errstate(divide="ignore"):  # log 0 = -inf: the tokens top-p dropped
        scores = np.log(logits_to_probs(logits, SamplingParams(temperature=0.8, top_p=0.95)))
    hf = MinPLogitsWarper(min_p)(None, torch.from_numpy(scores))
    np.testing.assert_array_equal(ours > 0, torch.isfinite(hf).numpy())  # the same kept set as HF


# ---------------------------------------------------------------------------- sampling under speculation
# A small synthetic pair: target and draft logits are tables indexed by the last token (vocab 8), so thousands
# of seeded generations take seconds. Token 0 is EOS (min_tokens masks it).
V, PROMPT, L, GAMMA, RUNS = 8, [1, 2], 5, 3, 800
_T = np.random.default_rng(10).normal(size=(V, V)).astype(np.float32)
_D = (_T + np.random.default_rng(11).normal(size=(V, V)) * 0.7).astype(np.float32)


def _target_only(params, seed):
    ids = list(PROMPT)
    h = TokenHistory(params, V, len(PROMPT), [0], ids)
    while len(ids) < len(PROMPT) + L:
        row = h.apply(_T[ids[-1]].copy())
        t = sample_from(logits_to_probs(row, params)[0], uniform(seed, len(ids), Stream.TARGET_SAMPLE))
        ids.append(t)
        h.push(t)
    return tuple(ids[len(PROMPT):])


def _speculative(params, seed, in_block_history=True):
    ids = list(PROMPT)
    verifier = TokenHistory(params, V, len(PROMPT), [0], ids)
    while len(ids) < len(PROMPT) + L:
        drafter = TokenHistory(params, V, len(PROMPT), [0], ids)
        draft, qs = [], []
        for i in range(GAMMA):  # the draft: its own logits, processed with the same history rule
            q = logits_to_probs(drafter.apply(_D[(ids + draft)[-1]].copy()), params)[0]
            x = sample_from(q, uniform(seed, len(ids) + i, Stream.DRAFT_SAMPLE))
            draft.append(x)
            qs.append(q)
            drafter.push(x)
        rows = np.stack([_T[t] for t in [ids[-1], *draft]])  # the target scores γ + 1 positions
        verifier.sync(ids)
        if in_block_history:
            process_block(verifier, rows, draft)
        else:  # negative control: every position with the committed history only
            for r in rows:
                verifier.apply(r)
        sparse = SparseDraftProbs(np.tile(np.arange(V), (GAMMA, 1)), np.stack(qs).astype(np.float32))
        res = verify_block(DraftBlock(draft, sparse), rows, params.seeded(seed), len(ids))
        ids += draft[:res.num_accepted] + [res.next_token_id]
    return tuple(ids[len(PROMPT):len(PROMPT) + L])


def _chi2_pvalue(a: list, b: list) -> float:
    """Two-sample χ² homogeneity test of two samples of hashable outcomes (cells with < 10 samples in both
    merged into one)."""
    keys = sorted(set(a) | set(b))
    ca, cb = [a.count(k) for k in keys], [b.count(k) for k in keys]
    big = [i for i in range(len(keys)) if ca[i] + cb[i] >= 10]
    table = [[ca[i] for i in big] + [sum(ca) - sum(ca[i] for i in big)],
             [cb[i] for i in big] + [sum(cb) - sum(cb[i] for i in big)]]
    table = [row for row in zip(*table) if sum(row) > 0]
    return float(stats.chi2_contingency(np.array(table).T)[1]) if len(table) > 1 else 1.0


def _pvalues(ref: list, other: list) -> tuple[float, float, float]:
    """χ² p-values of three laws: the first three tokens' joint law; the number of distinct tokens among the L
    (what the penalties act on, and what the negative control gets wrong: in-block repeats left unpenalised);
    the positions of EOS (token 0: what min_tokens acts on)."""
    def eos(r):
        return tuple(i for i, t in enumerate(r) if t == 0)

    return (_chi2_pvalue([r[:3] for r in ref], [o[:3] for o in other]),
            _chi2_pvalue([len(set(r)) for r in ref], [len(set(o)) for o in other]),
            _chi2_pvalue([eos(r) for r in ref], [eos(o) for o in other]))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, presence_penalty=2.0),
    SamplingParams(temperature=1.0, repetition_penalty=5.0),
    SamplingParams(temperature=1.0, min_tokens=3, logit_bias={0: 3.0}),
    SamplingParams(temperature=0.9, frequency_penalty=1.5, logit_bias={3: 1.5, 5: -2.0}, min_p=0.1, top_k=6),
], ids=["presence", "repetition", "min_tokens", "frequency+bias+min_p+top_k"])
def test_seeded_speculative_sampling_is_distributed_as_target_only(params):
    ref = [_target_only(params, seed) for seed in range(RUNS)]
    spec = [_speculative(params, seed) for seed in range(RUNS, 2 * RUNS)]
    assert min(_pvalues(ref, spec)) > 1e-3 / 3  # three tests: Bonferroni
    wrong = [_speculative(params, seed, in_block_history=False) for seed in range(RUNS, 2 * RUNS)]
    assert min(_pvalues(ref, wrong)) < 1e-4, "the negative control must be told apart"
