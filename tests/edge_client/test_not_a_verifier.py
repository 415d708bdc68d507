"""A verifier address where something else answers (an HTTP/1.1 server, Redis) is named as not a specdec verifier
(the PreconditionError of :func:`edge_client.transport.errors.not_a_verifier`) instead of waiting out the connect
timeout as "no connection": the probe's HTTP/2 preface is answered in another protocol. A gRPC server still
probes ok. Real peers: http.server on a free loopback port, the tests' Redis."""

from __future__ import annotations

import threading
from concurrent import futures
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import grpc
import pytest

from specdec_runtime.common.errors import PreconditionError
from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
from specdec_runtime.edge_client.transport.probe import diagnose, diagnose_error, probe_address

pytestmark = pytest.mark.timeout(120)

CONNECT_TIMEOUT_S = 60.0  # far above the probe's: reaching it would fail the test with "no connection within"


@pytest.fixture(scope="module")
def http_address():
    server = ThreadingHTTPServer(("127.0.0.1", 0), SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(params=["http", "redis"])
def peer(request, http_address):
    """(kind, address) of a peer that answers but is not a gRPC server."""
    if request.param == "http":
        return "http", http_address
    url = urlsplit(request.getfixturevalue("redis_url"))
    return "redis", f"{url.hostname}:{url.port or 6379}"


def _check_message(kind: str, address: str, message: str) -> None:
    assert message.startswith(f"{address} is not a specdec verifier: "), message
    assert ("HTTP/1.x server" in message) if kind == "http" else ("ERR" in message), message
    assert "\n" not in message


def test_the_probe_names_the_peer(peer):
    kind, address = peer
    state, message = probe_address(address)
    assert state == "not_verifier"
    _check_message(kind, address, message)
    assert diagnose([address]) == message
    assert isinstance(diagnose_error([address]), PreconditionError)


def test_connecting_raises_precondition_not_a_timeout(peer):
    kind, address = peer
    with pytest.raises(PreconditionError) as e:
        GrpcBackend(address, connect_timeout_s=CONNECT_TIMEOUT_S)
    _check_message(kind, address, str(e.value))
    with pytest.raises(PreconditionError) as e:  # the client's backend: not retried as an unreachable verifier
        FailoverBackend(address, policy=RetryPolicy(connect_timeout_s=CONNECT_TIMEOUT_S), connect=True)
    _check_message(kind, address, str(e.value))


def test_a_grpc_server_probes_ok():
    server = grpc.server(futures.ThreadPoolExecutor(2))  # no services: it still speaks HTTP/2
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert probe_address(f"127.0.0.1:{port}") == ("ok", None)
    finally:
        server.stop(None)
