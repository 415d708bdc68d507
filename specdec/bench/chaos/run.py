"""`specdec bench --chaos`: N client sessions of mixed kinds against a loopback deployment while faults are
injected, every finished output checked against its reference, one JSON report.

1. :class:`~specdec.bench.chaos.stack.Stack`: a Redis Sentinel set or Cluster, the replicas, a WAN proxy each.
2. ``sessions`` threads (:func:`~specdec.bench.chaos.workload.session_worker`) send requests until
   ``duration_s``; the :class:`~specdec.bench.chaos.faults.FaultInjector` injects faults from
   :data:`WARMUP_S` until ``duration_s``; a monitor samples each replica's RSS and /metrics every second.
3. After the last request: the Redis keys and KV pages left, at once and after the session TTL (orphans of a
   killed replica or an abandoned open expire after it).
4. The stack is stopped, then references are computed in this process (:mod:`specdec.bench.chaos.check`).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench.chaos.faults import FaultInjector
from specdec.bench.chaos.stack import Stack, StackConfig, rss_bytes
from specdec.bench.chaos.workload import (
    REQUEST_KINDS,
    Outcome,
    Progress,
    Request,
    session_worker,
)

WARMUP_S = 3.0  # the sessions' first requests before the first fault, s
DRAIN_TIMEOUT_S = 240.0  # the last requests after duration_s, s (they may be waiting out a fault)
RSS_SETTLE_S = 10.0  # the bench process's RSS is counted from this long after its first sample (drafts load), s
KV_TOKENS_PER_SESSION, MIN_KV_TOKENS = 48, 192  # the default KV pool: small enough to preempt, not to starve


def default_kv_tokens(sessions: int) -> int:
    """Each replica's default KV pool, tokens: :data:`KV_TOKENS_PER_SESSION` per session, at least
    :data:`MIN_KV_TOKENS` (a request holds ~40 prompt + 32 output tokens: the sessions of a replica restarting
    move to the others, which then preempt)."""
    return max(MIN_KV_TOKENS, KV_TOKENS_PER_SESSION * sessions)


@dataclass
class Monitor:
    """Every ``interval_s``: each live replica's RSS and KV preemption counter, per process (pid); a replica's
    and the edge-serve process's RSS from when it turned SERVING (its start-up is not growth)."""

    stack: Stack
    interval_s: float = 1.0
    rss: dict[int, list[tuple[float, int]]] = field(default_factory=dict)  # pid -> (t, bytes)
    names: dict[int, str] = field(default_factory=dict)
    preemptions: dict[int, float] = field(default_factory=dict)  # pid -> last value seen
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Monitor:
        threading.Thread(target=self._run, name="chaos-monitor", daemon=True).start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        value = rss_bytes(os.getpid())
        if value is not None:
            self.rss.setdefault(os.getpid(), []).append((time.monotonic(), value))
            self.names[os.getpid()] = "bench"
        for r in self.stack.replicas:
            if not r.alive() or r.serving_since is None:
                continue
            pid = r.proc.pid
            value = rss_bytes(pid)
            if value is not None:
                self.rss.setdefault(pid, []).append((time.monotonic(), value))
                self.names[pid] = f"{r.verifier_id}#{r.starts}"
            m = r.metrics()
            if "specdec_kv_preemptions_total" in m:
                self.preemptions[pid] = m["specdec_kv_preemptions_total"]
        edge = self.stack.edge_serve
        if edge is not None and edge.alive() and edge.serving_since is not None:
            value = rss_bytes(edge.proc.pid)
            if value is not None:
                self.rss.setdefault(edge.proc.pid, []).append((time.monotonic(), value))
                self.names[edge.proc.pid] = "edge-serve"

    def stop(self) -> None:
        self._stop.set()

    def growth(self) -> dict:
        """RSS growth per process (last sample - first sample), bytes: each replica process
        (``verifier_id#start``) and the edge-serve process (``edge_serve``: None without one) from when it turned
        SERVING, and this one (``bench``: the sessions' side) from :data:`RSS_SETTLE_S` after its first sample."""
        out = {}
        for pid, samples in self.rss.items():
            settle = RSS_SETTLE_S if self.names[pid] == "bench" else 0.0
            settled = [v for t, v in samples if t >= samples[0][0] + settle]
            if len(settled) >= 2:
                out[self.names[pid]] = settled[-1] - settled[0]
        bench, edge = out.pop("bench", None), out.pop("edge-serve", None)
        return {"replicas": out, "max_replica": max(out.values(), default=0), "edge_serve": edge, "bench": bench}


def _kv_pages_used(stack: Stack) -> int | None:
    values = [r.metrics().get("specdec_kv_cache_pages_used") for r in stack.replicas if r.alive()]
    return None if any(v is None for v in values) else int(sum(values))


def _cleanup(stack: Stack) -> dict:
    """Keys and KV pages left once every request ended, then after the TTL has let orphans expire."""
    from specdec.bench.chaos.procs import wait_until

    at_end = {"redis_keys_at_end": stack.store_keys(), "kv_pages_at_end": _kv_pages_used(stack)}
    wait_until(lambda: stack.store_keys() == 0 and _kv_pages_used(stack) == 0,
               stack.config.session_ttl_s + 10.0, step_s=1.0)
    return {**at_end, "redis_keys_left": stack.store_keys(), "kv_pages_left": _kv_pages_used(stack)}


def _check_options(store: str, sessions: int, duration_s: float, replicas: int, kinds) -> None:
    """Raises ValueError on a bad option of :func:`run_chaos`."""
    if store not in ("sentinel", "cluster"):
        raise ValueError(f"--store must be sentinel or cluster, got {store!r}")
    if sessions < 1 or not duration_s > 0 or not 1 <= replicas <= 3:
        raise ValueError(f"--sessions >= 1, --duration-s > 0, 1..3 replicas (got {sessions}, {duration_s}, "
                         f"{replicas})")
    bad = [k for k in kinds if k not in REQUEST_KINDS]
    if bad:
        raise ValueError(f"unknown request kinds {bad}: expected some of {', '.join(REQUEST_KINDS)}")


def run_chaos(*, store: str = "sentinel", sessions: int = 8, duration_s: float = 60.0, seed: int = 0,
              target: Path | None = None, draft: Path | None = None, replicas: int = 2,
              kv_cache_budget_tokens: int | None = None, kinds: tuple[str, ...] = REQUEST_KINDS,
              plot: Path | None = None) -> dict:
    """Run the chaos bench (the module docstring); the report (:func:`specdec.bench.chaos.report.build_report`).

    Args:
        store: "sentinel" or "cluster". sessions: concurrent client sessions (>= 1). duration_s: how long new
            requests are started and faults injected, s. seed: fixes the requests and the faults.
        target, draft: model directories (default: the prepared pair). replicas: `specdec serve` processes (2-3).
        kv_cache_budget_tokens: each replica's KV pool, tokens (small: sessions get preempted); None:
            :func:`default_kv_tokens`.
        kinds: request kinds sent (:data:`~specdec.bench.chaos.workload.REQUEST_KINDS`).
        plot: write the progress plot (PNG) here.

    Raises:
        ValueError: a bad option. FileNotFoundError: no redis-server / redis-cli, no models.
        RuntimeError: the stack did not start.
    """
    from specdec.bench._shared import resolve_dirs
    from specdec.bench.chaos.check import References, check_outcomes
    from specdec.bench.chaos.report import build_report, plot_progress

    _check_options(store, sessions, duration_s, replicas, kinds)
    target_dir, draft_dir = resolve_dirs(target, draft)
    if kv_cache_budget_tokens is None:
        kv_cache_budget_tokens = default_kv_tokens(sessions)
    wall0 = time.monotonic()
    stack = Stack(StackConfig(store, target_dir, replicas, kv_cache_budget_tokens, seed=seed,
                              edge_serve_draft_dir=draft_dir if "openai" in kinds else None))
    try:
        stack.start()
        progress, outcomes = Progress(time.monotonic()), []
        threads = [threading.Thread(target=session_worker, name=f"chaos-session-{i}", daemon=True,
                                    args=(i, stack.addresses, draft_dir),
                                    kwargs={"seed": seed, "end_s": duration_s, "progress": progress,
                                            "outcomes": outcomes, "kinds": tuple(kinds),
                                            "edge_serve_url": stack.edge_serve.url if stack.edge_serve else None})
                   for i in range(sessions)]
        for t in threads:
            t.start()
        injector = FaultInjector(stack, seed, progress.t0, WARMUP_S, duration_s).start()
        monitor = Monitor(stack).start()
        deadline = progress.t0 + duration_s + DRAIN_TIMEOUT_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        injector.join(DRAIN_TIMEOUT_S)
        t_run = time.monotonic() - progress.t0
        for i, t in enumerate(threads):
            if t.is_alive():  # its request in flight never ended: lost
                outcomes.append(Outcome(i, -1, Request("greedy", 0), t_run, t_run, error="UNFINISHED",
                                        error_message=f"still running {DRAIN_TIMEOUT_S:.0f} s after the end"))
        monitor.sample()
        monitor.stop()
        cleanup = _cleanup(stack)
        preemptions = int(sum(monitor.preemptions.values()))
    finally:
        stack.stop()
    references = References(target_dir, draft_dir)
    try:
        problems = check_outcomes(outcomes, references)
    finally:
        references.close()
    rss = monitor.growth()
    config = {"store": store, "seed": seed, "duration_s": duration_s, "replicas": replicas, "sessions": sessions,
              "kinds": list(kinds), "kv_cache_budget_tokens": kv_cache_budget_tokens}
    report = build_report(config=config, outcomes=outcomes, problems=problems, events=injector.events,
                          progress=progress, cleanup=cleanup, rss=rss,
                          extra={"kv_preemptions": preemptions, "run_s": round(t_run, 1),
                                 "wall_s": round(time.monotonic() - wall0, 1)})
    if plot is not None:
        plot_progress(report, progress, injector.events, plot)
        report["plot"] = str(plot)
    return report
