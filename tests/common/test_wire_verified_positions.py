"""The wire fields of adaptive verification: a verdict's num_verified_positions and a block's draft_confidence
(protos/common/v1/verifier.proto), and the edge's γ controller reading them (edge_client/generation/policy.py)."""

from __future__ import annotations

import pytest

from specdec_runtime.common.errors import InvalidRequestError
from specdec_runtime.common.types import DraftBlock, Verdict
from specdec_runtime.common.v1 import verifier_pb2 as pb
from specdec_runtime.common.wire import block_from_proto, block_to_proto, verdict_from_proto, verdict_to_proto
from specdec_runtime.edge_client.generation.policy import AdaptiveNumSpeculativeTokens


def test_verdict_round_trip_and_checks():
    v = Verdict(num_accepted=2, next_token_id=-1, is_bonus=False, committed_token_ids=[5, 6], committed_length=12,
                num_verified_positions=2)
    back = verdict_from_proto(verdict_to_proto(v), [5, 6, 7, 8], 10)
    assert back.num_verified_positions == 2 and back.committed_token_ids == [5, 6]
    whole = verdict_to_proto(Verdict(1, 9, False, [5, 9], 12))
    assert not whole.HasField("num_verified_positions")
    assert verdict_from_proto(whole, [5, 6], 10).num_verified_positions is None
    for verified, accepted in ((0, 0), (5, 1), (1, 2)):  # none judged; past the block; more accepted than judged
        msg = pb.Verdict(num_accepted=accepted, next_token_id=-1, committed_length=10 + accepted,
                         num_verified_positions=verified)
        with pytest.raises(InvalidRequestError, match="verifies"):
            verdict_from_proto(msg, [5, 6, 7, 8], 10)


def test_block_confidence_round_trip_and_checks():
    b = DraftBlock([1, 2, 3], draft_confidence=[0.5, 0.25, 1.0])
    assert block_from_proto(block_to_proto("s", 1, 4, b)).block.draft_confidence == [0.5, 0.25, 1.0]
    assert block_from_proto(block_to_proto("s", 1, 4, DraftBlock([1, 2]))).block.draft_confidence is None
    for bad in ([0.5], [0.5, 0.5, 1.5]):
        msg = pb.DraftBlock(session_id="s", seq=1, committed_length=4, draft_token_ids=[1, 2, 3], draft_confidence=bad)
        with pytest.raises(InvalidRequestError, match="draft_confidence"):
            block_from_proto(msg)


def test_unjudged_positions_are_no_observation_and_gamma_follows_the_cut():
    a = AdaptiveNumSpeculativeTokens(8, warmup_steps=0)
    before = list(a.accept)
    a.observe(8, 3, 1.0, 10.0, 5.0, num_verified=3)  # 3 judged, all accepted: positions 3.. not judged
    assert a.accept[3:] == before[3:] and all(x > y for x, y in zip(a.accept[:3], before[:3]))
    b = AdaptiveNumSpeculativeTokens(8, warmup_steps=0)
    b.observe(8, 3, 1.0, 10.0, 5.0)  # whole block: position 3 was rejected
    assert b.accept[3] < before[3]
    for _ in range(20):  # the verifier keeps verifying 2 positions: draft about that much
        a.observe(8, 2, 1.0, 10.0, 5.0, num_verified=2)
    assert a.next_num_speculative_tokens() <= 4 < b.next_num_speculative_tokens()
