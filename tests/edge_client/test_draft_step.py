"""edge_client.drafting.step: a greedy row is the argmax with no q; a sampled row's q is a distribution holding
the drawn token, the same draw for the same (seed, position); forced tokens are one-hot; confidence truncation."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_runtime.common.types import SamplingParams
from specdec_runtime.edge_client.drafting.step import DraftRows, below_confidence, stack_rows, top_probability


def _logits(seed: int, n: int = 50) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, n).astype(np.float32)


def test_greedy_rows():
    rows = DraftRows(SamplingParams(), 4, 50, start=10)
    logits = _logits(0)
    assert rows.draw(logits) == int(np.argmax(logits))
    rows.force(7)
    block = rows.block(0.0, num_forced_tokens=1)
    assert block.draft_token_ids == [int(np.argmax(logits)), 7] and block.draft_probs is None
    assert block.draft_confidence[1] == 1.0 and block.num_forced_tokens == 1


def test_sampled_rows_are_q_and_keyed_by_seed_and_position():
    sampling = SamplingParams(temperature=1.0, seed=5)
    draws = []
    for _ in range(2):
        rows = DraftRows(sampling, 4, 40, start=3)  # valid vocab 40 of 50 logits: padded ids never drafted
        tokens = [rows.draw(_logits(i)) for i in range(3)]
        rows.force(2)
        block = rows.block(0.0)
        q = block.draft_probs
        assert q.token_ids.shape == q.probs.shape == (4, 4)
        np.testing.assert_allclose(q.probs.sum(axis=1), 1.0, rtol=1e-5)
        for i, t in enumerate(tokens):
            assert t < 40 and t in q.token_ids[i][q.probs[i] > 0]
        assert list(q.token_ids[3][q.probs[3] > 0]) == [2]
        draws.append(tokens)
    assert draws[0] == draws[1]
    assert DraftRows(sampling, 1, 40, start=3).greedy  # k <= 1: greedy drafting


def test_confidence_and_stacking():
    flat = np.zeros(10, dtype=np.float32)
    assert abs(top_probability(flat) - 0.1) < 1e-9 and top_probability(np.full(3, -np.inf)) == 0.0
    assert below_confidence(flat, 0.5) and not below_confidence(flat, 0.0)
    stacked = stack_rows([np.array([3, 4]), np.array([9])], [np.array([0.5, 0.5]), np.array([1.0])])
    assert stacked.token_ids.shape == (2, 2) and stacked.probs[1, 1] == 0.0 and stacked.token_ids[1, 1] != 9


def test_sampled_rows_need_the_session_seed():
    with pytest.raises(ValueError, match="needs sampling.seed"):
        DraftRows(SamplingParams(temperature=1.0), 4, 40, start=0)
    assert DraftRows(SamplingParams(temperature=0.0), 4, 40, start=0).greedy  # greedy sampling draws nothing
