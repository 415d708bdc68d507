"""edge_client.transport.verify_stream: one bidi Verify call to a loopback verifier answers the blocks of two
sessions in order (target-only tokens for empty blocks); a block the server refuses fails alone, and the block sent
after it is resent once on a new call and answered."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from conftest import PROMPT_IDS
from specdec_runtime.common.errors import SessionNotFoundError
from specdec_runtime.common.types import DraftBlock, OpenRequest, SamplingParams, StoppingCriteria
from specdec_runtime.common.wire import block_to_proto
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
from specdec_runtime.edge_client.transport.verify_stream import Pending, VerifyCall


def _pending(session_id: str, seq: int, committed_length: int) -> Pending:
    return Pending(Future(), block_to_proto(session_id, seq, committed_length, DraftBlock([])), committed_length, [])


def test_one_call_answers_in_order_and_a_refused_block_fails_alone(room_address, room_reference):
    with GrpcBackend(room_address, mode="stream") as backend:
        request = OpenRequest(list(PROMPT_IDS), SamplingParams(), StoppingCriteria(8, ignore_eos=True))
        a, b = (backend.open_session(request).session_id for _ in range(2))
        call = VerifyCall(backend)
        first = [_pending(a, 1, len(PROMPT_IDS)), _pending(b, 1, len(PROMPT_IDS))]
        for p in first:
            assert call.send(p)
        verdicts = [p.future.result(60) for p in first]
        assert [v.committed_token_ids for v in verdicts] == [room_reference[:1]] * 2
        refused, after = _pending("no-such-session", 1, 3), _pending(a, 2, len(PROMPT_IDS) + 1)
        call.send(refused)
        call.send(after)  # the server ends the stream at the refused block: this one is resent on a new call
        with pytest.raises(SessionNotFoundError):
            refused.future.result(60)
        assert after.future.result(60).committed_token_ids == room_reference[1:2]
        assert call.dead and not call.send(_pending(a, 3, len(PROMPT_IDS) + 2))  # the caller opens a new call
        call.close()
