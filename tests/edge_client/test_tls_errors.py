"""The SDK names a TLS mismatch with the verifier within seconds instead of waiting out its connect timeout: a
plaintext channel to a TLS verifier, a TLS channel that does not trust its certificate, a TLS channel to a
plaintext verifier (a bare gRPC server of this process: the handshake is all the client reaches)."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest

from _pki import make_pki
from specdec_runtime.common.errors import VerifierUnavailableError
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    server = grpc.server(futures.ThreadPoolExecutor(2))
    creds = grpc.ssl_server_credentials([(pki.read("server_key"), pki.read("server_cert"))])
    tls_port = server.add_secure_port("127.0.0.1:0", creds)
    plain_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield pki, f"127.0.0.1:{tls_port}", f"127.0.0.1:{plain_port}"
    server.stop(None)


@pytest.mark.parametrize("case, expected", [
    ("plain-to-tls", "speaks TLS: add --tls"),
    ("system-roots", "certificate is not trusted: pass --ca-cert FILE"),
    ("tls-to-plain", "does not speak TLS"),
])
def test_tls_mismatch_named_fast(servers, case, expected):
    pki, tls_address, plain_address = servers
    kwargs = {"plain-to-tls": dict(address=tls_address),
              "system-roots": dict(address=tls_address, tls=True),
              "tls-to-plain": dict(address=plain_address, root_certificates=pki.read("ca_cert"))}[case]
    # named from the handshake, not after the connect timeout: the timeout is long (60 s) and the bound half of it,
    # so a loaded machine cannot fail this, and a client that waited the timeout out always does
    t0 = time.monotonic()
    with pytest.raises(VerifierUnavailableError, match=expected):
        GrpcBackend(connect_timeout_s=60.0, api_key="", **kwargs)
    assert time.monotonic() - t0 < 30.0


def test_trusted_tls_connects(servers):
    pki, tls_address, _ = servers
    GrpcBackend(tls_address, root_certificates=pki.read("ca_cert"), connect_timeout_s=10.0, api_key="").close()
