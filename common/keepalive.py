"""HTTP/2 keepalive: the edge's pings and the verifier's ping policy, defined together so that they agree.

The edge (``edge_client.transport.grpc_backend``) pings its connection every ``CLIENT_KEEPALIVE_TIME_MS`` — with or
without calls in flight — to keep NAT and load-balancer mappings of a WAN link alive and to find a dead peer
(no ping ack within ``CLIENT_KEEPALIVE_TIMEOUT_MS``). The verifier (``cloud_verifier.serving.server``) enforces gRPC's
ping policy: a ping that arrives less than ``SERVER_MIN_PING_INTERVAL_MS`` after the previous one while no data
flows is a "strike"; after ``SERVER_MAX_PING_STRIKES`` strikes the server closes the connection with GOAWAY
``too_many_pings``. Both sides must permit pings without calls (an idle edge keeps its connection).

Agreement rule (:func:`check_agreement`): the client's keepalive interval is at least
``PING_INTERVAL_MARGIN`` × the server's minimum, so a client ping is never early — during a long prefill
(an OpenSession call with no data for a while) or on a Verify stream idle between generations.
"""

from __future__ import annotations

from typing import Any

CLIENT_KEEPALIVE_TIME_MS = 30_000  # edge: ping period, ms
CLIENT_KEEPALIVE_TIMEOUT_MS = 10_000  # edge: ping ack deadline, ms (then the connection is dead: failover)
SERVER_KEEPALIVE_TIME_MS = 60_000  # verifier: pings idle clients to find dead connections, ms
SERVER_KEEPALIVE_TIMEOUT_MS = 20_000  # verifier: ping ack deadline, ms
SERVER_MIN_PING_INTERVAL_MS = 10_000  # verifier: client pings closer than this without data are strikes, ms
SERVER_MAX_PING_STRIKES = 2  # verifier: strikes before GOAWAY too_many_pings (gRPC's default)
PING_INTERVAL_MARGIN = 2.0  # client interval >= margin × server minimum (timer jitter, pings of both ends)


def client_keepalive_options(keepalive_time_ms: int = CLIENT_KEEPALIVE_TIME_MS,
                             keepalive_timeout_ms: int = CLIENT_KEEPALIVE_TIMEOUT_MS) -> list[tuple[str, Any]]:
    """gRPC channel options of the edge's keepalive (``keepalive_time_ms``, ``keepalive_timeout_ms``: ms)."""
    return [
        ("grpc.keepalive_time_ms", int(keepalive_time_ms)),
        ("grpc.keepalive_timeout_ms", int(keepalive_timeout_ms)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # pings while a long call sends nothing (prefill)
    ]


def server_keepalive_options(min_ping_interval_ms: int = SERVER_MIN_PING_INTERVAL_MS,
                             max_ping_strikes: int = SERVER_MAX_PING_STRIKES,
                             keepalive_time_ms: int = SERVER_KEEPALIVE_TIME_MS,
                             keepalive_timeout_ms: int = SERVER_KEEPALIVE_TIMEOUT_MS) -> list[tuple[str, Any]]:
    """gRPC server options of the verifier's ping policy (intervals in ms; ``max_ping_strikes`` 0 = never
    GOAWAY)."""
    return [
        ("grpc.keepalive_time_ms", int(keepalive_time_ms)),
        ("grpc.keepalive_timeout_ms", int(keepalive_timeout_ms)),
        ("grpc.keepalive_permit_without_calls", 1),
        # the server's minimum between received pings: gRPC core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS
        # is spelled "grpc.http2.min_ping_interval_without_data_ms" ("...min_recv_ping..." is no gRPC option)
        ("grpc.http2.min_ping_interval_without_data_ms", int(min_ping_interval_ms)),
        ("grpc.http2.max_ping_strikes", int(max_ping_strikes)),
    ]


def check_agreement(client_keepalive_time_ms: int = CLIENT_KEEPALIVE_TIME_MS,
                    server_min_ping_interval_ms: int = SERVER_MIN_PING_INTERVAL_MS) -> None:
    """Raise ValueError unless the client pings no more often than the server allows (with the margin).

    Raises:
        ValueError: ``client_keepalive_time_ms`` < ``PING_INTERVAL_MARGIN`` × ``server_min_ping_interval_ms``.
    """
    if client_keepalive_time_ms < PING_INTERVAL_MARGIN * server_min_ping_interval_ms:
        raise ValueError(
            f"client keepalive {client_keepalive_time_ms} ms is shorter than {PING_INTERVAL_MARGIN:g} x the "
            f"server's minimum ping interval {server_min_ping_interval_ms} ms: the server would answer "
            "GOAWAY too_many_pings"
        )


check_agreement()  # the shipped pair agrees (import fails otherwise)
