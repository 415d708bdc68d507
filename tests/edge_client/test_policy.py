"""Unit tests of the speculation policy's proactive bet and of the generation statistics (no models)."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_runtime.common.types import DraftBlock, SparseDraftProbs, Verdict
from specdec_runtime.edge_client.generation.policy import ProactiveBet
from specdec_runtime.edge_client.stats import GenerationStats


def _block(ids, k=2):
    n = len(ids)
    probs = SparseDraftProbs(np.arange(n * k, dtype=np.int64).reshape(n, k), np.full((n, k), 1 / k, np.float32))
    return DraftBlock(list(ids), probs, draft_ms=3.0)


def _verdict(num_accepted, forward_ms=10.0, batch_size=1):
    return Verdict(num_accepted, 7, False, [7], 0, forward_ms=forward_ms, batch_size=batch_size)


def test_proactive_bet_hit_and_miss():
    calls = []

    def propose(ids, n, should_stop):
        calls.append((list(ids), n, should_stop))
        return _block([50, 51, 52, 53][:n])

    bet = ProactiveBet(propose)
    stop = lambda: False  # noqa: E731
    spent = bet.place([1, 2], DraftBlock([3, 4]), max_num_speculative_tokens=3, capacity=100, should_stop=stop)
    assert spent >= 0.0
    assert calls == [([1, 2, 3, 4], 4, stop)]  # the bonus guess + 3 tokens after the block in flight
    # won: the committed ids are the block in flight + the guessed bonus token; cut to this step's length
    block = bet.take([1, 2, 3, 4, 50], 2)
    assert block.draft_token_ids == [51, 52]
    assert block.draft_probs.token_ids.tolist() == [[2, 3], [4, 5]] and block.draft_probs.probs.shape == (2, 2)
    assert bet.take([1, 2, 3, 4, 50], 2) is None  # spent
    # lost: anything else
    bet.place([1, 2], DraftBlock([3, 4]), 3, 100, stop)
    assert bet.take([1, 2, 3, 9], 3) is None
    assert bet.take([1, 2, 3, 4, 50], 3) is None  # a lost bet is dropped


def test_proactive_bet_respects_capacity_and_needs_a_guess_and_a_token():
    calls = []

    def propose(ids, n, should_stop):
        calls.append(n)
        return _block([60][:n])  # only the bonus guess: nothing to prepare

    bet = ProactiveBet(propose)
    assert bet.place([1], DraftBlock([2, 3]), 4, capacity=5, should_stop=lambda: False) == 0.0  # no room left
    assert calls == []
    bet.place([1], DraftBlock([2, 3]), 4, capacity=6, should_stop=lambda: False)
    assert calls == [2]  # room for the guess + 1 token
    assert bet.take([1, 2, 3, 60], 4) is None


def test_generation_stats_observe():
    s = GenerationStats()
    s.observe(4, _verdict(2, forward_ms=20.0, batch_size=2), draft_s=0.5)
    s.observe(3, _verdict(3), proactive_hit=True)
    s.observe(0, _verdict(0))
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 7, 5)
    assert s.num_accepted_tokens_per_pos == [2, 2, 1, 0]
    assert s.num_proactive_hits == 1 and s.draft_s == 0.5
    assert s.target_forward_s == pytest.approx(0.010 + 0.010 + 0.010)
    assert s.acceptance_rate == pytest.approx(5 / 7) and s.mean_accepted_length == pytest.approx(1 + 5 / 3)
    with pytest.raises(ValueError):
        s.observe(1, _verdict(2))
    assert GenerationStats().acceptance_rate == 0.0 and GenerationStats().mean_accepted_length == 0.0
