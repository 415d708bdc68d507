"""Transport security of the verifier: TLS credentials, the safe-bind rule, and URLs fit for logs.

- **TLS**: ``SPECDEC_TLS_CERT_FILE`` + ``SPECDEC_TLS_KEY_FILE`` (PEM) make the gRPC port TLS-only
  (``grpc.ssl_server_credentials``, ``add_secure_port``); ``SPECDEC_TLS_CLIENT_CA_FILE`` adds mutual TLS: a
  client must present a certificate signed by that CA.
- **Safe bind**: a verifier binds 127.0.0.1 by default. Binding any other address needs both TLS and an API-key
  file (:mod:`cloud_verifier.security.auth`), unless ``insecure`` (``--insecure`` / ``SPECDEC_INSECURE=1``) says that the
  network in front of it is trusted; :func:`check_bind` refuses otherwise, in one line.
- **Redaction**: :func:`redact_url` hides the password (and password-like query parameters) of a URL, e.g. a
  Redis URL, before it reaches a log line or an error message.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import grpc

from specdec_runtime.common.pem import read_pem

if TYPE_CHECKING:
    from specdec_runtime.cloud_verifier.security.auth import ApiKeyStore
    from specdec_runtime.cloud_verifier.config import VerifierSettings

log = logging.getLogger(__name__)

_SECRET_QUERY_KEYS = ("password", "passwd", "pass", "secret", "token", "key")


class InsecureBindError(ValueError):
    """A non-loopback bind address without TLS and API keys, and without ``insecure``."""


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    h = (host or "").strip().strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def check_bind(host: str, *, tls: bool, api_keys: bool, insecure: bool) -> None:
    """Refuse to expose the verifier beyond loopback without TLS and API keys (unless ``insecure``).

    Raises:
        InsecureBindError: ``host`` is not a loopback address, TLS or API keys are missing, and not ``insecure``
            (one-line message saying what to set).
    """
    if is_loopback(host) or (tls and api_keys):
        return
    if insecure:
        log.warning("serving on %s without %s: anyone who reaches the port can use the verifier (--insecure)",
                    host, " and ".join(w for w, on in (("TLS", not tls), ("API keys", not api_keys)) if on))
        return
    missing = " and ".join(w for w, on in (("TLS", not tls), ("API keys", not api_keys)) if on)
    raise InsecureBindError(
        f"refusing to serve on {host or '(all interfaces)'} without {missing}: set SPECDEC_TLS_CERT_FILE + "
        "SPECDEC_TLS_KEY_FILE and SPECDEC_API_KEYS_FILE (--tls-cert-file --tls-key-file --api-keys-file), bind "
        "127.0.0.1 (--host), or pass --insecure (SPECDEC_INSECURE=1) if the network in front is trusted"
    )


def server_credentials(cert_file: str | Path, key_file: str | Path,
                       client_ca_file: str | Path | None = None) -> grpc.ServerCredentials:
    """TLS credentials of the gRPC port: certificate chain + private key (PEM); with ``client_ca_file``, mutual
    TLS (clients must present a certificate that CA signed).

    Raises:
        ValueError: a file unreadable or not PEM.
    """
    cert = read_pem(cert_file, "TLS certificate")
    key = read_pem(key_file, "TLS private key")
    ca = read_pem(client_ca_file, "TLS client CA") if client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


@dataclass
class ServerSecurity:
    """What guards a verifier's gRPC port: TLS credentials (None = plaintext) and API keys (None = off)."""

    credentials: grpc.ServerCredentials | None = None
    api_keys: "ApiKeyStore | None" = None
    mutual_tls: bool = False

    @property
    def tls(self) -> bool:
        return self.credentials is not None

    @classmethod
    def from_settings(cls, settings: "VerifierSettings") -> "ServerSecurity":
        """TLS and API keys as the settings ask, after the safe-bind rule (:func:`check_bind`).

        Raises:
            InsecureBindError: see :func:`check_bind`.
            ValueError: only one of the TLS certificate and key given, a client CA without them, or a file
                that cannot be read (one line).
        """
        cert, key, ca = settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file
        if bool(cert) != bool(key):
            raise ValueError("TLS needs both SPECDEC_TLS_CERT_FILE and SPECDEC_TLS_KEY_FILE "
                             "(--tls-cert-file, --tls-key-file)")
        if ca and not cert:
            raise ValueError("SPECDEC_TLS_CLIENT_CA_FILE (mutual TLS) needs SPECDEC_TLS_CERT_FILE and "
                             "SPECDEC_TLS_KEY_FILE")
        check_bind(settings.host, tls=bool(cert), api_keys=bool(settings.api_keys_file),
                   insecure=settings.insecure)
        credentials = server_credentials(cert, key, ca) if cert else None
        api_keys = None
        if settings.api_keys_file:
            from specdec_runtime.cloud_verifier.security.auth import ApiKeyStore

            api_keys = ApiKeyStore(settings.api_keys_file)
        return cls(credentials=credentials, api_keys=api_keys, mutual_tls=bool(ca))


def redact_url(url: str | None) -> str:
    """``url`` with its password (and password-like query parameters) replaced by ``***``; "" for None.

    ``redis://:s3cret@redis:6379/0`` -> ``redis://:***@redis:6379/0``.
    """
    if not url:
        return ""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, sep, _password = userinfo.partition(":")
        # a lone userinfo (redis://xyz@host) is hidden too: it is often a password put in the wrong place
        netloc = f"{user}:***@{hostport}" if sep else f"***@{hostport}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if any(s in k.lower() for s in _SECRET_QUERY_KEYS) else v) for k, v in pairs],
                          safe="*/")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
