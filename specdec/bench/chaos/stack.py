"""The chaos bench's loopback deployment: a Redis HA topology (:mod:`specdec.bench.chaos.redis_topology`), N
`specdec serve` replicas sharing it (each restartable on its own port) and a WAN proxy (:class:`specdec.netem.
WanProxy`) in front of each replica. Clients are given the proxies' addresses only, so every gRPC byte crosses
an emulated WAN. Every process is ended by its own pid (:meth:`Stack.stop`)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench.chaos.procs import free_port, stop_process, wait_until

START_TIMEOUT_S = 180.0  # a replica loads torch + the target: ~10 s on 2 busy cores, more under load
BASE_LATENCY_MS = 2.0  # one-way latency of the WAN proxies between faults, ms
_REPO_ROOT = Path(__file__).resolve().parents[3]


def health_status(address: str, timeout_s: float = 1.0) -> str:
    """The readiness status name of the verifier at ``address`` ("UNREACHABLE" when the call fails)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="specdec.v1.Verifier"), timeout=timeout_s)
        except grpc.RpcError:
            return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def rss_bytes(pid: int) -> int | None:
    """Resident set size of process ``pid``, bytes (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None



def _spawn_cli(args: list[str], log_path: Path, env: dict) -> subprocess.Popen:
    """``specdec <args>`` as a child process from the repository root, stdout and stderr appended to ``log_path``."""
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "specdec.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=str(_REPO_ROOT))

@dataclass
class ServeReplica:
    """One `specdec serve` process on a fixed port (it comes back on the same port after a restart)."""

    verifier_id: str
    env: dict
    log_path: Path
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    starts: int = 0
    serving_since: float | None = None  # monotonic time this start turned SERVING (None: not yet)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = _spawn_cli(["serve", "--host", "127.0.0.1", "--port", str(self.port), "--metrics-port",
                                str(self.metrics_port)], self.log_path, self.env)
        self.starts += 1
        self.serving_since = None

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Raises RuntimeError when the process exits or is not SERVING within ``timeout_s`` (log attached)."""
        if not wait_until(lambda: not self.alive() or health_status(self.address, 0.5) == "SERVING", timeout_s,
                          step_s=0.2) or not self.alive():
            raise RuntimeError(f"replica {self.verifier_id} did not become SERVING:\n{self.log()}")
        self.serving_since = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics (empty when the replica does not answer)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return {}
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+) ([0-9.e+-]+)$", text, re.MULTILINE)}


@dataclass
class EdgeServe:
    """One `specdec edge-serve` process (the OpenAI-compatible endpoint on the device) over every replica's WAN
    proxy, with the bench sessions' failover retry policy (it rides out a replica restart, a Redis promotion)."""

    argv: list[str]
    env: dict
    log_path: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    serving_since: float | None = None  # monotonic time it first answered /v1/models
    model_id: str = "chaos"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        self.proc = _spawn_cli(["edge-serve", "--host", "127.0.0.1", "--port", str(self.port), "--model-name",
                                self.model_id, *self.argv], self.log_path, self.env)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/models", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Raises RuntimeError when the process exits or does not answer within ``timeout_s`` (log attached)."""
        if not wait_until(lambda: not self.alive() or self._answers(), timeout_s, step_s=0.3) or not self.alive():
            raise RuntimeError(f"edge-serve did not answer:\n{self.log_path.read_text(errors='replace')[-4000:]}")
        self.serving_since = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class StackConfig:
    """What :class:`Stack` starts. ``kv_cache_budget_tokens``: each replica's KV pool (small: preemption);
    ``session_ttl_s``: the store's session TTL (orphans of a killed client or replica expire after it);
    ``edge_serve_draft_dir``: also an :class:`EdgeServe` with this draft (None: none)."""

    store: str
    target_dir: Path
    num_replicas: int = 2
    kv_cache_budget_tokens: int = 192
    session_ttl_s: int = 20
    seed: int = 0
    edge_serve_draft_dir: Path | None = None  # start an edge-serve process with this draft (None: none)


class Stack:
    """Redis HA + replicas + WAN proxies on 127.0.0.1; :meth:`start`, then :meth:`stop` (always)."""

    def __init__(self, config: StackConfig):
        from specdec.bench.chaos.redis_topology import binaries

        if config.store not in ("sentinel", "cluster"):
            raise ValueError(f"--store must be sentinel or cluster, got {config.store!r}")
        found = binaries()
        if found is None:
            raise FileNotFoundError("the chaos bench needs redis-server and redis-cli on PATH (Debian: redis-server)")
        self.config = config
        self.binaries = found
        self.workdir = Path(tempfile.mkdtemp(prefix="specdec-chaos-"))
        self.prefix = f"specdec-chaos:{os.getpid()}:{config.seed}:"
        self.redis = None
        self.replicas: list[ServeReplica] = []
        self.proxies = []
        self.edge_serve: EdgeServe | None = None

    @property
    def addresses(self) -> list[str]:
        """The WAN proxies' addresses, one per replica (what clients are given)."""
        return [p.address for p in self.proxies]

    def start(self) -> Stack:
        from specdec.bench.chaos.redis_topology import ClusterSet, SentinelSet
        from specdec.netem import WanProxy

        if self.config.store == "sentinel":  # 2 replicas: WAIT 1 still confirmed with one of them down
            self.redis = SentinelSet(*self.binaries, num_replicas=2, down_after_ms=1000).start()
        else:
            self.redis = ClusterSet(*self.binaries, replicas_per_master=1, node_timeout_ms=1000).start()
        env = {**os.environ, "SPECDEC_TARGET": str(self.config.target_dir), "SPECDEC_REDIS_URL": self.redis.url,
               "SPECDEC_REDIS_PREFIX": self.prefix, "SPECDEC_MAX_BATCH_WAIT_MS": "1", "SPECDEC_TORCH_THREADS": "1",
               "OMP_NUM_THREADS": "1", "SPECDEC_GRACE_PERIOD_S": "3", "OMP_WAIT_POLICY": "PASSIVE",
               "SPECDEC_KV_CACHE_BUDGET_TOKENS": str(self.config.kv_cache_budget_tokens),
               "SPECDEC_SESSION_TTL_S": str(self.config.session_ttl_s), "SPECDEC_REAP_INTERVAL_S": "1",
               "SPECDEC_HEALTH_CHECK_INTERVAL_S": "0.2", "SPECDEC_REDIS_SOCKET_TIMEOUT_S": "0.5",
               "SPECDEC_REDIS_WAIT_REPLICAS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (str(_REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        for i in range(self.config.num_replicas):
            vid = f"chaos-{chr(97 + i)}"
            self.replicas.append(ServeReplica(vid, {**env, "SPECDEC_VERIFIER_ID": vid}, self.workdir / f"{vid}.log"))
        for r in self.replicas:
            r.start()
        for r in self.replicas:
            r.wait_serving()
        for i, r in enumerate(self.replicas):
            self.proxies.append(WanProxy(0, r.address, self.base_profile(), seed=self.config.seed * 100 + i).start())
        if self.config.edge_serve_draft_dir is not None:
            self._start_edge_serve(env)
        return self

    def _start_edge_serve(self, env: dict) -> None:
        # the sessions' RetryPolicy (workload.session_worker): a replica's restart and a promotion fit its budget;
        # no kept conversations: each request is a session of its own, as the SDK sessions' requests are
        argv = ["--server", ",".join(self.addresses), "--target", str(self.config.target_dir), "--draft",
                str(self.config.edge_serve_draft_dir), "--num-speculative-tokens", "3", "--max-conversations", "0",
                "--retry-max-attempts", "200", "--retry-budget-s", "120"]
        self.edge_serve = EdgeServe(argv, {k: v for k, v in env.items() if k != "SPECDEC_EDGE_API_KEY"},
                                    self.workdir / "edge-serve.log")
        self.edge_serve.start()
        self.edge_serve.wait_serving()

    @staticmethod
    def base_profile():
        from specdec.netem import LinkProfile

        return LinkProfile.symmetric(latency_ms=BASE_LATENCY_MS, jitter_ms=1.0)

    def restart_replica(self, replica: ServeReplica, sig: int, downtime_s: float = 0.5) -> None:
        """``sig`` (SIGKILL: a crash; SIGTERM: a drain), wait for the exit, ``downtime_s`` s, start on the same
        port, wait until SERVING."""
        replica.signal(sig)
        replica.proc.wait(timeout=60 if sig == signal.SIGTERM else 10)
        time.sleep(downtime_s)
        replica.start()
        replica.wait_serving()

    def store_keys(self) -> int:
        """Keys under this run's prefix, over every master."""
        import redis

        ports = ([self.redis.master_port()] if self.config.store == "sentinel"
                 else [n.port for n in self.redis.nodes if n.alive() and self.redis.role(n) == "master"])
        total = 0
        for port in ports:
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
            total += sum(1 for _ in client.scan_iter(match=f"{self.prefix}*", count=1000))
            client.close()
        return total

    def stop(self) -> None:
        if self.edge_serve is not None and self.edge_serve.proc is not None:
            stop_process(self.edge_serve.proc, timeout_s=15.0)
        for p in self.proxies:
            p.stop()
        for r in self.replicas:
            if r.proc is not None:
                stop_process(r.proc, timeout_s=15.0)
        if self.redis is not None:
            self.redis.stop()
