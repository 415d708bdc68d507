"""A fault-injecting TCP proxy (asyncio, toxiproxy-style, seeded): a WAN between an edge and a verifier, dialled.

Each direction of each connection has its own toxics (:class:`DirectionProfile`): a one-way latency with uniform
jitter (toxiproxy's "latency" toxic: a chunk is held ``latency ± jitter`` ms and never overtakes the chunk before
it), a bandwidth cap (the "bandwidth" toxic: a chunk leaves the proxy only once the link has had time to carry it;
latency is added on top, so it does not lower throughput), and stalls (with a probability per chunk the link
freezes for ``stall_ms``: that chunk and every chunk queued behind it wait). Connection resets (toxiproxy's
"reset_peer": TCP RST to both peers) come at a Poisson rate (:attr:`LinkProfile.resets_per_minute`) or on demand:
now (:meth:`WanProxy.reset_connections`) or on the next chunk in one direction (:meth:`WanProxy.reset_on_next_chunk`:
with "down", a request reaches the server and its answer is lost).

What the seed fixes and what it does not: every random draw comes from a generator seeded by (seed, connection
number, direction) or (seed, "resets"), and :class:`LinkSchedule` turns (arrival time, size) into delivery times
deterministically, two draws per chunk whatever the profile. What is left to the machine is wall-clock: how the
kernel cuts the byte stream into the chunks the proxy reads (so which chunk a stall falls on), when the event loop
wakes (``asyncio.sleep`` overshoots by up to a few ms on a loaded machine), and what a reset catches in flight.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import random
import socket
import struct
import threading
from dataclasses import dataclass, field, fields, replace
from typing import Callable

READ_BYTES = 16384  # largest chunk read from a socket at once
QUEUE_CHUNKS = 256  # chunks held per direction before the proxy stops reading (back-pressure to the sender)
PACING_S = 0.02  # under a bandwidth cap a chunk leaves in pieces of at most this much link time, s
MIN_PIECE_BYTES = 512


@dataclass(frozen=True)
class DirectionProfile:
    """What one direction of the link does to the bytes crossing it.

    Attributes:
        latency_ms: one-way delay added to every chunk, ms.
        jitter_ms: a chunk's delay is uniform in [latency_ms - jitter_ms, latency_ms + jitter_ms], clamped at 0, ms;
            order is kept (a chunk is never delivered before the one ahead of it).
        bandwidth_kbps: capacity, kbit/s (1 kbit = 1000 bits); 0 = unlimited.
        stall_probability: probability, per chunk read, that the link freezes before carrying it, in [0, 1].
        stall_ms: length of one stall, ms.

    Raises:
        ValueError: from :meth:`validate` on a negative or non-finite value, or a probability above 1.
    """

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_kbps: float = 0.0
    stall_probability: float = 0.0
    stall_ms: float = 0.0

    def validate(self) -> None:
        """Raise ValueError when a field is out of range."""
        for f in fields(self):
            value = getattr(self, f.name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{f.name} must be a finite number >= 0, got {value!r}")
        if self.stall_probability > 1:
            raise ValueError(f"stall_probability must be <= 1, got {self.stall_probability}")


@dataclass(frozen=True)
class LinkProfile:
    """The whole link: ``uplink`` (client → upstream), ``downlink`` (upstream → client), and resets.

    Attributes:
        uplink: toxics of the bytes the client sends.
        downlink: toxics of the bytes the upstream answers.
        resets_per_minute: mean rate of reset events, per minute (exponential gaps, seeded); each event resets
            every open connection (RST to both peers). 0 = none.

    Raises:
        ValueError: from :meth:`validate` on a value out of range.
    """

    uplink: DirectionProfile = field(default_factory=DirectionProfile)
    downlink: DirectionProfile = field(default_factory=DirectionProfile)
    resets_per_minute: float = 0.0

    @classmethod
    def symmetric(cls, *, latency_ms: float = 0.0, jitter_ms: float = 0.0, bandwidth_kbps: float = 0.0,
                  stall_probability: float = 0.0, stall_ms: float = 0.0,
                  resets_per_minute: float = 0.0) -> "LinkProfile":
        """The same toxics in both directions (so the round trip adds 2 × ``latency_ms``); units as the fields."""
        one = DirectionProfile(latency_ms, jitter_ms, bandwidth_kbps, stall_probability, stall_ms)
        return cls(one, one, resets_per_minute)

    def validate(self) -> None:
        """Raise ValueError when a field is out of range."""
        self.uplink.validate()
        self.downlink.validate()
        if not (math.isfinite(self.resets_per_minute) and self.resets_per_minute >= 0):
            raise ValueError(f"resets_per_minute must be a finite number >= 0, got {self.resets_per_minute!r}")


class LinkSchedule:
    """When each chunk of one direction of one connection is delivered: a pure function of the seed and of the
    (arrival time, size) sequence, so it can be tested without sockets.

    The link carries one chunk at a time: a chunk starts when it arrives and the link is free (plus ``stall_ms``
    when it stalls), takes size / bandwidth to carry, and is delivered ``latency ± jitter`` later, never before the
    chunk ahead of it.
    """

    def __init__(self, seed: str | int):
        self._rng = random.Random(seed)
        self._free_at = -math.inf  # when the link has carried everything planned so far, s
        self._last_due = -math.inf

    def plan(self, profile: DirectionProfile, now_s: float, nbytes: int) -> tuple[list[tuple[float, int]], bool]:
        """Plan a chunk of ``nbytes`` bytes read at ``now_s`` (s, any monotonic clock).

        Returns ([(delivery time in s on the same clock, piece size in bytes), ...], whether the link stalled);
        under a bandwidth cap the chunk is cut into pieces of at most ``PACING_S`` of link time each.
        """
        stall_draw, jitter_draw = self._rng.random(), self._rng.random()  # always two: profiles can change
        stalled = stall_draw < profile.stall_probability
        start = max(now_s, self._free_at) + (profile.stall_ms / 1000.0 if stalled else 0.0)
        delay_s = max(0.0, profile.latency_ms + (2.0 * jitter_draw - 1.0) * profile.jitter_ms) / 1000.0
        if profile.bandwidth_kbps > 0:
            bytes_per_s = profile.bandwidth_kbps * 1000.0 / 8.0
            piece = max(MIN_PIECE_BYTES, int(bytes_per_s * PACING_S))
            sizes = [min(piece, nbytes - i) for i in range(0, nbytes, piece)]
        else:
            bytes_per_s, sizes = math.inf, [nbytes]
        out = []
        for size in sizes:
            start += size / bytes_per_s
            due = max(start + delay_s, self._last_due)
            self._last_due = due
            out.append((due, size))
        self._free_at = start
        return out, stalled


@dataclass
class WanStats:
    """Counters of a :class:`WanProxy` since it started (a copy from :meth:`WanProxy.stats`).

    Attributes:
        connections: client connections accepted. active: open now. upstream_failures: accepted connections whose
        upstream did not answer (closed at once). bytes_up / bytes_down: bytes delivered client → upstream /
        upstream → client. stalls_up / stalls_down: stalls per direction. resets: connections reset (RST), by the
        rate or on demand. reset_events: reset events (one event resets every open connection).
    """

    connections: int = 0
    active: int = 0
    upstream_failures: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    stalls_up: int = 0
    stalls_down: int = 0
    resets: int = 0
    reset_events: int = 0

    @property
    def stalls(self) -> int:
        """Stalls in both directions."""
        return self.stalls_up + self.stalls_down


class _Connection:
    """One proxied connection: its two transports, its two pump tasks and its two schedules."""

    def __init__(self, seed: int, index: int, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter):
        self.writers = (client, upstream)
        self.schedules = {"up": LinkSchedule(f"{seed}:{index}:up"), "down": LinkSchedule(f"{seed}:{index}:down")}
        self.tasks: tuple[asyncio.Task, ...] = ()
        self.closed = False

    def abort(self, rst: bool) -> None:
        """Close both sides now, with a TCP RST when ``rst``, and stop both pumps."""
        if self.closed:
            return
        self.closed = True
        for writer in self.writers:
            if rst:  # linger 0: close sends RST, not FIN
                with contextlib.suppress(OSError, AttributeError):
                    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                               struct.pack("ii", 1, 0))
            writer.transport.abort()
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()


def _parse_upstream(upstream: str | tuple[str, int]) -> tuple[str, int]:
    if isinstance(upstream, tuple):
        return upstream[0], int(upstream[1])
    host, sep, port = upstream.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"upstream must be 'host:port', got {upstream!r}")
    return host.strip("[]"), int(port)


class WanProxy:
    """Listen on ``host:listen_port`` and forward each connection to ``upstream`` through a :class:`LinkProfile`.

    Runs its own event loop in a daemon thread; every method is safe to call from any other thread.

    Args:
        listen_port: port to listen on; 0 = a free one (read :attr:`port` / :attr:`address` after :meth:`start`).
        upstream: "host:port" or (host, port) of the real server.
        profile: the link (default: a perfect one); change it live with :meth:`set_profile`.
        seed: seed of every random draw (see the module's notes on what it fixes).
        host: interface to listen on (default loopback only).
        connect_timeout_s: connecting to the upstream, s; a client whose upstream does not answer is closed.

    Raises:
        ValueError: a bad profile or upstream.

    Usage::

        with WanProxy(0, "127.0.0.1:50051", LinkProfile.symmetric(latency_ms=25, jitter_ms=5), seed=1) as wan:
            backend = GrpcBackend(wan.address)
    """

    def __init__(self, listen_port: int, upstream: str | tuple[str, int], profile: LinkProfile | None = None, *,
                 seed: int = 0, host: str = "127.0.0.1", connect_timeout_s: float = 5.0):
        self.profile = profile or LinkProfile()
        self.profile.validate()
        self.upstream = _parse_upstream(upstream)
        self.listen_port, self.host, self.seed = listen_port, host, seed
        self.connect_timeout_s = connect_timeout_s
        self.port: int | None = None
        self._stats = WanStats()
        self._conns: set[_Connection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._reset_task: asyncio.Task | None = None
        self._profile_changed: asyncio.Event | None = None
        self._armed: dict[str, Callable[[bytes], bool] | None] = {}  # direction -> which chunk resets

    @property
    def address(self) -> str:
        """"host:port" clients connect to (after :meth:`start`)."""
        return f"{self.host}:{self.port}"

    # ------------------------------------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = 10.0) -> "WanProxy":
        """Start listening; returns self. Raises OSError (e.g. the port is taken) or TimeoutError after
        ``timeout_s`` s."""
        if self._thread is not None:
            return self
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="specdec-wan-proxy", daemon=True)
        self._thread.start()
        try:
            ready.result(timeout_s)
        except BaseException:
            self._thread.join(timeout_s)
            self._thread = None
            raise
        return self

    def _run(self, ready: concurrent.futures.Future) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._on_client, self.host, self.listen_port, limit=READ_BYTES))
            self._profile_changed = asyncio.Event()
            self._reset_task = loop.create_task(self._reset_loop())
        except BaseException as exc:  # noqa: BLE001 - handed to start()
            ready.set_exception(exc)
            loop.close()
            return
        self.port = self._server.sockets[0].getsockname()[1]
        ready.set_result(None)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._shutdown())
            loop.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the listener and every connection (RST), and end the loop thread. Idempotent."""
        if self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        self._thread = None

    async def _shutdown(self) -> None:
        self._server.close()
        for conn in list(self._conns):
            conn.abort(rst=True)
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self._server.wait_closed()

    def __enter__(self) -> "WanProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------ control

    def set_profile(self, profile: LinkProfile) -> None:
        """Use ``profile`` from the next chunk on (open connections included). Raises ValueError on a bad one."""
        profile.validate()
        self.profile = profile
        if self._loop is not None and self._profile_changed is not None:
            self._loop.call_soon_threadsafe(self._profile_changed.set)

    def reset_connections(self, timeout_s: float = 5.0) -> int:
        """Reset every open connection now (TCP RST to both peers); returns how many. Raises RuntimeError when
        the proxy is not running."""
        if self._thread is None:
            raise RuntimeError("the proxy is not running")

        async def reset() -> int:
            return self._reset_all()
        return asyncio.run_coroutine_threadsafe(reset(), self._loop).result(timeout_s)

    def reset_on_next_chunk(self, direction: str = "down", match: Callable[[bytes], bool] | None = None) -> None:
        """Reset (RST to both peers) the connection that next carries a chunk in ``direction`` ("up": client →
        upstream, "down": upstream → client) for which ``match(chunk)`` is true (None: any chunk), that chunk lost:
        with "down", a request that reached the server loses its answer. Once; re-arming replaces the match.

        Raises:
            ValueError: another direction. RuntimeError: the proxy is not running.
        """
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
        if self._thread is None:
            raise RuntimeError("the proxy is not running")
        self._loop.call_soon_threadsafe(self._armed.__setitem__, direction, match)

    def stats(self) -> WanStats:
        """A copy of the counters (:class:`WanStats`)."""
        return replace(self._stats, active=len(self._conns))

    def _count(self, counter: str, n: int) -> None:
        setattr(self._stats, counter, getattr(self._stats, counter) + n)

    def _reset_all(self) -> int:
        conns = [c for c in self._conns if not c.closed]
        for conn in conns:
            conn.abort(rst=True)
        self._stats.resets += len(conns)
        self._stats.reset_events += 1
        return len(conns)

    async def _reset_loop(self) -> None:
        rng = random.Random(f"{self.seed}:resets")
        while True:
            rate = self.profile.resets_per_minute
            if rate <= 0:
                self._profile_changed.clear()
                await self._profile_changed.wait()
                continue
            await asyncio.sleep(rng.expovariate(rate / 60.0))
            if self.profile.resets_per_minute > 0:
                self._reset_all()

    # ------------------------------------------------------------------------------------------ data path

    async def _on_client(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        index = self._stats.connections
        self._stats.connections += 1
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.upstream, limit=READ_BYTES), self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError, asyncio.CancelledError) as exc:
            # a cancelled handler ends normally: asyncio's stream callback asks a cancelled task for its error
            self._stats.upstream_failures += not isinstance(exc, asyncio.CancelledError)
            client_writer.transport.abort()
            return
        conn = _Connection(self.seed, index, client_writer, up_writer)
        self._conns.add(conn)
        try:
            conn.tasks = (asyncio.create_task(self._pump(conn, client_reader, up_writer, "up")),
                          asyncio.create_task(self._pump(conn, up_reader, client_writer, "down")))
            await asyncio.gather(*conn.tasks, return_exceptions=True)
            if not conn.closed:
                conn.closed = True
                for writer in conn.writers:
                    writer.close()
        except asyncio.CancelledError:
            conn.abort(rst=True)
        finally:
            self._conns.discard(conn)

    async def _pump(self, conn: _Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    direction: str) -> None:
        """Read one direction, plan each chunk, queue it for :meth:`_send`; on an error end the connection."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(QUEUE_CHUNKS)
        sender = asyncio.create_task(self._send(queue, writer, direction))
        sender.add_done_callback(lambda t: t.cancelled() or t.exception() is None or conn.abort(rst=False))
        schedule = conn.schedules[direction]
        try:
            while True:
                data = await reader.read(READ_BYTES)
                if not data:
                    break
                if direction in self._armed and (self._armed[direction] is None or self._armed[direction](data)):
                    del self._armed[direction]
                    self._stats.resets += 1
                    self._stats.reset_events += 1
                    conn.abort(rst=True)
                    return
                toxics = self.profile.uplink if direction == "up" else self.profile.downlink
                pieces, stalled = schedule.plan(toxics, loop.time(), len(data))
                if stalled:
                    self._count(f"stalls_{direction}", 1)
                offset = 0
                for due, size in pieces:
                    await queue.put((due, data[offset:offset + size]))
                    offset += size
            await queue.put(None)
            await sender
        except (OSError, asyncio.IncompleteReadError):
            conn.abort(rst=False)
        finally:
            if not sender.done():
                sender.cancel()

    async def _send(self, queue: asyncio.Queue, writer: asyncio.StreamWriter, direction: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await queue.get()
            if item is None:
                break
            due, piece = item
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self._count(f"bytes_{direction}", len(piece))  # first: a peer that got the bytes sees them counted
            writer.write(piece)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
