"""The one home of two guards both the wire and another reader need (common/types.py): int32 token ids (the wire
and the session store) and a verdict's counts against its block (the wire and the edge's statistics)."""

from __future__ import annotations

import pytest

from specdec_runtime.common.errors import InvalidRequestError
from specdec_runtime.common.types import INT32_MAX, INT32_MIN, Verdict, check_int32, check_verdict_counts
from specdec_runtime.edge_client.stats import GenerationStats


def test_int32_bounds_inclusive():
    check_int32([INT32_MIN, 0, INT32_MAX], "token id")
    for bad in (INT32_MAX + 1, INT32_MIN - 1):
        with pytest.raises(InvalidRequestError, match=f"token id {bad} does not fit in int32"):
            check_int32([1, bad], "token id")


def test_store_and_wire_use_the_same_bounds():
    from specdec_runtime.cloud_verifier.store.base import check_tokens
    from specdec_runtime.common.types import SamplingParams, StoppingCriteria
    from specdec_runtime.common.wire import open_request_to_proto

    check_tokens([INT32_MAX])
    with pytest.raises(InvalidRequestError, match="does not fit in int32"):
        check_tokens([INT32_MAX + 1])
    with pytest.raises(InvalidRequestError, match="prompt token id .* does not fit in int32"):
        open_request_to_proto([1, INT32_MAX + 1], SamplingParams(), StoppingCriteria(4, (), (), False), "fp")


@pytest.mark.parametrize("accepted, verified, block_len, ok", [
    (0, None, 0, True), (4, None, 4, True), (5, None, 4, False), (-1, None, 4, False),
    (2, 2, 4, True), (2, 1, 4, False), (0, 0, 4, False), (1, 5, 4, False), (4, 4, 4, True),
])
def test_verdict_counts(accepted, verified, block_len, ok):
    if ok:
        check_verdict_counts(accepted, verified, block_len)
    else:
        with pytest.raises(InvalidRequestError, match="verdict"):
            check_verdict_counts(accepted, verified, block_len)


def test_statistics_refuse_what_the_wire_refuses():
    stats = GenerationStats()
    with pytest.raises(ValueError, match="verdict accepts 5 tokens of a 4-token block"):
        stats.observe(4, Verdict(num_accepted=5, next_token_id=1, is_bonus=False, committed_token_ids=[1],
                                 committed_length=9))
    assert stats.num_drafts == 0  # nothing counted
