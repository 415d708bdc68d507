"""edge_client.transport.backend: which capabilities each real backend declares, what the helpers do without
them, one SentBlock round trip, and OpenRequest/ExtendRequest passed whole giving the same session in process and
over loopback gRPC."""

from __future__ import annotations

import pytest

from conftest import PROMPT_IDS
from specdec_runtime.common.types import DraftBlock, ExtendRequest, OpenRequest, SamplingParams, StoppingCriteria
from specdec_runtime.edge_client.transport import backend as contract
from specdec_runtime.edge_client.transport.backend import SentBlock, answers, failovers_of, max_call_s_of
from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
from specdec_runtime.edge_client.transport.netsim import DelayedBackend

CAPABILITIES = ("Addressed", "StreamsDecode", "Reconnects", "Probes", "ChecksHealth", "CountsWire", "WireLedger",
                "CountsFailovers", "RetriesCalls")


def _declared(backend) -> list[str]:
    return [c for c in CAPABILITIES if isinstance(backend, getattr(contract, c))]


def test_each_backend_declares_its_capabilities(room_local, room_address):
    assert _declared(room_local) == []
    with GrpcBackend(room_address) as grpc_backend:
        assert _declared(grpc_backend) == ["Addressed", "StreamsDecode", "ChecksHealth", "CountsWire", "WireLedger"]
        delayed = DelayedBackend(grpc_backend, 0)  # passes on what it can do behind delays; not the Decode stream
        assert _declared(delayed) == ["Probes", "CountsWire", "CountsFailovers", "RetriesCalls"]
        assert answers(grpc_backend, 2.0) and answers(delayed, 2.0)
    failover = FailoverBackend(room_address, policy=RetryPolicy(budget_s=5.0))
    try:
        assert _declared(failover) == ["Addressed", "Reconnects", "Probes", "CountsWire", "CountsFailovers",
                                       "RetriesCalls"]
        assert max_call_s_of(failover) == failover.policy.max_call_s > 0 and failovers_of(failover) == 0
    finally:
        failover.close()
    # without the capabilities: no retries to wait for, no failovers, the probe says "answers"
    assert max_call_s_of(room_local) == 0.0 and failovers_of(room_local) == 0 and answers(room_local, 0.1)


def test_open_extend_and_a_sent_block_travel_whole(room_local, room_address, room_reference):
    """The same OpenRequest through the in-process backend and over gRPC: the same session; the verdicts of one
    empty block (target-only decoding) are the reference's first token; an ExtendRequest continues the session."""
    request = OpenRequest(list(PROMPT_IDS), SamplingParams(), StoppingCriteria(max_new_tokens=4, ignore_eos=True))
    with GrpcBackend(room_address) as remote:
        for backend in (room_local, remote):
            opened = backend.open_session(request, timeout_s=60)
            assert opened.committed_length == len(PROMPT_IDS)
            sent = SentBlock(backend, opened.session_id, 1, len(PROMPT_IDS), DraftBlock([]))
            verdict, round_trip_ms = sent.wait(60)
            assert verdict.committed_token_ids == room_reference[:1] and round_trip_ms >= 0
            length, seq = verdict.committed_length, 1
            while not verdict.finished:
                seq += 1
                verdict, _ = SentBlock(backend, opened.session_id, seq, length, DraftBlock([])).wait(60)
                length = verdict.committed_length
            assert length == len(PROMPT_IDS) + 4
            extended = backend.extend_session(ExtendRequest(opened.session_id, length, [11, 12],
                                                            stopping=StoppingCriteria(max_new_tokens=2)), 60)
            assert extended.committed_length == length + 2 and extended.session_id == opened.session_id
            backend.close_session(opened.session_id)


def test_a_backend_without_extend_refuses_it():
    from specdec_runtime.common.errors import PreconditionError

    class OpenOnly(contract.VerifierBackend):
        def open_session(self, request, timeout_s=None): ...
        def submit(self, session_id, seq, committed_length, block): ...
        def close_session(self, session_id): ...

    with pytest.raises(PreconditionError, match="cannot extend"):
        OpenOnly().extend_session(ExtendRequest("s", 3, [1]))

    class NoSubmit(contract.VerifierBackend):
        def open_session(self, request, timeout_s=None): ...
        def close_session(self, session_id): ...

    with pytest.raises(TypeError):  # a required method missing: refused at construction
        NoSubmit()
