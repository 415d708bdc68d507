"""The chaos bench's faults, one at a time at seeded random gaps, each recovered before the next.

Kinds (:data:`FAULT_KINDS`): a replica SIGKILLed and started again on its port (``replica_kill``), a replica
SIGTERMed — health NOT_SERVING, in-flight blocks finished, its sessions given up in the store — and started again
(``replica_drain``), the Redis master SIGKILLed so that a replica is promoted, the old master then started again
(it rejoins as a replica: ``redis_master_kill``), the Redis master shut down with a save and started again on
its port from its dump before a failover is declared (``redis_restart``), and on every WAN proxy: stalls
(half of the chunks frozen 400 ms, for 2 s: ``wan_stall``), every open connection reset (TCP RST both ways:
``wan_reset``) and a latency spike (150 ± 20 ms each way, for 3 s: ``wan_latency``).

What the seed fixes: the order of the kinds (a seeded permutation per round, so every kind comes once before
any comes twice), which replica or master is hit and the gaps between faults. What it does not: a fault's
start is its gap after the previous fault's recovery, and recovery times (a replica's start-up, a promotion)
are the machine's.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from dataclasses import dataclass, field

from specdec.bench.chaos.procs import wait_until

FAULT_KINDS = ("replica_kill", "replica_drain", "redis_master_kill", "redis_restart", "wan_stall", "wan_reset",
               "wan_latency")
# uniform gap between one fault's recovery and the next fault, s: short, so that a 600 s run with 16 sessions
# (a replica's restart ~20-40 s on a loaded machine, two per round) fits 5 rounds of every kind or more
GAP_S = (0.5, 1.5)
RECOVERY_TIMEOUT_S = 60.0


@dataclass
class FaultEvent:
    """One injected fault: ``t_s`` when it was injected and ``recovered_s`` when the stack was whole again,
    both s since the run's start; ``target``: the replica or Redis port hit."""

    kind: str
    t_s: float
    recovered_s: float | None = None
    target: str = ""
    error: str = ""

    def to_json(self) -> dict:
        return {"kind": self.kind, "t_s": round(self.t_s, 3),
                "recovered_s": None if self.recovered_s is None else round(self.recovered_s, 3),
                "target": self.target, **({"error": self.error} if self.error else {})}


def _safe(pred):
    """``pred`` as a wait condition: False while the node it asks does not answer."""
    def wrapped() -> bool:
        try:
            return bool(pred())
        except Exception:  # noqa: BLE001 - not answering yet
            return False
    return wrapped


def _profile(**kw):
    from specdec.netem import LinkProfile

    return LinkProfile.symmetric(**kw)


def _wan_window(stack, profile, hold_s: float) -> None:
    for p in stack.proxies:
        p.set_profile(profile)
    time.sleep(hold_s)
    for p in stack.proxies:
        p.set_profile(stack.base_profile())


def _sentinel_whole(redis) -> bool:
    """Every data node up: one master, every other node its replica with the link up, the sentinels agreeing."""
    master = redis.master_port()
    data = [n for n in redis.nodes if n not in redis.sentinels]
    if master is None or not all(n.alive() for n in data):
        return False
    for n in data:
        if n.port != master:
            info = redis.info_replication(n)
            if info.get("role") != "slave" or int(info.get("master_port", -1)) != master \
                    or info.get("master_link_status") != "up":
                return False
    return all(int(redis.sentinel_view(s)["num-slaves"]) >= len(data) - 1 for s in redis.sentinels)


def _sentinel_master_kill(stack, rng) -> str:
    redis = stack.redis
    old_port = redis.master_port()
    node = next(n for n in redis.nodes if n.port == old_port)
    node.kill()
    redis.wait_promoted(old_port, timeout_s=RECOVERY_TIMEOUT_S)
    node.start_again()  # the sentinels turn it into a replica of the new master
    if not wait_until(_safe(lambda: _sentinel_whole(redis)), RECOVERY_TIMEOUT_S, step_s=0.2):
        raise TimeoutError("the old master did not rejoin as a replica")
    return str(old_port)


def _cluster_master_kill(stack, rng) -> str:
    redis = stack.redis
    masters = [n for n in redis.nodes if n.alive() and redis.role(n) == "master"]
    node = rng.choice(masters)
    replica = redis.replica_of(node)
    node.kill()
    if not wait_until(_safe(lambda: redis.role(replica) == "master"), RECOVERY_TIMEOUT_S, step_s=0.1):
        raise TimeoutError(f"no replica of {node.port} promoted")
    node.start_again()  # rejoins from its nodes.conf as a replica of the promoted node
    if not wait_until(redis._ok, RECOVERY_TIMEOUT_S, step_s=0.2):
        raise TimeoutError("the cluster did not become whole again")
    return str(node.port)


def _master_restart(stack, rng) -> str:
    """SHUTDOWN SAVE (every acknowledged write is in the dump), start again at once on the same port."""
    import redis as redis_py

    topo = stack.redis
    if stack.config.store == "sentinel":
        port = topo.master_port()
        node = next(n for n in topo.nodes if n.port == port)
        healthy = _safe(lambda: _sentinel_whole(topo))
    else:
        node = rng.choice([n for n in topo.nodes if n.alive() and topo.role(n) == "master"])
        healthy = topo._ok
    try:
        redis_py.Redis(host="127.0.0.1", port=node.port, socket_timeout=10).shutdown(save=True)
    except redis_py.exceptions.ConnectionError:
        pass  # the server closes the connection as it exits
    node.proc.wait(timeout=30)
    node.start_again()
    if not wait_until(healthy, RECOVERY_TIMEOUT_S, step_s=0.2):
        raise TimeoutError(f"Redis on {node.port} did not come back whole")
    return str(node.port)


def inject(stack, kind: str, rng: random.Random) -> str:
    """Inject one fault of ``kind`` and return once the stack has recovered; the target hit.

    Raises:
        ValueError: an unknown kind. TimeoutError / RuntimeError: the stack did not recover.
    """
    if kind in ("replica_kill", "replica_drain"):
        replica = rng.choice(stack.replicas)
        stack.restart_replica(replica, signal.SIGKILL if kind == "replica_kill" else signal.SIGTERM)
        return replica.verifier_id
    if kind == "redis_master_kill":
        return (_sentinel_master_kill if stack.config.store == "sentinel" else _cluster_master_kill)(stack, rng)
    if kind == "redis_restart":
        return _master_restart(stack, rng)
    if kind == "wan_stall":
        _wan_window(stack, _profile(latency_ms=2.0, stall_probability=0.5, stall_ms=400.0), 2.0)
        return "all"
    if kind == "wan_reset":
        return f"{sum(p.reset_connections() for p in stack.proxies)} connections"
    if kind == "wan_latency":
        _wan_window(stack, _profile(latency_ms=150.0, jitter_ms=20.0), 3.0)
        return "all"
    raise ValueError(f"unknown fault kind {kind!r}")


@dataclass
class FaultInjector:
    """Injects faults from ``start_s`` until ``end_s`` (s since ``t0``, monotonic) in a thread; ``events``."""

    stack: object
    seed: int
    t0: float
    start_s: float
    end_s: float
    kinds: tuple[str, ...] = FAULT_KINDS
    events: list[FaultEvent] = field(default_factory=list)
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> FaultInjector:
        self._thread = threading.Thread(target=self._run, name="chaos-faults", daemon=True)
        self._thread.start()
        return self

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _run(self) -> None:
        rng = random.Random(f"chaos-faults:{self.seed}")
        self._stop.wait(max(0.0, self.start_s - self._now()))
        while not self._stop.is_set():
            for kind in rng.sample(self.kinds, len(self.kinds)):
                if self._stop.wait(rng.uniform(*GAP_S)) or self._now() >= self.end_s:
                    return
                event = FaultEvent(kind, self._now())
                self.events.append(event)
                try:
                    event.target = inject(self.stack, kind, rng)
                except Exception as exc:  # noqa: BLE001 - reported; the run goes on
                    event.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                event.recovered_s = self._now()

    def join(self, timeout_s: float) -> None:
        """Stop after the fault in progress (it recovers first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
