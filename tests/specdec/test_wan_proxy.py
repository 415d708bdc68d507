"""The dialled WAN (specdec.netem): its schedule as a pure function of the seed, then measured through real sockets
on 127.0.0.1 (one-way latency per direction against an echo server that stamps arrivals on the same clock,
a bandwidth cap against a bulk transfer, stalls, resets on demand and at a rate), and a real gRPC generation
through a lossy, jittery link that stays token-identical to target-only decoding.

Tolerances are for a loaded 2-core machine: the proxy never delivers early, so lower bounds are tight; upper
bounds leave room for event-loop wake-ups."""

from __future__ import annotations

import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import pytest

from specdec.netem import DirectionProfile, LinkProfile, LinkSchedule, WanProxy

pytestmark = pytest.mark.timeout(120)


class _Echo:
    """A TCP echo server on 127.0.0.1 that records when each chunk arrived (time.monotonic, s)."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.arrivals: list[float] = []
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while data := conn.recv(65536):
                self.arrivals.append(time.monotonic())
                conn.sendall(data)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.listener.close()
        for conn in self._conns:
            try:
                conn.close()
            except OSError:
                pass


@pytest.fixture()
def echo():
    server = _Echo()
    yield server
    server.close()


def _ping(sock: socket.socket, payload: bytes = b"x" * 32) -> float:
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        assert chunk, "connection closed"
        got += chunk
    return time.monotonic()


# ---------------------------------------------------------------------------------------------- the schedule


def test_schedule_is_a_function_of_the_seed():
    profile = DirectionProfile(latency_ms=20, jitter_ms=5, bandwidth_kbps=800, stall_probability=0.3, stall_ms=50)
    arrivals = [(0.01 * i, 100 + 300 * i) for i in range(30)]

    def run(seed):
        schedule = LinkSchedule(seed)
        return [schedule.plan(profile, t, n) for t, n in arrivals]

    assert run("7:0:up") == run("7:0:up")
    assert run("7:0:up") != run("8:0:up")
    dues = [due for pieces, _ in run("7:0:up") for due, _ in pieces]
    assert dues == sorted(dues)  # order kept, whatever the jitter
    assert sum(stalled for _, stalled in run("7:0:up")) > 0


def test_schedule_latency_jitter_bandwidth_stall():
    schedule = LinkSchedule(1)
    delays = [schedule.plan(DirectionProfile(latency_ms=30, jitter_ms=10), 10.0 * i, 1)[0][0][0] - 10.0 * i
              for i in range(200)]
    assert 0.020 <= min(delays) and max(delays) <= 0.040 and max(delays) - min(delays) > 0.015
    # 10 kB at 800 kbit/s take 100 ms, cut into 20 ms pieces of 2 kB; latency comes on top
    pieces, _ = LinkSchedule(1).plan(DirectionProfile(latency_ms=5, bandwidth_kbps=800), 0.0, 10_000)
    assert [size for _, size in pieces] == [2000] * 5
    assert pieces[-1][0] == pytest.approx(0.105)
    pieces, stalled = LinkSchedule(1).plan(DirectionProfile(stall_probability=1.0, stall_ms=200), 0.0, 10)
    assert stalled and pieces[0][0] == pytest.approx(0.2)


def test_bad_profiles_and_upstreams_are_refused():
    with pytest.raises(ValueError, match="latency_ms"):
        LinkProfile.symmetric(latency_ms=-1).validate()
    with pytest.raises(ValueError, match="stall_probability"):
        WanProxy(0, "127.0.0.1:1", LinkProfile.symmetric(stall_probability=1.5))
    with pytest.raises(ValueError, match="resets_per_minute"):
        LinkProfile(resets_per_minute=float("inf")).validate()
    with pytest.raises(ValueError, match="host:port"):
        WanProxy(0, "nowhere")


# ---------------------------------------------------------------------------------------------- through sockets


def test_one_way_latency_per_direction(echo):
    """Uplink 40 ± 5 ms, downlink 15 ms: each direction measured on its own (the echo stamps arrivals)."""
    profile = LinkProfile(DirectionProfile(latency_ms=40, jitter_ms=5), DirectionProfile(latency_ms=15))
    up, down = [], []
    with WanProxy(0, ("127.0.0.1", echo.port), profile, seed=3) as wan, \
            socket.create_connection(("127.0.0.1", wan.port), timeout=5) as sock:
        for _ in range(20):
            sent = time.monotonic()
            received = _ping(sock)
            arrived = echo.arrivals[-1]
            up.append((arrived - sent) * 1000)
            down.append((received - arrived) * 1000)
        stats = wan.stats()
    print(f"uplink asked 40±5 ms: median {statistics.median(up):.1f} min {min(up):.1f} max {max(up):.1f}; "
          f"downlink asked 15 ms: median {statistics.median(down):.1f} min {min(down):.1f} max {max(down):.1f}")
    assert min(up) >= 34.0 and statistics.median(up) <= 50.0 and max(up) - min(up) > 2.0  # jitter shows
    assert min(down) >= 14.0 and statistics.median(down) <= 25.0
    assert stats.bytes_up == stats.bytes_down == 20 * 32 and stats.connections == 1 and stats.stalls == 0


def test_bandwidth_caps_throughput(echo):
    """250 kB through a 2,000 kbit/s uplink take about 1 s (the downlink is free)."""
    cap_kbps, total = 2000, 250_000
    profile = LinkProfile(uplink=DirectionProfile(bandwidth_kbps=cap_kbps))
    with WanProxy(0, ("127.0.0.1", echo.port), profile, seed=0) as wan, \
            socket.create_connection(("127.0.0.1", wan.port), timeout=10) as sock:
        start = time.monotonic()
        sender = threading.Thread(target=sock.sendall, args=(b"b" * total,), daemon=True)
        sender.start()
        got = 0
        while got < total:
            chunk = sock.recv(65536)
            assert chunk
            got += len(chunk)
        elapsed = time.monotonic() - start
        sender.join(5)
    kbps = total * 8 / elapsed / 1000
    print(f"throughput {kbps:.0f} kbit/s through a {cap_kbps} kbit/s cap ({elapsed:.2f} s for {total} B)")
    assert 0.6 * cap_kbps <= kbps <= 1.05 * cap_kbps


def test_stalls_hold_the_link(echo):
    profile = LinkProfile.symmetric(stall_probability=1.0, stall_ms=150)
    with WanProxy(0, ("127.0.0.1", echo.port), profile, seed=0) as wan, \
            socket.create_connection(("127.0.0.1", wan.port), timeout=5) as sock:
        sent = time.monotonic()
        rtt_ms = (_ping(sock) - sent) * 1000
        stats = wan.stats()
    assert rtt_ms >= 299.0 and stats.stalls_up == stats.stalls_down == 1


def test_the_link_is_dialled_live(echo):
    """set_profile applies to an open connection from its next chunk."""
    wan = WanProxy(0, ("127.0.0.1", echo.port), seed=0).start()
    try:
        with socket.create_connection(("127.0.0.1", wan.port), timeout=5) as sock:
            sent = time.monotonic()
            assert (_ping(sock) - sent) * 1000 < 25.0
            wan.set_profile(LinkProfile(uplink=DirectionProfile(latency_ms=30)))
            sent = time.monotonic()
            assert (_ping(sock) - sent) * 1000 >= 29.0
            with pytest.raises(ValueError):
                wan.set_profile(LinkProfile.symmetric(jitter_ms=float("nan")))
    finally:
        wan.stop()
        wan.stop()  # idempotent
    with pytest.raises(RuntimeError):
        wan.reset_connections()


def test_reset_on_demand_closes_the_connection_and_the_link_recovers(echo):
    with WanProxy(0, ("127.0.0.1", echo.port), LinkProfile.symmetric(latency_ms=5), seed=0) as wan:
        with socket.create_connection(("127.0.0.1", wan.port), timeout=5) as sock:
            _ping(sock)
            assert wan.reset_connections() == 1
            with pytest.raises(ConnectionResetError):
                sock.recv(10)  # the RST reached the client
        with socket.create_connection(("127.0.0.1", wan.port), timeout=5) as sock:
            _ping(sock)  # a new connection goes through
            seen = len(echo.arrivals)
            wan.reset_on_next_chunk("down")
            sock.sendall(b"lost answer")
            with pytest.raises(ConnectionResetError):
                sock.recv(10)
            assert len(echo.arrivals) == seen + 1  # the request reached the server, its answer did not come back
        stats = wan.stats()
    assert stats.resets == 2 and stats.reset_events == 2 and stats.connections == 2
    assert stats.bytes_up == 2 * 32 + len(b"lost answer") and stats.bytes_down == 2 * 32


def test_resets_at_a_rate_and_a_dead_upstream(echo):
    with WanProxy(0, ("127.0.0.1", echo.port), LinkProfile(resets_per_minute=600), seed=0) as wan:
        with socket.create_connection(("127.0.0.1", wan.port), timeout=5) as sock:
            deadline = time.monotonic() + 5.0  # mean gap 0.1 s
            with pytest.raises(OSError):
                while time.monotonic() < deadline:
                    _ping(sock)
                    time.sleep(0.01)
        assert wan.stats().resets >= 1
    dead = socket.create_server(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()
    with WanProxy(0, ("127.0.0.1", dead_port), seed=0) as wan, \
            socket.create_connection(("127.0.0.1", wan.port), timeout=5) as sock:
        try:
            data = sock.recv(10)
        except ConnectionResetError:
            data = b""
        assert data == b""  # closed at once: nothing to forward to
        assert wan.stats().upstream_failures == 1


def test_module_entry_runs_a_proxy(echo):
    """``python -m specdec.netem``: prints its address, forwards, prints the counters on SIGINT, exits 0."""
    proc = subprocess.Popen([sys.executable, "-m", "specdec.netem", "--upstream", f"127.0.0.1:{echo.port}",
                             "--latency-ms", "5", "--seed", "1", "--report-s", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        host, port = proc.stdout.readline().split(" ", 1)[0].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sent = time.monotonic()
            assert (_ping(sock) - sent) * 1000 >= 9.0
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert proc.returncode == 0, err
    assert "bytes_up=32" in out and "bytes_down=32" in out
    bad = subprocess.run([sys.executable, "-m", "specdec.netem", "--upstream", "nowhere"], capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 2 and "host:port" in bad.stderr


# ---------------------------------------------------------------------------------------------- real gRPC


def _carries_http2_data(chunk: bytes) -> bool:
    """Whether a chunk read from a gRPC connection holds a non-empty HTTP/2 DATA frame (a message), reading the
    frames from the chunk's start (9-byte headers: 3-byte length, type, flags, stream id)."""
    i = 0
    while i + 9 <= len(chunk):
        length = int.from_bytes(chunk[i:i + 3], "big")
        if chunk[i + 3] == 0 and length > 0:
            return True
        i += 9 + length
    return False


def test_generation_through_a_lossy_wan_is_target_only(tiny_pair):
    """EdgeClient → WanProxy (10 ± 5 ms each way, 5 % stalls of 200 ms, one reset that loses a verdict) →
    verifier: the greedy output is token-identical to target-only, every token verified."""
    from _reference import hf_greedy
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec.embedded import EmbeddedServer

    model = OnnxDraftModel(tiny_pair.draft_dir)
    prompt_ids = encode_prompt(model.tokenizer, "Tell me a story about a robot who learns to paint.")
    expected = hf_greedy(tiny_pair.target_dir, prompt_ids, 48)
    verifier = Verifier(TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=4096), max_batch_wait_ms=1.0)
    profile = LinkProfile.symmetric(latency_ms=10, jitter_ms=5, stall_probability=0.05, stall_ms=200)
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address, \
            WanProxy(0, address, profile, seed=7) as wan:  # seed 7: connection 0 stalls early in both directions
        backend = FailoverBackend(wan.address, policy=RetryPolicy(connect_timeout_s=5.0, budget_s=20.0), seed=0)
        with EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=2) as client:
            start = time.monotonic()
            stream = client.stream_chunks(prompt_ids, max_new_tokens=48, ignore_eos=True)
            for _ in range(5):
                next(stream)
            # the next verdict is lost with its connection (not a PING or WINDOW_UPDATE while no block waits)
            wan.reset_on_next_chunk("down", match=_carries_http2_data)
            rest = list(stream)
            elapsed = time.monotonic() - start
            result = client.last_result
        stats = wan.stats()
    print(f"generation through the WAN: {elapsed:.2f} s, {backend.num_failovers} failovers, "
          f"{result.num_sessions} sessions, {stats}")
    assert rest and result.token_ids == expected
    assert result.num_unverified_tokens == 0 and backend.num_failovers >= 1  # the reset hit a live stream
    assert stats.resets >= 1 and stats.connections >= 2 and stats.stalls >= 1


def test_the_lost_verdict_of_the_last_block_is_rebuilt(tiny_pair):
    """The verdict that finishes the session is lost with its connection: the retried block meets a finished
    session (refused as such), and the SDK rebuilds the verdict from the store instead of failing; output
    identical to the same generation without the loss."""
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec.embedded import EmbeddedServer

    model = OnnxDraftModel(tiny_pair.draft_dir)
    ids = encode_prompt(model.tokenizer, "Name a color.")
    verifier = Verifier(TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=4096), max_batch_wait_ms=1.0)
    results, chunks = {}, {}
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address, WanProxy(0, address, seed=0) as wan:
        for lose_last in (False, True):
            backend = FailoverBackend(wan.address, policy=RetryPolicy(connect_timeout_s=5.0, budget_s=20.0), seed=0)
            with EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=2) as client:
                stream = client.stream_chunks(ids, max_new_tokens=12, ignore_eos=True)
                n = 0
                if lose_last:
                    for _ in range(chunks[False] - 1):
                        next(stream)
                        n += 1
                    wan.reset_on_next_chunk("down", match=_carries_http2_data)
                n += sum(1 for _ in stream)
                chunks[lose_last], results[lose_last] = n, client.last_result
    assert wan.stats().resets == 1
    assert results[True].token_ids == results[False].token_ids and len(results[True].token_ids) == 12
    assert results[True].finish_reason == results[False].finish_reason
