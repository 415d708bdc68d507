"""Why a verifier address does not answer, in words a user can act on: a raw TCP + TLS probe, no gRPC.

gRPC reports a TLS mismatch as a stream of "Handshake failed" log lines and, after its connect timeout, as an
unreachable server. :func:`diagnose` opens one TCP connection per address and tries the TLS handshake the channel
would make (or, for a plaintext channel, a handshake that checks nothing), so a wrong ``--tls``/``--ca-cert`` is
named at once: the verifier's certificate is not trusted, does not name the host, the verifier speaks TLS to a
plaintext client, or does not speak TLS to a TLS client. A plaintext channel first sends the HTTP/2 preface: a
peer that answers it with something else (an HTTP/1.x server, Redis) is named as not a specdec verifier at
once, where gRPC would wait out its connect timeout. The CLI runs it while the draft model loads.
"""

from __future__ import annotations

import socket
import ssl
from concurrent.futures import ThreadPoolExecutor

from specdec_runtime.common.errors import PreconditionError, SpecdecError, VerifierUnavailableError
from specdec_runtime.edge_client.transport.connections import host_port

__all__ = ["diagnose", "diagnose_error", "probe_address"]

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


# the HTTP/2 client connection preface and an empty SETTINGS frame (RFC 9113, 3.4): an HTTP/2 server (gRPC is one)
# answers with a SETTINGS frame of its own; anything else that answers is not a gRPC server
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_H2_SETTINGS = 0x04


def _peer_answer(data: bytes) -> str:
    """What a peer that is not HTTP/2 answered, for the message: its first line, printable, short."""
    line = data.split(b"\n", 1)[0].strip().decode("ascii", "replace")
    line = "".join(c if c.isprintable() else "?" for c in line)[:60]
    if line.startswith("HTTP/1") or data.lstrip()[:9].lower() in (b"<!doctype", b"<html>"):  # an error page
        return f"an HTTP/1.x server answered {line!r}"
    return f"it answered {line!r}" if line else "it answered bytes that are not HTTP/2"


def _not_grpc_probe(sock: socket.socket, address: str) -> tuple[bool, str | None]:
    """A plaintext channel: does the peer speak HTTP/2? ``(True, None)`` when it answered the preface in HTTP/2;
    ``(False, message)`` saying it is not a specdec verifier when it answered something else (an HTTP/1.x server,
    Redis); ``(False, None)`` when it cannot tell (no answer in time, closed without a word, a TLS record: the
    TLS probe judges that one)."""
    from specdec_runtime.edge_client.transport.errors import not_a_verifier

    data = b""
    try:
        sock.sendall(_H2_PREFACE)
        while len(data) < 9:  # a whole frame header, however the peer's first bytes are split
            more = sock.recv(512)
            if not more:
                break
            data += more
    except OSError:
        if len(data) < 9:
            return False, _OK
    if len(data) >= 4 and data[3] == _H2_SETTINGS:  # a frame header: 3 bytes of length, then the type
        return True, _OK
    if not data or data[0] in (0x15, 0x16):  # nothing, or a TLS alert/handshake record
        return False, _OK
    return False, str(not_a_verifier(address, f"{_peer_answer(data)} where gRPC (HTTP/2) was expected"))


def probe_address(address: str, security=None, timeout_s: float = 2.0) -> tuple[str, str | None]:
    """(state, message) of one address: ``("ok", None)`` (or undetermined: a timeout, a gRPC target URI),
    ``("down", message)`` (nothing listens: refused, unknown host), ``("tls", message)`` (a TLS mismatch) or,
    for a plaintext channel, ``("not_verifier", message)`` (the peer answered, but not in HTTP/2: an HTTP/1.x
    server, Redis; the message is :func:`edge_client.transport.errors.not_a_verifier`'s).

    ``security``: :class:`edge_client.transport.credentials.ChannelSecurity` of the channel (None = plaintext).
    Never raises."""
    hp = host_port(address)
    if hp is None:
        return "ok", _OK
    host, port = hp
    plaintext = security is None or not security.tls
    if plaintext:  # HTTP/2 first: a verifier answers at once, and so does most that is not one
        sock, failed = _connect(host, port, address, timeout_s)
        if sock is None:
            return failed
        with sock:
            http2, message = _not_grpc_probe(sock, address)
        if http2:
            return "ok", _OK
        if message is not None:
            return "not_verifier", message
    sock, failed = _connect(host, port, address, timeout_s)
    if sock is None:
        return failed
    try:
        message = _plain_probe(sock, address) if plaintext else _tls_probe(sock, address, host, security)
    finally:
        sock.close()
    return ("ok", None) if message is None else ("tls", message)


def _connect(host: str, port: int, address: str, timeout_s: float):
    """``(socket, None)`` (its timeout ``timeout_s``), or ``(None, (state, message))`` when none: ``"ok"``
    (undetermined) when connecting timed out, ``"down"`` when nothing listens."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except socket.timeout:
        return None, ("ok", _OK)
    except ConnectionRefusedError:
        return None, ("down", f"cannot reach verifier at {address}: connection refused")
    except OSError as e:
        return None, ("down", f"cannot reach verifier at {address}: {e.strerror or e}")
    sock.settimeout(timeout_s)
    return sock, None


def diagnose(addresses: list[str], security=None, timeout_s: float = 2.0, *, unreachable_is_error: bool = True
             ) -> str | None:
    """One line saying why none of ``addresses`` can serve this channel, or None when one may (or it cannot
    tell): the message of :func:`diagnose_error`. Never raises."""
    error = diagnose_error(addresses, security, timeout_s, unreachable_is_error=unreachable_is_error)
    return None if error is None else str(error)


def diagnose_error(addresses: list[str], security=None, timeout_s: float = 2.0, *,
                   unreachable_is_error: bool = True) -> SpecdecError | None:
    """The error of why none of ``addresses`` can serve this channel (returned, not raised), or None when one may
    (or it cannot tell). A peer that answered (a TLS mismatch: VerifierUnavailableError; not a gRPC server:
    PreconditionError, :func:`edge_client.transport.errors.not_a_verifier`) is reported when no address probes
    ok; unreachable addresses (VerifierUnavailableError) only when all are and ``unreachable_is_error`` (False
    where the client starts without a verifier: device fallback). Probes run in parallel, each within
    ``timeout_s`` seconds. Never raises."""
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(addresses)))) as pool:
        results = list(pool.map(lambda a: probe_address(a, security, timeout_s), addresses))
    if any(state == "ok" for state, _ in results):
        return None
    answered = [(state, m) for state, m in results if state in ("tls", "not_verifier")]
    if answered:
        state, message = answered[0]
        return PreconditionError(message) if state == "not_verifier" else VerifierUnavailableError(message)
    if unreachable_is_error and results:
        return VerifierUnavailableError(results[0][1] if len(results) == 1
                                        else f"cannot reach any verifier of {','.join(addresses)}")
    return None
