"""The verifier of the edge–cloud and replay benches as a separate process: ``specdec serve`` in a subprocess, pinned
to its own core(s), ready when its gRPC health says SERVING."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

VERIFIER_STARTUP_TIMEOUT_S = 300.0
_REPO_ROOT = Path(__file__).resolve().parents[2]


class VerifierProcessError(RuntimeError):
    """The verifier subprocess of the edge–cloud bench did not start (exited, or not SERVING in time)."""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pdeathsig_preexec(cores: list[int] | None):
    """preexec_fn of the verifier child: die with the bench process (PR_SET_PDEATHSIG), and pin to ``cores``
    when taskset is not used. libc is looked up here, in the parent: the child only calls into it."""
    import signal

    prctl = None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux/glibc: best effort
        pass

    def fn():  # runs in the child between fork and exec: no imports, no locks, no logging
        if prctl is not None:
            try:
                prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
            except Exception:  # noqa: BLE001
                pass
        if cores:
            try:
                os.sched_setaffinity(0, set(cores))
            except OSError:
                pass

    return fn


class VerifierProcess:
    """``specdec serve`` in a subprocess (127.0.0.1, free port, no metrics unless asked, in-process session
    store, torch threads 1 unless asked), pinned with ``taskset -c CORES`` (or sched_setaffinity when taskset is
    missing); ready when its gRPC health says SERVING. Always stop it (:meth:`stop`, bounded waits, SIGKILL as
    last resort)."""

    def __init__(self, target_dir: Path, core: int | None, startup_timeout_s: float = VERIFIER_STARTUP_TIMEOUT_S,
                 *, cores: set[int] | None = None, metrics: bool = False, env: dict[str, str] | None = None,
                 torch_threads: int = 1):
        """``core``: pin to this core; ``cores``: pin to these cores instead (several); ``metrics``: serve
        Prometheus /metrics on a free loopback port (``metrics_url``); ``env``: extra environment (e.g.
        ``SPECDEC_MAX_BATCH_SIZE``, ``SPECDEC_DEVICE``); ``torch_threads``: torch / OpenMP threads."""
        self.target_dir = Path(target_dir)
        self.core = core
        self.cores = sorted(cores) if cores else ([core] if core is not None else None)
        self.metrics = metrics
        self.metrics_url: str | None = None
        self.extra_env = dict(env or {})
        self.torch_threads = max(1, int(torch_threads))
        self.startup_timeout_s = startup_timeout_s
        self.proc = None
        self.address: str | None = None
        self.log_path: Path | None = None
        self.command: list[str] = []
        self.pinned_with: str | None = None
        self.affinity: list[int] | None = None

    def _log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:].strip() if self.log_path else ""
        except OSError:
            return ""

    def start(self) -> str:
        """Start and wait until SERVING; returns "127.0.0.1:PORT". Raises VerifierProcessError (the process is
        stopped first)."""
        import shutil
        import subprocess
        import tempfile

        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        env = dict(os.environ)
        for k in ("SPECDEC_REDIS_URL", "SPECDEC_HOST", "SPECDEC_PORT", "SPECDEC_METRICS_PORT", "SPECDEC_TARGET"):
            env.pop(k, None)  # no Redis: the in-process session store; the rest comes from the command line
        threads = str(self.torch_threads)
        env.update(
            SPECDEC_TORCH_THREADS=threads, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, SPECDEC_GRACE_PERIOD_S="2",
            HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH", "")) if p),
        )
        env.update(self.extra_env)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        taskset = shutil.which("taskset") if self.cores else None
        for attempt in range(3):  # a free port can be taken between probing and binding: retry on bind errors
            port = _free_port()
            metrics_port = _free_port() if self.metrics else 0
            cmd = [sys.executable, "-m", "specdec.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                   "--metrics-port", str(metrics_port), "--target", str(self.target_dir)]
            self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else None
            if taskset:
                cmd = [taskset, "-c", ",".join(str(c) for c in self.cores)] + cmd
                self.pinned_with = "taskset"
            elif self.cores:
                self.pinned_with = "sched_setaffinity"
            self.command = cmd
            fd, name = tempfile.mkstemp(prefix="specdec-bench-verifier-", suffix=".log")
            self.log_path = Path(name)
            with os.fdopen(fd, "wb") as log_file:
                self.proc = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                    cwd=str(_REPO_ROOT), preexec_fn=_pdeathsig_preexec(None if taskset else self.cores),
                )
            self.address = f"127.0.0.1:{port}"
            try:
                self._wait_serving(grpc, health_pb2, health_pb2_grpc)
                break
            except VerifierProcessError:
                tail = self._log_tail()
                self.stop()
                if ("cannot bind" in tail or "cannot serve metrics" in tail) and attempt < 2:
                    continue
                raise
            except BaseException:
                self.stop()
                raise
        with contextlib.suppress(OSError):
            self.affinity = sorted(os.sched_getaffinity(self.proc.pid))
        return self.address

    def _wait_serving(self, grpc, health_pb2, health_pb2_grpc) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        channel = grpc.insecure_channel(self.address)
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="specdec.v1.Verifier")
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    raise VerifierProcessError(
                        f"verifier process exited with status {rc} before serving; its log:\n{self._log_tail()}"
                    )
                try:
                    if stub.Check(request, timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise VerifierProcessError(
                        f"verifier not SERVING within {self.startup_timeout_s:.0f} s; its log:\n{self._log_tail()}"
                    )
                time.sleep(0.25)
        finally:
            channel.close()

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM (graceful stop, grace 2 s), then SIGKILL after ``timeout_s``; returns the exit status."""
        import subprocess

        proc = self.proc
        if proc is None:
            return None
        try:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("verifier process %d did not stop in %.0f s: killing it", proc.pid, timeout_s)
                    proc.kill()
                    proc.wait(timeout=10.0)
        finally:
            self.proc = None
        return proc.returncode

    def remove_log(self) -> None:
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                self.log_path.unlink()
