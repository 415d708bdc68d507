"""Redis without a single point of failure, as real processes on 127.0.0.1 (the chaos bench, the failure tests): a Sentinel set (1 master,
N replicas, 3 sentinels) and a Cluster (3 masters, optionally a replica each). Free ports, a private temp dir,
bounded waits; every process is ended by its own pid (:meth:`stop`)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench.chaos.procs import free_port, stop_process, wait_until

SERVICE = "mymaster"


def binaries() -> tuple[str, str] | None:
    """(redis-server, redis-cli), or None when either is missing."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    return (server, cli) if server and cli else None


def _cluster_port() -> int:
    """A free port P <= 55535 whose cluster bus port P + 10000 is free too."""
    import random
    import socket

    for _ in range(200):
        port = random.randint(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


def _client(port: int, timeout_s: float = 0.5):
    import redis

    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


def _answers(port: int) -> bool:
    try:
        return bool(_client(port).ping())
    except Exception:  # noqa: BLE001
        return False


@dataclass
class Node:
    """One redis-server (or sentinel) process."""

    port: int
    proc: subprocess.Popen
    argv: list[str] = field(default_factory=list)  # the command line, to start it again on the same port
    log_path: Path | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, by pid: the crash case (no shutdown, no last write flushed to replicas)."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def start_again(self) -> None:
        """Start the same command line again (same port, same config and dump file names)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)


@dataclass
class _Procs:
    server: str
    cli: str
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="specdec-redis-ha-")))
    nodes: list[Node] = field(default_factory=list)

    def _start(self, args: list[str], name: str, port: int | None = None) -> Node:
        port = port or free_port()
        log_path = self.workdir / f"{name}-{port}.log"
        # a dump file per node: a replica writes the master's RDB to its own dbfilename on a full sync
        argv = [self.server, *args, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--dbfilename", f"dump-{port}.rdb"]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        node = Node(port, proc, argv, log_path)
        self.nodes.append(node)
        if not wait_until(lambda: _answers(port) or not node.alive(), 10.0) or not node.alive():
            raise RuntimeError(f"{name} on port {port} did not start: {self.log(name, port)}")
        return node

    def log(self, name: str, port: int) -> str:
        path = self.workdir / f"{name}-{port}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self) -> None:
        for node in self.nodes:
            stop_process(node.proc, timeout_s=5.0)
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class SentinelSet(_Procs):
    """1 master, ``num_replicas`` replicas, 3 sentinels (quorum 2) watching service ``mymaster``;
    ``down_after_ms``: how long a silent master takes to be declared down."""

    num_replicas: int = 1
    down_after_ms: int = 1000
    master: Node | None = None
    replicas: list[Node] = field(default_factory=list)
    sentinels: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels) + f"/{SERVICE}/0"

    def start(self) -> "SentinelSet":
        self.master = self._start([], "master")
        for _ in range(self.num_replicas):
            self.replicas.append(self._start(["--replicaof", "127.0.0.1", str(self.master.port),
                                              "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"],
                                             "replica"))
        for i in range(3):
            port = free_port()
            conf = self.workdir / f"sentinel-{i}.conf"
            conf.write_text(f"sentinel monitor {SERVICE} 127.0.0.1 {self.master.port} 2\n"
                            f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
                            f"sentinel failover-timeout {SERVICE} 10000\nsentinel parallel-syncs {SERVICE} 1\n")
            log_path = self.workdir / f"sentinel-{port}.log"
            argv = [self.server, str(conf), "--sentinel", "--port", str(port), "--bind", "127.0.0.1", "--dir",
                    str(self.workdir)]
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
            node = Node(port, proc, argv, log_path)
            self.nodes.append(node)
            self.sentinels.append(node)
        if not wait_until(self._ready, 30.0, step_s=0.2):
            raise RuntimeError("sentinels did not see the master, its replicas and each other in 30 s")
        return self

    def _ready(self) -> bool:
        try:
            for s in self.sentinels:
                info = _client(s.port).sentinel_master(SERVICE)
                if info["num-slaves"] < self.num_replicas or info["num-other-sentinels"] < 2:
                    return False
            for r in self.replicas:
                if _client(r.port).info("replication").get("master_link_status") != "up":
                    return False
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    @staticmethod
    def info_replication(node: Node) -> dict:
        return _client(node.port).info("replication")

    @staticmethod
    def sentinel_view(sentinel: Node) -> dict:
        """What ``sentinel`` says of the master (SENTINEL MASTER)."""
        return _client(sentinel.port).sentinel_master(SERVICE)

    def master_port(self) -> int | None:
        """The master's port as the first answering sentinel names it."""
        for s in self.sentinels:
            try:
                return int(_client(s.port).sentinel_get_master_addr_by_name(SERVICE)[1])
            except Exception:  # noqa: BLE001
                continue
        return None

    def wait_promoted(self, old_port: int, timeout_s: float = 30.0) -> int:
        """Wait until the sentinels name another master than ``old_port`` and it answers as a master; its port.

        Raises:
            TimeoutError: no promotion within ``timeout_s``.
        """
        def promoted() -> bool:
            port = self.master_port()
            if port is None or port == old_port:
                return False
            try:
                return _client(port).info("replication")["role"] == "master"
            except Exception:  # noqa: BLE001
                return False

        if not wait_until(promoted, timeout_s, step_s=0.1):
            raise TimeoutError(f"no replica promoted within {timeout_s} s")
        return self.master_port()


@dataclass
class ClusterSet(_Procs):
    """A Redis Cluster of 3 masters (``replicas_per_master`` replicas each) made by ``redis-cli --cluster
    create``; ``node_timeout_ms``: how long a silent master takes to be failed over."""

    replicas_per_master: int = 1
    node_timeout_ms: int = 1000

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:3])

    def start(self) -> "ClusterSet":
        return self.start_nodes().create()

    def start_nodes(self) -> "ClusterSet":
        """The nodes up, cluster-enabled, no slots assigned yet (a cluster still forming)."""
        for i in range(3 * (1 + self.replicas_per_master)):
            port_conf = f"nodes-{i}-{time.monotonic_ns()}.conf"
            self._start(["--cluster-enabled", "yes", "--cluster-config-file", port_conf, "--cluster-node-timeout",
                         str(self.node_timeout_ms), "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay",
                         "0"], f"node{i}", port=_cluster_port())
        return self

    def create(self) -> "ClusterSet":
        """``redis-cli --cluster create`` over the nodes; returns once every node says cluster_state:ok."""
        out = subprocess.run([self.cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                              "--cluster-replicas", str(self.replicas_per_master), "--cluster-yes"],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")
        if not wait_until(self._ok, 30.0, step_s=0.2):
            raise RuntimeError("cluster did not reach cluster_state:ok in 30 s")
        return self

    def _ok(self) -> bool:
        try:
            for n in self.nodes:
                c = _client(n.port)
                if c.cluster("info").get("cluster_state") != "ok":
                    return False
            replicas = [n for n in self.nodes if _client(n.port).info("replication")["role"] == "slave"]
            return all(_client(n.port).info("replication").get("master_link_status") == "up" for n in replicas)
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def role(self, node: Node) -> str:
        return _client(node.port).info("replication")["role"]

    def replica_of(self, master: Node) -> Node:
        """A replica of ``master``."""
        for n in self.nodes:
            info = _client(n.port).info("replication")
            if info["role"] == "slave" and int(info["master_port"]) == master.port:
                return n
        raise LookupError(f"no replica of {master.port}")

    def fail_over(self, replica: Node, timeout_s: float = 20.0) -> None:
        """``CLUSTER FAILOVER`` on ``replica`` (a coordinated failover: no acknowledged write is lost) and wait
        until it is a master and the cluster is ok again.

        Raises:
            TimeoutError: not promoted within ``timeout_s``.
        """
        _client(replica.port, timeout_s=5.0).execute_command("CLUSTER", "FAILOVER")
        if not wait_until(lambda: self.role(replica) == "master" and self._ok(), timeout_s, step_s=0.1):
            raise TimeoutError(f"replica {replica.port} not promoted within {timeout_s} s")
