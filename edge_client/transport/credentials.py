"""How the edge reaches a verifier securely: TLS (optionally mutual) and an API key, over grpcio's credentials.

:class:`ChannelSecurity` makes the gRPC channel of a :class:`~edge_client.transport.grpc_backend.GrpcBackend`:

- ``tls=False`` (default): a plaintext channel (``grpc.insecure_channel``): loopback, or a trusted network.
- ``tls=True``: ``grpc.secure_channel`` with ``grpc.ssl_channel_credentials(root_certificates)``: the server's
  certificate is checked against ``root_certificates`` (PEM; None = the system's roots) and the address's host
  name. ``certificate_chain`` + ``private_key`` present a client certificate (mutual TLS).
- ``api_key``: sent as ``authorization: Bearer <key>`` on every call. On a TLS channel through gRPC call
  credentials (``grpc.access_token_call_credentials``: gRPC never sends them over plaintext); on a plaintext
  channel as per-call metadata (call credentials need a secure channel) — for loopback testing or a network
  that is trusted; a warning is logged when the address is not loopback. None = ``$SPECDEC_API_KEY`` if set.

The key never appears in ``repr`` or logs.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass, field

import grpc

from specdec_runtime.common.pem import read_pem

log = logging.getLogger(__name__)

API_KEY_ENV = "SPECDEC_API_KEY"
PemSource = bytes | str | os.PathLike | None


def _pem(source: PemSource, what: str) -> bytes | None:
    """PEM bytes from bytes, PEM text, or a file path; None passes through (:func:`common.pem.read_pem`).

    Raises:
        ValueError: the file cannot be read or is not PEM (one line).
    """
    return None if source is None else read_pem(source, what)


def _host_of(address: str) -> str:
    host = address.rsplit(":", 1)[0] if ":" in address else address
    if "://" in host:  # grpc target URIs (dns:///host:port, ipv4:...)
        host = host.split("://", 1)[1].lstrip("/")
    return host.strip("[]")


def is_loopback_address(address: str) -> bool:
    """True when ``address`` ("host:port") names this machine (localhost, 127.0.0.0/8, ::1)."""
    host = _host_of(address).lower()
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ChannelSecurity:
    """Transport security of the edge's channel (see the module docstring).

    Attributes:
        tls: TLS channel (implied by any certificate argument of :meth:`of`).
        root_certificates: PEM roots that sign the verifier's certificate; None = the system's roots.
        api_key: the API key (``authorization: Bearer``); None = no key.
        certificate_chain, private_key: PEM client certificate and key (mutual TLS); both or neither.
        server_name: host name to check the server certificate against instead of the address's (e.g. when
            dialing an IP); None = the address's host.
    """

    tls: bool = False
    root_certificates: bytes | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)
    certificate_chain: bytes | None = field(default=None, repr=False)
    private_key: bytes | None = field(default=None, repr=False)
    server_name: str | None = None

    @classmethod
    def of(cls, *, tls: bool = False, root_certificates: PemSource = None, api_key: str | None = None,
           certificate_chain: PemSource = None, private_key: PemSource = None, server_name: str | None = None,
           use_env: bool = True) -> "ChannelSecurity":
        """Build from files or bytes: PEM arguments may be bytes, PEM text or a file path. ``api_key`` None
        = ``$SPECDEC_API_KEY`` when ``use_env``; "" = no key.

        Raises:
            ValueError: a PEM file unreadable or not PEM; only one of certificate_chain / private_key; an API key
                with characters gRPC metadata cannot carry (whitespace, non-ASCII).
        """
        roots = _pem(root_certificates, "CA certificate")
        chain = _pem(certificate_chain, "client certificate")
        key = _pem(private_key, "client private key")
        if (chain is None) != (key is None):
            raise ValueError("mutual TLS needs both the client certificate and its private key")
        if api_key is None and use_env:
            api_key = os.environ.get(API_KEY_ENV) or None
        if api_key is not None:
            api_key = api_key.strip() or None
        if api_key is not None and not all(33 <= ord(c) < 127 for c in api_key):
            raise ValueError("the API key must be printable ASCII without spaces")
        tls = bool(tls or roots is not None or chain is not None or server_name)
        return cls(tls=tls, root_certificates=roots, api_key=api_key, certificate_chain=chain, private_key=key,
                   server_name=server_name)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials (with the API key as call credentials), or None for a plaintext channel."""
        if not self.tls:
            return None
        creds = grpc.ssl_channel_credentials(root_certificates=self.root_certificates, private_key=self.private_key,
                                             certificate_chain=self.certificate_chain)
        if self.api_key:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(self.api_key))
        return creds

    def channel(self, address: str, options: list[tuple[str, object]] | None = None) -> grpc.Channel:
        """A channel to ``address`` ("host:port") with ``options``: TLS or plaintext (see the class)."""
        opts = list(options or [])
        creds = self.channel_credentials()
        if creds is None:
            if self.api_key and not is_loopback_address(address):
                log.warning("sending the API key to %s without TLS: anyone on the path can read it (use --tls)",
                            address)
            return grpc.insecure_channel(address, options=opts)
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        return grpc.secure_channel(address, creds, options=opts)

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """Per-call metadata the backend adds to every call: the API key on a plaintext channel (on TLS the
        call credentials carry it), else nothing."""
        if self.api_key and not self.tls:
            return (("authorization", f"Bearer {self.api_key}"),)
        return ()


def rate_limited_error(err: grpc.RpcError, details: str):
    """A :class:`~common.errors.RateLimitedError` for a RESOURCE_EXHAUSTED status whose trailing metadata holds
    ``retry-after-ms`` (a tenant limit of the verifier), else None."""
    from specdec_runtime.common.errors import RETRY_AFTER_MS_KEY, RateLimitedError

    try:
        trailing = err.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - not a call error (no trailing metadata)
        return None
    for key, value in trailing:
        if key == RETRY_AFTER_MS_KEY:
            try:
                return RateLimitedError(details, int(value))
            except (TypeError, ValueError):
                return None
    return None
