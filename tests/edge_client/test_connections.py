"""edge_client.transport.connections: pick-first over real addresses (an unreachable one first, then a loopback
verifier), a dropped connection's wire counts kept (its WireLedger), and the probe moving on."""

from __future__ import annotations

import socket

import pytest

from conftest import PROMPT_IDS
from specdec_runtime.common.errors import InvalidRequestError, VerifierUnavailableError
from specdec_runtime.common.types import OpenRequest, SamplingParams, StoppingCriteria
from specdec_runtime.edge_client.transport.connections import PickFirstConnections, parse_addresses
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_parse_addresses():
    assert parse_addresses(" a:1, ,b:2 ") == ["a:1", "b:2"]
    assert parse_addresses(["dns:///x:5"]) == ["dns:///x:5"]
    for bad in ("", "http://a:1", "a", "a:0", "a:70000"):
        with pytest.raises(InvalidRequestError):
            parse_addresses(bad)


def test_pick_first_skips_the_dead_address_and_keeps_dropped_counts(room_address):
    dead = f"127.0.0.1:{_free_port()}"
    conns = PickFirstConnections([dead, room_address], lambda a: GrpcBackend(a, connect_timeout_s=5), 1.0)
    try:
        first = conns.current()
        assert conns.address == room_address and first.address == room_address and conns.current() is first
        opened = first.open_session(OpenRequest(list(PROMPT_IDS), SamplingParams(), StoppingCriteria(2)))
        counted = conns.wire_stats(opened.session_id)
        assert counted.bytes_sent > 0 and counted.messages_received == 1
        conns.drop(first)  # given up: its counts stay with the session
        assert first.closed and conns.wire_stats(opened.session_id) == counted
        assert conns.probe(2.0) and conns.address == room_address  # the dead one is skipped again
    finally:
        conns.close()
    with pytest.raises(VerifierUnavailableError, match="closed"):
        conns.current()


def test_no_address_answers():
    conns = PickFirstConnections([f"127.0.0.1:{_free_port()}"], lambda a: GrpcBackend(a), 0.5)
    with pytest.raises(VerifierUnavailableError, match="cannot reach"):
        conns.current()
    assert not conns.probe(0.5)
