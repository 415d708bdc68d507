"""Probe a verifier's gRPC health service (``grpc.health.v1.Health/Check``); exit 0 when SERVING.

Usage (Docker HEALTHCHECK, exec probes)::

    python -m cloud_verifier.serving.healthcheck [--address HOST:PORT] [--service specdec.v1.Verifier] [--timeout 3]

The default address is 127.0.0.1:$SPECDEC_PORT (50051). Exit codes: 0 SERVING, 1 not serving or unreachable.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_SERVICE = "specdec.v1.Verifier"


def check(address: str, service: str = DEFAULT_SERVICE, timeout_s: float = 3.0, *,
          ca_cert: str | None = None, server_name: str | None = None) -> str:
    """The serving status name ("SERVING", "NOT_SERVING", ...) of ``service`` at ``address``. ``ca_cert``: PEM
    file of the CA of a TLS port's certificate (TLS; the health service needs no API key); ``server_name``: name
    to check that certificate against instead of the address's host.

    Raises:
        grpc.RpcError: unreachable within ``timeout_s`` s, or the service is unknown (NOT_FOUND).
        OSError: ``ca_cert`` cannot be read.
    """
    if ca_cert:
        with open(ca_cert, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        channel_cm = grpc.secure_channel(address, creds, options=options)
    else:
        channel_cm = grpc.insecure_channel(address)
    with channel_cm as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s,
                              wait_for_ready=True)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cloud_verifier.serving.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=f"127.0.0.1:{os.environ.get('SPECDEC_PORT', '50051')}",
                        help="HOST:PORT of the verifier (default 127.0.0.1:$SPECDEC_PORT)")
    parser.add_argument("--service", default=DEFAULT_SERVICE, help='service name ("" = the whole server)')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    parser.add_argument("--ca-cert", default=os.environ.get("SPECDEC_HEALTHCHECK_CA_FILE"),
                        help="TLS port: PEM CA of its certificate (default $SPECDEC_HEALTHCHECK_CA_FILE)")
    parser.add_argument("--server-name", default=os.environ.get("SPECDEC_HEALTHCHECK_SERVER_NAME"),
                        help="TLS: certificate name to expect (default $SPECDEC_HEALTHCHECK_SERVER_NAME, else the "
                             "address's host)")
    args = parser.parse_args(argv)
    try:
        status = check(args.address, args.service, args.timeout, ca_cert=args.ca_cert, server_name=args.server_name)
    except grpc.RpcError as e:
        print(f"{args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"cannot read the CA certificate {args.ca_cert}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
