"""gRPC statuses → :mod:`common.errors`, on the edge: which statuses are a broken transport (a reset stream, a
balancer's HTTP 502) rather than the verifier's answer, and the error a failed call raises
(:func:`map_rpc_error`, used by :class:`edge_client.transport.grpc_backend.GrpcBackend`).
"""

from __future__ import annotations

import grpc

from specdec_runtime.common.errors import (
    PreconditionError,
    SpecdecError,
    VerifierUnavailableError,
    error_for_status,
)
from specdec_runtime.edge_client.transport.credentials import rate_limited_error

__all__ = ["is_broken_stream", "map_rpc_error", "not_a_verifier"]

# Details of INTERNAL/UNKNOWN statuses that are a broken transport, not the verifier's answer: a stream reset by
# the peer or a proxy (nginx answers RST_STREAM when its upstream replica dies), a connection closed under it.
_BROKEN_STREAM_MARKERS = ("rst_stream", "stream removed", "socket closed", "connection reset", "goaway",
                          "broken pipe", "end of tcp stream", "failed to connect", "upstream",
                          "http2 header with status")


# Details of a CANCELLED status that this process asked for (a call or channel it cancelled or closed itself).
_LOCAL_CANCEL_MARKERS = ("locally cancelled", "channel closed")


def is_broken_stream(code: grpc.StatusCode, details: str) -> bool:
    """True when a status is a transport failure rather than the verifier's verdict on a request: UNAVAILABLE;
    CANCELLED unless this process cancelled the call itself (the peer or a proxy cancelled it: a replica's
    transport cancels its streams while it shuts down, "CANCELLED" with no other details — the verifier never
    answers a request with CANCELLED, and a block is idempotent, so it is retried like UNAVAILABLE); and
    INTERNAL/UNKNOWN statuses whose details name a reset or broken stream (a load balancer's RST_STREAM or
    HTTP 502 after its upstream died)."""
    d = (details or "").lower()
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    if code == grpc.StatusCode.CANCELLED:
        return not any(m in d for m in _LOCAL_CANCEL_MARKERS)
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        return any(m in d for m in _BROKEN_STREAM_MARKERS)
    return False


def not_a_verifier(address: str, why: str) -> PreconditionError:
    """The error of a peer at ``address`` that answered but is not a specdec verifier (``why``: what it is or
    said): a wrong address, not a verifier down, so it is not retried."""
    return PreconditionError(f"{address} is not a specdec verifier: {why}")


def map_rpc_error(err: grpc.RpcError, address: str, closed: bool = False) -> SpecdecError:
    """The SpecdecError of a failed call to the verifier at ``address``: VerifierUnavailableError for
    UNAVAILABLE, a broken stream, or a call cancelled because the backend was ``closed``; PreconditionError for
    UNIMPLEMENTED (the address serves some other gRPC service, not a verifier); the tenant limit's
    RateLimitedError (with its retry hint) for RESOURCE_EXHAUSTED that carries one; else the error of the status
    code (:func:`common.errors.error_for_status`)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    if code == grpc.StatusCode.UNAVAILABLE:
        return VerifierUnavailableError(f"verifier at {address} unavailable: {details}")
    if code == grpc.StatusCode.CANCELLED and closed:
        return VerifierUnavailableError(f"backend to {address} closed")
    if is_broken_stream(code, details):  # reset/broken stream: the connection failed, not the request
        return VerifierUnavailableError(f"verifier at {address}: broken stream ({code.name}: {details})")
    if code == grpc.StatusCode.UNIMPLEMENTED:  # another gRPC service listens there (grpc says "Method not found!")
        return not_a_verifier(address, f"it does not serve specdec's Verifier service ({details})")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # a tenant limit carries its retry hint (retry-after-ms)
        limited = rate_limited_error(err, details)
        if limited is not None:
            return limited
    return error_for_status(code, details)
