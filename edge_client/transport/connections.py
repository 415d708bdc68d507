"""Which verifier the edge talks to: an ordered address list (pick-first) or one load balancer.

:class:`PickFirstConnections` holds one live connection: the first address that answers, from the current one
on, used until a failure gives it up (:meth:`~PickFirstConnections.drop`); the next call then connects to the
next address (or again to the balancer). Wire statistics of the connections given up are kept per session.
Retrying calls over these connections is :class:`edge_client.transport.failover.FailoverBackend`.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Callable, Sequence

from specdec_runtime.common.errors import (InvalidRequestError, PreconditionError, SpecdecError,
                                           VerifierUnavailableError)
from specdec_runtime.edge_client.transport.backend import ChecksHealth, CountsWire, VerifierBackend, WireLedger
from specdec_runtime.edge_client.stats import WireStats

log = logging.getLogger(__name__)

__all__ = ["PickFirstConnections", "parse_addresses"]


def parse_addresses(spec: str | Sequence[str]) -> list[str]:
    """Verifier addresses from "host:port[,host:port...]" (or a list of them), in order, blanks dropped.

    Raises:
        InvalidRequestError: no address, one without a host or a port, a port out of range, or a URL
            (``http://...``: gRPC target URIs such as ``dns:///host:port`` pass).
    """
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = [a.strip() for a in items if a and a.strip()]
    if not out:
        raise InvalidRequestError(f"no verifier address in {spec!r} (expected HOST:PORT[,HOST:PORT...])")
    for a in out:
        scheme = a.split("://", 1)[0].lower() if "://" in a else ""
        if scheme in ("http", "https", "grpc", "grpcs"):  # a URL, not a gRPC target: it would never connect
            raise InvalidRequestError(f"verifier address {a!r} is a URL: give HOST:PORT (no scheme; TLS is --tls)")
        if scheme or a.startswith("unix:"):
            continue
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidRequestError(f"verifier address {a!r} is not HOST:PORT")
        if not 0 < int(port) < 65536:
            raise InvalidRequestError(f"verifier address {a!r}: port {port} is not in [1, 65535]")
    return out


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a plain "host:port" / "[v6]:port" address; None for gRPC target URIs (dns:, unix:)."""
    if "://" in address or address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return None
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


class PickFirstConnections:
    """One live connection over ``addresses``, tried in order (see the module docstring). Thread-safe.

    Args:
        addresses: "host:port[,host:port...]" or a list; the first is preferred.
        factory: makes the connection to one address (raises VerifierUnavailableError when it cannot).
        connect_timeout_s: how long a TCP connect to a plain "host:port" may take before the address counts as
            unreachable, s (checked before ``factory``, without gRPC's reconnect backoff).

    Attributes:
        addresses: the parsed address list. closed: True after :meth:`close`.

    Raises:
        InvalidRequestError: no valid address.
    """

    def __init__(self, addresses: str | Sequence[str], factory: Callable[[str], VerifierBackend],
                 connect_timeout_s: float) -> None:
        self.addresses = parse_addresses(addresses)
        self._factory = factory
        self._connect_timeout_s = connect_timeout_s
        self._lock = threading.RLock()
        self._index = 0  # address of the current (or next) connection
        self._backend: VerifierBackend | None = None
        self.closed = False
        self._saved_stats: dict[str, list[int]] = {}  # wire stats of closed connections, per session

    @property
    def address(self) -> str:
        """The address in use (or tried next)."""
        return self.addresses[self._index]

    def _connect_one(self, address: str) -> VerifierBackend:
        hp = host_port(address)
        if hp is not None:  # refused or unroutable: fail fast, without gRPC's reconnect backoff
            try:
                socket.create_connection(hp, timeout=self._connect_timeout_s).close()
            except OSError as e:
                raise VerifierUnavailableError(
                    f"cannot reach verifier at {address}: {e.strerror or type(e).__name__}") from None
        return self._factory(address)

    def current(self) -> VerifierBackend:
        """The connection in use; connects to the first address that answers, from the current one on.

        Raises:
            VerifierUnavailableError: closed, or no address answers.
        """
        with self._lock:
            if self.closed:
                raise VerifierUnavailableError("verifier backend is closed")
            if self._backend is not None:
                return self._backend
            errors = []
            n = len(self.addresses)
            for k in range(n):
                i = (self._index + k) % n
                try:
                    backend = self._connect_one(self.addresses[i])
                except (VerifierUnavailableError, PreconditionError) as e:  # the latter: not a verifier there
                    errors.append(e)
                    continue
                self._index, self._backend = i, backend
                return backend
            if n == 1:
                first = errors[0]
                raise first if isinstance(first, PreconditionError) else VerifierUnavailableError(str(first))
            raise VerifierUnavailableError(f"cannot reach any of {n} verifiers: " + "; ".join(map(str, errors)))

    def drop(self, backend: VerifierBackend | None) -> None:
        """Give up ``backend`` after a failure on it (closing its stream: a replica still working on a block of
        it drops it if queued); the next call connects to the next address (or again to the balancer)."""
        if backend is None:
            return
        with self._lock:
            if self._backend is not backend:
                return
            self._backend = None
            self._index = (self._index + 1) % len(self.addresses)
        self._save_stats(backend)
        try:
            backend.close()
        except Exception:  # noqa: BLE001
            log.debug("closing a failed connection", exc_info=True)

    def _save_stats(self, backend: VerifierBackend) -> None:
        if not isinstance(backend, WireLedger):  # a connection that counts nothing leaves nothing to keep
            return
        stats = backend.wire_stats_by_session()
        if not stats:
            return
        with self._lock:
            for sid, st in list(stats.items()):
                acc = self._saved_stats.setdefault(sid, [0, 0, 0, 0])
                acc[0] += st.bytes_sent
                acc[1] += st.bytes_received
                acc[2] += st.messages_sent
                acc[3] += st.messages_received

    def wire_stats(self, session_id: str):
        """Bytes/messages exchanged for ``session_id`` over all connections, as a
        :class:`edge_client.stats.WireStats` (see GrpcBackend.wire_stats)."""

        with self._lock:
            acc = list(self._saved_stats.get(session_id, [0, 0, 0, 0]))
            backend = self._backend
        if isinstance(backend, CountsWire):
            st = backend.wire_stats(session_id)
            acc = [acc[0] + st.bytes_sent, acc[1] + st.bytes_received, acc[2] + st.messages_sent,
                   acc[3] + st.messages_received]
        return WireStats(*acc)

    def probe(self, timeout_s: float = 2.0) -> bool:
        """True when some address answers health SERVING now (connecting if needed); a connection that does not
        is given up, so the next probe tries the next address. Never raises."""
        try:
            backend = self.current()
        except SpecdecError:
            return False
        if not isinstance(backend, ChecksHealth) or backend.check_health(timeout_s):
            return True  # a connection without a health check: the next call is the test
        self.drop(backend)
        return False

    def close(self) -> bool:
        """Close the connection in use (its wire stats kept); later calls raise VerifierUnavailableError.
        Returns False when closed already."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            backend, self._backend = self._backend, None
        if backend is not None:
            self._save_stats(backend)
            backend.close()
        return True
