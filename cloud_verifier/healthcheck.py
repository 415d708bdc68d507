"""Probe a verifier's gRPC health service (``grpc.health.v1.Health/Check``); exit 0 when SERVING.

Usage (Docker HEALTHCHECK, exec probes)::

    python -m cloud_verifier.healthcheck [--address HOST:PORT] [--service specdec.v1.Verifier] [--timeout 3]

The default address is 127.0.0.1:$SPECDEC_PORT (50051). Exit codes: 0 SERVING, 1 not serving or unreachable.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_SERVICE = "specdec.v1.Verifier"


def check(address: str, service: str = DEFAULT_SERVICE, timeout_s: float = 3.0) -> str:
    """The serving status name ("SERVING", "NOT_SERVING", ...) of ``service`` at ``address``.

    Raises:
        grpc.RpcError: unreachable within ``timeout_s`` s, or the service is unknown (NOT_FOUND).
    """
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s,
                              wait_for_ready=True)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cloud_verifier.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=f"127.0.0.1:{os.environ.get('SPECDEC_PORT', '50051')}",
                        help="HOST:PORT of the verifier (default 127.0.0.1:$SPECDEC_PORT)")
    parser.add_argument("--service", default=DEFAULT_SERVICE, help='service name ("" = the whole server)')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    args = parser.parse_args(argv)
    try:
        status = check(args.address, args.service, args.timeout)
    except grpc.RpcError as e:
        print(f"{args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
