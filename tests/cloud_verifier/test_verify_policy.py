"""The verify-length policy's parts on their own: the cut block, the cost model, the calibration and the
adaptive choice (cloud_verifier/verify_policy). End to end exactness: tests/e2e/test_adaptive_verification.py."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_runtime.cloud_verifier.verify_policy import (
    AcceptanceCalibration, AdaptiveVerifyPolicy, ForwardCostModel, VerifyPolicy, draft_confidences,
    make_verify_policy, truncate_block,
)
from specdec_runtime.common.types import DraftBlock, SparseDraftProbs


def _block(conf, bonus_drafted=False, probs=False) -> DraftBlock:
    n = len(conf)
    dp = SparseDraftProbs(np.arange(2 * n).reshape(n, 2), np.full((n, 2), 0.5, dtype=np.float32)) if probs else None
    return DraftBlock(list(range(0, 2 * n, 2)), dp, bonus_drafted=bonus_drafted, draft_confidence=list(conf))


def test_truncate_is_the_bonus_drafted_prefix():
    b = _block([0.9, 0.8, 0.7, 0.6], probs=True)
    assert truncate_block(b, b.num_scored_positions) is b  # γ + 1 = 5 rows: the whole block
    cut = truncate_block(b, 2)
    assert cut.bonus_drafted and cut.draft_token_ids == b.draft_token_ids[:2] and cut.num_scored_positions == 2
    assert cut.draft_probs.token_ids.shape == (2, 2) and cut.draft_confidence == [0.9, 0.8]
    bd = _block([0.9, 0.8, 0.7], bonus_drafted=True)
    assert truncate_block(bd, 3) is bd and truncate_block(bd, 1).num_scored_positions == 1
    with pytest.raises(ValueError):
        truncate_block(b, 0)
    with pytest.raises(ValueError):
        truncate_block(b, 6)


def test_confidences_from_the_wire_or_q():
    b = _block([0.3, 0.4], probs=True)
    assert draft_confidences(b) == [0.3, 0.4]
    b.draft_confidence = None
    assert draft_confidences(b) == [0.5, 0.5]  # q(x) of each drafted token
    assert draft_confidences(DraftBlock([1, 2])) == [None, None]


def test_cost_model_separates_rows_from_tokens():
    m = ForwardCostModel()
    assert m.cost_s(8, 64) == 0.0 and not m
    for rows, tokens in ((1, 1), (1, 64), (8, 8), (8, 64), (64, 64), (32, 256)):
        m.observe(rows, tokens, 0.01 + 0.002 * rows + 0.0005 * tokens, forget=1.0)
    c = m.coefficients()
    assert c["base"] == pytest.approx(0.01, rel=1e-3) and c["per_row"] == pytest.approx(0.002, rel=1e-3)
    assert c["per_token"] == pytest.approx(0.0005, rel=1e-3)
    for _ in range(200):  # live steps: long contexts make every row dearer; the model follows (forgetting)
        for rows, tokens in ((64, 512), (64, 300)):
            m.observe(rows, tokens, 0.01 + 0.02 * rows + 0.0005 * tokens)
    assert m.coefficients()["per_row"] == pytest.approx(0.02, rel=0.05)
    assert m.cost_s(64, 300) < m.cost_s(64, 512) < 0.01 + 0.02 * 64 + 0.0006 * 512


def test_cost_model_coefficients_never_negative():
    m = ForwardCostModel()
    for rows, tokens, s in ((1, 8, 0.05), (8, 64, 0.04), (64, 512, 0.06)):  # noise: more work measured cheaper
        m.observe(rows, tokens, s, forget=1.0)
    assert all(v >= 0 for v in m.coefficients().values())


def test_calibration_learns_an_over_confident_draft():
    cal = AcceptanceCalibration()
    rng = np.random.default_rng(0)
    for _ in range(2000):  # the draft says 0.95, the target accepts 40 %
        accepted = int(rng.random() < 0.4)
        cal.observe([0.95, 0.95], [cal.estimate(0.95, 0)] * 2, 2, accepted + (accepted and rng.random() < 0.4))
    assert cal.estimate(0.95, 0) == pytest.approx(0.4, abs=0.05)
    err = cal.calibration_error()
    assert err["raw"] > 0.5 and err["calibrated"] < 0.1 and err["observations"] > 2000
    assert cal.estimate(None, 3) == pytest.approx(0.6)  # no confidence: the position prior


def _steep() -> ForwardCostModel:
    t = ForwardCostModel()
    for rows, n in ((1, 1), (8, 8), (8, 64), (64, 512)):
        t.observe(rows, n, 0.01 + 0.001 * n, forget=1.0)  # a fixed part, then every token costs a tenth of it
    return t


def _flat() -> ForwardCostModel:
    t = ForwardCostModel()
    for rows, n in ((1, 1), (8, 8), (8, 64), (64, 512)):
        t.observe(rows, n, 0.05, forget=1.0)
    return t


def test_adaptive_cuts_low_confidence_tails_on_a_steep_table():
    blocks = [_block([0.99] * 8) for _ in range(4)] + [_block([0.99, 0.05] + [0.9] * 6) for _ in range(4)]
    policy = AdaptiveVerifyPolicy(_steep())
    for b in blocks:  # calibrate: 0.99 is accepted, 0.05 is not
        for _ in range(50):
            policy.observe_verdict(b, 8, 8 if b.draft_confidence[1] > 0.5 else 1)
    m = policy.choose(blocks, 0)
    assert all(1 <= k <= b.num_scored_positions for k, b in zip(m, blocks))
    assert all(k <= 2 for k in m[4:])  # nothing past the unlikely second token
    assert min(m[:4]) > max(m[4:])  # the confident rows keep more
    assert VerifyPolicy(_steep()).choose(blocks, 0) == [9] * 8  # fixed: every position


def test_a_fit_of_one_row_count_verifies_whole_blocks():
    """Steps of one session all have one row: base and per-row cost are not separable, and two passes fit a line
    through noise. Until passes span two row counts and two token counts (a saved table, the background
    profile, steps of several sessions) the policy verifies whole blocks; then it cuts as the table says."""
    blocks = [_block([0.99, 0.05] + [0.9] * 6) for _ in range(4)]
    cost = ForwardCostModel()
    for t in (1, 8, 64, 9, 5):
        cost.observe(1, t, 0.01 * t, forget=1.0)  # steep per token, but one row count only
    policy = AdaptiveVerifyPolicy(cost)
    for b in blocks:
        for _ in range(50):
            policy.observe_verdict(b, 8, 1)
    assert not cost and policy.choose(blocks, 0) == [9] * 4
    cost.observe(4, 32, 0.32, forget=1.0)  # a second row count: the fit is trusted
    assert cost and max(policy.choose(blocks, 0)) <= 2


def test_adaptive_keeps_whole_blocks_when_extra_tokens_are_free():
    blocks = [_block([0.5] * 8) for _ in range(8)]
    assert AdaptiveVerifyPolicy(_flat()).choose(blocks, 0) == [9] * 8
    assert AdaptiveVerifyPolicy(ForwardCostModel()).choose(blocks, 0) == [9] * 8  # nothing measured yet


def test_adaptive_does_not_cut_when_the_verifier_waits_for_its_edges():
    # one session on a steep table: cutting its tail pays per forward pass, but when the verifier waits far longer
    # for the next block (the edge's drafting and round trip) than the pass takes, a cut saves a sliver of the cycle
    blocks = [_block([0.6] * 8)]
    busy, waiting = AdaptiveVerifyPolicy(_steep()), AdaptiveVerifyPolicy(_steep())
    for policy in (busy, waiting):
        for _ in range(50):
            policy.observe_verdict(blocks[0], 8, 1)  # a poor draft: calibrated down
    for _ in range(20):
        busy.observe_host(0.001, 0.0)
        waiting.observe_host(0.001, 0.5)
    assert busy.choose(blocks, 0)[0] < 9
    assert waiting.choose(blocks, 0) == [9]
    assert waiting.report()["wait_s"] == pytest.approx(0.5)
    waiting.observe_host(0.001, 60.0)  # an idle verifier: counted as at most MAX_WAIT_S
    assert waiting.wait_s <= 1.0


def test_make_verify_policy():
    assert make_verify_policy("fixed").name == "fixed" and make_verify_policy("adaptive").uses_cost_model
    with pytest.raises(ValueError, match="unknown verify policy"):
        make_verify_policy("greedy")
