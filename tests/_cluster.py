"""Real processes for failure tests: `specdec serve` replicas, a private redis-server, nginx from
deploy/nginx/nginx.conf. Everything on 127.0.0.1, free ports, bounded waits; every process is ended by the
fixture that started it (by its own pid)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench.chaos.procs import free_port, stop_process, wait_until

ROOT = Path(__file__).resolve().parents[1]
NGINX_CONF = ROOT / "deploy" / "nginx" / "nginx.conf"
START_TIMEOUT_S = 120.0  # a replica loads torch + the target: ~10 s on 2 busy cores


def health_status(address: str, service: str = "specdec.v1.Verifier", timeout_s: float = 1.0) -> str:
    """The health status name of ``service`` at ``address`` ("UNREACHABLE" when the call fails)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                     timeout=timeout_s)
        except grpc.RpcError:
            return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


@dataclass
class Replica:
    """One `specdec serve` subprocess."""

    verifier_id: str
    port: int
    metrics_port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metric(self, name: str) -> float:
        """A counter/gauge value from /metrics (0 when absent)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def start_replicas(n: int, target_dir: Path, redis_url: str, prefix: str, workdir: Path, *,
                   env: dict | None = None, names: list[str] | None = None,
                   wait_serving: bool = True) -> list[Replica]:
    """Start ``n`` `specdec serve` replicas (in parallel) sharing Redis; return once all answer SERVING
    (``wait_serving``; else at once).

    Raises:
        RuntimeError: a replica exited or did not become SERVING within START_TIMEOUT_S (its log attached).
    """
    replicas = []
    for i in range(n):
        vid = (names or [f"replica-{chr(97 + i)}" for _ in range(n)])[i]
        port, metrics_port = free_port(), free_port()
        log_path = workdir / f"{vid}.log"
        full_env = {**os.environ, "SPECDEC_TARGET": str(target_dir), "SPECDEC_REDIS_URL": redis_url,
                    "SPECDEC_REDIS_PREFIX": prefix, "SPECDEC_VERIFIER_ID": vid, "SPECDEC_MAX_BATCH_WAIT_MS": "1",
                    "SPECDEC_TORCH_THREADS": "1", "SPECDEC_GRACE_PERIOD_S": "10", "OMP_WAIT_POLICY": "PASSIVE",
                    **(env or {})}
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "specdec.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                 "--metrics-port", str(metrics_port)],
                stdout=logf, stderr=subprocess.STDOUT, env=full_env, cwd=str(ROOT),
            )
        replicas.append(Replica(vid, port, metrics_port, proc, log_path))
    if not wait_serving:
        return replicas
    deadline = time.monotonic() + START_TIMEOUT_S
    for r in replicas:
        while health_status(r.address, timeout_s=0.5) != "SERVING":
            if not r.alive() or time.monotonic() > deadline:
                for other in replicas:
                    stop_process(other)
                raise RuntimeError(f"replica {r.verifier_id} did not start:\n{r.log()}")
            time.sleep(0.2)
    return replicas


@dataclass
class PrivateRedis:
    """A redis-server subprocess on a fixed free port, no persistence: stop/start it to simulate an outage or
    a restart with an empty memory."""

    binary: str
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    data_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="specdec-redis-"))  # dump.rdb here

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "PrivateRedis":
        import redis

        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.data_dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

        def answers() -> bool:
            try:
                return bool(redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5).ping())
            except Exception:  # noqa: BLE001
                return False

        if not wait_until(answers, 10.0):
            raise RuntimeError("redis-server did not start")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None
        dump = Path(self.data_dir) / "dump.rdb"
        if dump.exists():  # a plain stop loses the data, as documented
            dump.unlink()

    def restart_keeping_data(self, downtime_s: float) -> None:
        """SHUTDOWN SAVE (every write answered so far is in the dump: no write slips in between), stay down for
        ``downtime_s`` s, start again on the same port from the dump."""
        import redis

        try:
            redis.Redis(port=self.port, socket_timeout=5).shutdown(save=True)
        except redis.exceptions.ConnectionError:
            pass  # the server closes the connection as it exits
        self.proc.wait(timeout=10)
        self.proc = None
        time.sleep(downtime_s)
        self.start()


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                          if os.access(p, os.X_OK)), None)


def render_nginx_conf(upstreams: list[str], port: int, workdir: Path) -> str:
    """deploy/nginx/nginx.conf with the test's upstream servers, listen address, pid, error log and temp paths
    in ``workdir`` (every balancing directive as shipped).

    Raises:
        AssertionError: the shipped file no longer has the expected lines (upstream servers, listen, pid).
    """
    conf = NGINX_CONF.read_text()
    servers = re.findall(r"^\s*server ([\w.-]+:\d+)( [^;]*)?;", conf, re.M)
    assert len(servers) >= 2, "deploy/nginx/nginx.conf: expected >= 2 upstream servers"
    params = servers[0][1]
    block = "".join(f"        server {u}{params};\n" for u in upstreams)
    conf, n = re.subn(r"(^\s*server [\w.-]+:\d+( [^;]*)?;\n)+", block, conf, count=1, flags=re.M)
    assert n == 1
    conf, n = re.subn(r"listen \d+ http2;", f"listen 127.0.0.1:{port} http2;", conf)
    assert n == 1
    conf, n = re.subn(r"^pid .*;$", f"pid {workdir}/nginx.pid;", conf, flags=re.M)
    assert n == 1
    conf = re.sub(r"^error_log .*;$", f"error_log {workdir}/error.log info;", conf, flags=re.M)
    temps = "".join(f"    {k}_temp_path {workdir}/{k};\n" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return conf.replace("http {\n", "http {\n" + temps, 1)


def start_nginx(binary: str, upstreams: list[str], workdir: Path) -> tuple[subprocess.Popen, int]:
    """nginx in the foreground with the rendered config; returns (process, port) once it accepts connections."""
    port = free_port()
    conf_path = workdir / "nginx.conf"
    conf_path.write_text(render_nginx_conf(upstreams, port, workdir))
    proc = subprocess.Popen([binary, "-c", str(conf_path), "-p", str(workdir), "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=open(workdir / "nginx.stderr", "wb"))

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return proc.poll() is not None

    if not wait_until(listening, 10.0) or proc.poll() is not None:
        err = (workdir / "nginx.stderr").read_text(errors="replace")
        stop_process(proc)
        raise RuntimeError(f"nginx did not start: {err}")
    return proc, port


def kill(replica: Replica, sig: int = signal.SIGKILL) -> None:
    os.kill(replica.proc.pid, sig)


class ForwardGate:
    """Holds the target's forward passes (a forward pre-hook on the runner's decoder) until :meth:`release`: a
    real forward pass, paused at its start, to put a block "in the forward pass" at a known moment.

    ``entered`` is set when a forward pass reached the gate; waits are bounded by ``timeout_s``.
    """

    def __init__(self, runner, timeout_s: float = 60.0):
        import threading

        self.entered = threading.Event()
        self._released = threading.Event()
        self.timeout_s = timeout_s
        self._handle = runner.model.get_decoder().register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.entered.set()
        self._released.wait(self.timeout_s)

    def release(self) -> None:
        self._released.set()
        self._handle.remove()

    def __enter__(self) -> "ForwardGate":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class ServerOnPort:
    """A real verifier gRPC server (cloud_verifier.serving.server.VerifierServer) on a given 127.0.0.1 port, in a
    background thread with its own event loop: a verifier that appears on an address that was closed."""

    def __init__(self, verifier, port: int, grace_s: float = 1.0, **server_kw):
        import asyncio
        import threading

        from specdec_runtime.cloud_verifier.serving.server import VerifierServer

        self.port = port
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop = None
        self._stop = None

        async def main():
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self.server = VerifierServer(verifier, host="127.0.0.1", port=port, grace_s=grace_s, **server_kw)
            try:
                await self.server.start()
            except BaseException as e:  # noqa: BLE001
                self._error = e
                self._ready.set()
                return
            self._ready.set()
            await self._stop.wait()
            await self.server.stop()

        self._thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        self._thread.start()
        if not self._ready.wait(60) or self._error is not None:
            raise RuntimeError(f"server did not start on port {port}: {self._error}")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:
                pass
        self._thread.join(timeout_s)
