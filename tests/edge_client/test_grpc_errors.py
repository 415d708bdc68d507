"""Which failed calls the SDK retries (edge_client.transport.errors): statuses from a real gRPC server on 127.0.0.1.

A CANCELLED status the client did not ask for (a replica's transport cancels its streams while it shuts down:
"CANCELLED", nothing else) is a broken path, retried like UNAVAILABLE; a call the client cancelled itself is not.
"""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec_runtime.common.errors import SpecdecError, VerifierUnavailableError
from specdec_runtime.edge_client.transport.errors import map_rpc_error
from specdec_runtime.edge_client.transport.retry import is_retryable

pytestmark = pytest.mark.timeout(60)


class _Answers(health_pb2_grpc.HealthServicer):
    """Check answers the status named by the service field; Watch never answers (the client cancels it)."""

    def Check(self, request, context):
        code = getattr(grpc.StatusCode, request.service)
        context.abort(code, "CANCELLED" if code == grpc.StatusCode.CANCELLED else f"{request.service} answer")

    def Watch(self, request, context):
        while context.is_active():
            time.sleep(0.01)


@pytest.fixture(scope="module")
def stub():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(_Answers(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield health_pb2_grpc.HealthStub(channel)
    finally:
        channel.close()
        server.stop(0)


def _error(stub, code: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        stub.Check(health_pb2.HealthCheckRequest(service=code), timeout=10)
    return e.value


def test_a_peer_cancelled_call_is_retried(stub):
    err = _error(stub, "CANCELLED")
    assert err.code() == grpc.StatusCode.CANCELLED
    mapped = map_rpc_error(err, "127.0.0.1:1")
    assert isinstance(mapped, VerifierUnavailableError) and is_retryable(mapped)


def test_a_call_cancelled_here_is_not_retried(stub):
    call = stub.Watch(health_pb2.HealthCheckRequest(), timeout=10)
    call.cancel()
    with pytest.raises(grpc.RpcError) as e:
        next(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    mapped = map_rpc_error(e.value, "127.0.0.1:1")
    assert isinstance(mapped, SpecdecError) and not is_retryable(mapped)
    # the same, once the backend was closed: unavailable (its pending blocks go to another replica)
    assert isinstance(map_rpc_error(e.value, "127.0.0.1:1", closed=True), VerifierUnavailableError)


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "INTERNAL", "NOT_FOUND"])
def test_an_answer_about_the_request_is_not_retried(stub, code):
    mapped = map_rpc_error(_error(stub, code), "127.0.0.1:1")
    assert not is_retryable(mapped) and mapped.code == getattr(grpc.StatusCode, code)
