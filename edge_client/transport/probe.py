"""Why a verifier address does not answer, in words a user can act on: a raw TCP + TLS probe, no gRPC.

gRPC reports a TLS mismatch as a stream of "Handshake failed" log lines and, after its connect timeout, as an
unreachable server. :func:`diagnose` opens one TCP connection per address and tries the TLS handshake the channel
would make (or, for a plaintext channel, a handshake that checks nothing), so a wrong ``--tls``/``--ca-cert`` is
named at once: the verifier's certificate is not trusted, does not name the host, the verifier speaks TLS to a
plaintext client, or does not speak TLS to a TLS client. The CLI runs it while the draft model loads.
"""

from __future__ import annotations

import socket
import ssl
from concurrent.futures import ThreadPoolExecutor

from specdec_runtime.edge_client.transport.connections import host_port

__all__ = ["diagnose", "probe_address"]

_OK = None  # the probe found nothing wrong (or cannot tell): let gRPC connect


def _tls_context(security) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    if security.root_certificates:
        ctx = ssl.create_default_context(cadata=security.root_certificates.decode("ascii", "replace"))
    ctx.set_alpn_protocols(["h2"])
    return ctx


def _plain_probe(sock: socket.socket, address: str) -> str | None:
    """A plaintext channel: does the server finish a TLS handshake (then it speaks TLS, and gRPC would fail)?"""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    try:
        with ctx.wrap_socket(sock, server_hostname=None):
            return (f"the verifier at {address} speaks TLS: add --tls (and --ca-cert FILE when a private CA signed "
                    "its certificate)")
    except (ssl.SSLError, OSError):
        return _OK  # not TLS: the plaintext channel will do


def _tls_probe(sock: socket.socket, address: str, host: str, security) -> str | None:
    name = security.server_name or host
    try:
        with _tls_context(security).wrap_socket(sock, server_hostname=name):
            return _OK
    except ssl.SSLCertVerificationError as e:
        if e.verify_code == 62 or "match" in str(e.verify_message or "").lower():  # X509_V_ERR_HOSTNAME_MISMATCH
            return (f"the verifier's certificate does not name {name!r}: its subjectAltName must list the host "
                    "you dial (docs/security.md has a recipe)")
        if security.root_certificates:
            return f"the verifier's certificate ({address}) is not signed by the --ca-cert given"
        return f"the verifier's certificate is not trusted: pass --ca-cert FILE (the CA that signed it, {address})"
    except ssl.SSLError as e:
        reason = (e.reason or str(e)).upper()
        if any(s in reason for s in ("WRONG_VERSION_NUMBER", "RECORD_LAYER", "HTTP_REQUEST", "PACKET_LENGTH", "EOF")):
            return f"the verifier at {address} does not speak TLS: drop --tls and --ca-cert"
        return _OK
    except (ConnectionResetError, BrokenPipeError, ssl.SSLEOFError):
        return f"the verifier at {address} does not speak TLS: drop --tls and --ca-cert"
    except OSError:
        return _OK


def probe_address(address: str, security=None, timeout_s: float = 2.0) -> tuple[str, str | None]:
    """(state, message) of one address: ``("ok", None)`` (or undetermined: a timeout, a gRPC target URI),
    ``("down", message)`` (nothing listens: refused, unknown host) or ``("tls", message)`` (a TLS mismatch).

    ``security``: :class:`edge_client.transport.credentials.ChannelSecurity` of the channel (None = plaintext).
    Never raises."""
    hp = host_port(address)
    if hp is None:
        return "ok", _OK
    host, port = hp
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except socket.timeout:
        return "ok", _OK
    except ConnectionRefusedError:
        return "down", f"cannot reach verifier at {address}: connection refused"
    except OSError as e:
        return "down", f"cannot reach verifier at {address}: {e.strerror or e}"
    sock.settimeout(timeout_s)
    try:
        if security is None or not security.tls:
            message = _plain_probe(sock, address)
        else:
            message = _tls_probe(sock, address, host, security)
    finally:
        sock.close()
    return ("ok", None) if message is None else ("tls", message)


def diagnose(addresses: list[str], security=None, timeout_s: float = 2.0, *, unreachable_is_error: bool = True
             ) -> str | None:
    """One line saying why none of ``addresses`` can serve this channel, or None when one may (or it cannot
    tell). A TLS mismatch is reported when no address probes ok; unreachable addresses only when all are and
    ``unreachable_is_error`` (False where the client starts without a verifier: device fallback). Probes run in
    parallel, each within ``timeout_s`` seconds. Never raises."""
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(addresses)))) as pool:
        results = list(pool.map(lambda a: probe_address(a, security, timeout_s), addresses))
    if any(state == "ok" for state, _ in results):
        return None
    tls = [m for state, m in results if state == "tls"]
    if tls:
        return tls[0]
    if unreachable_is_error and results:
        return results[0][1] if len(results) == 1 else f"cannot reach any verifier of {','.join(addresses)}"
    return None
