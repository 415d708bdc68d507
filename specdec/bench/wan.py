"""`specdec bench --wan RTT_MS[,..]`: the routes side by side over an emulated WAN (docs/routing.md).

One verifier (in this process, served over gRPC on 127.0.0.1) and, per one-way latency, a :class:`WanProxy`
(specdec.netem: latency ± jitter per direction, a bandwidth cap) between it and an EdgeClient, the gRPC traffic
going through the proxy for real. For each point (latency × draft slowdown) a fresh client is warmed up once
(a short speculative and a short cloud generation, the same for every route), then every prompt is generated
with each route (``speculative``, ``cloud``, ``auto``, interleaved), and the client's tokens/s are reported,
with ``auto / max(speculative, cloud)``, the time to the first token and whether the greedy outputs are
identical across routes. auto chooses from the warm-up's and its own measurements only. Every generation starts
from an empty draft KV cache (:func:`_generate`), so each speculative start pays the draft's prefill of its prompt,
whichever route ran before it.

Device and cloud on one machine: in a deployment the draft and the verifier run on different machines, here they
share this one's cores, and a draft prefilling concurrently (cloud-first) or drafting ahead (proactive) would take
CPU from the verifier's step. So by default (``split_cores``) they get half the cores each, as thread counts: the
draft's ONNX Runtime ``cores // 2`` intra-op threads, the verifier's torch the rest (:func:`split_threads`; one
each on 2 cores), for every route alike; the report says which (``threads``). ``split_cores=False``: both at
their libraries' defaults (every core each), as before.

Draft slowdown k (``--draft-slowdown 1,3``): each draft call is made to last k × its measured time (a sleep
after it), standing for a device slower than this CPU (:class:`SlowDrafter`).

Prints one JSON object (:func:`run_wan_bench`); ``--plot`` draws tokens/s against RTT per slowdown.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

__all__ = ["SlowDrafter", "parse_ms_list", "run_wan_bench", "split_threads"]

WAN_ROUTES = ("speculative", "cloud", "auto")  # the default; --route may add cloud-first
_ALLOWED_ROUTES = (*WAN_ROUTES, "cloud-first")


def parse_ms_list(spec: str, what: str = "--wan") -> list[float]:
    """"0,20,50" → [0.0, 20.0, 50.0]. Raises ValueError naming ``what`` on a bad or negative entry."""
    try:
        values = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated numbers, got {spec!r}") from None
    if not values or any(v < 0 for v in values):
        raise ValueError(f"{what} needs numbers >= 0, got {spec!r}")
    return values


def split_threads(split_cores: bool) -> dict[str, int | None]:
    """Intra-op threads of the draft (ONNX Runtime) and of the target (torch) in one process: half the cores
    this process may use each (the draft ``cores // 2``, at least 1; the target the rest, at least 1), or None
    each (the libraries' defaults) when not ``split_cores``."""
    if not split_cores:
        return {"draft": None, "target": None}
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    draft = max(1, cores // 2)
    return {"draft": draft, "target": max(1, cores - draft)}


class SlowDrafter:
    """A drafter whose every ``propose`` lasts ``slowdown`` × its measured time (it sleeps the rest): a slower
    device. Everything else is the wrapped drafter's (the same tokens and draft_probs); the block's
    ``draft_ms`` is the slowed time (what the client measures the device by)."""

    def __new__(cls, inner, slowdown: float):
        # the concurrent prefill only where the inner drafter has one: a capability is asked with isinstance
        # (edge_client.drafting.contract), so a wrapper must not claim one its drafter lacks (a draft head)
        if cls is SlowDrafter and hasattr(inner, "prefill_step"):
            cls = _PrefillingSlowDrafter
        return super().__new__(cls)

    def __init__(self, inner, slowdown: float):
        if slowdown < 1:
            raise ValueError(f"draft slowdown must be >= 1, got {slowdown}")
        self._inner, self.slowdown = inner, float(slowdown)

    def propose(self, *args, **kwargs):
        t0 = time.perf_counter()
        block = self._inner.propose(*args, **kwargs)
        if self.slowdown > 1:
            time.sleep((time.perf_counter() - t0) * (self.slowdown - 1))
            if getattr(block, "draft_ms", 0):
                block.draft_ms *= self.slowdown
        return block

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _PrefillingSlowDrafter(SlowDrafter):
    """A :class:`SlowDrafter` of a drafter that prefills concurrently (cloud-first)."""

    def prefill_step(self, *args, **kwargs):
        """The inner drafter's concurrent prefill step, slowed alike (a slow device prefills slowly too)."""
        t0 = time.perf_counter()
        n = self._inner.prefill_step(*args, **kwargs)
        if self.slowdown > 1 and n:
            time.sleep((time.perf_counter() - t0) * (self.slowdown - 1))
        return n


# per warm-up generation: speculative and cloud in turn, one per prompt (the same for every route); 16 tokens
# gave 2-3 speculative blocks past the first, whose mean wall time swung by a third between points
WARMUP_TOKENS = 32


def _generate(client, prompt_ids: list[int], route: str, max_new_tokens: int) -> dict:
    """One timed generation from an empty draft KV cache: the draft holds one sequence, so without the reset a
    route run after a speculative one on the same prompt would find the draft's prefill done, and the order of
    the routes would decide who pays it; empty, every route starts as on a new prompt (the verifier's prefix
    cache is warm for all of them alike)."""
    if hasattr(client.drafter, "reset"):
        client.drafter.reset()
    t0, first = time.perf_counter(), None
    for chunk in client.stream_chunks(prompt_ids, max_new_tokens=max_new_tokens, ignore_eos=True, route=route):
        if first is None and chunk.text:
            first = time.perf_counter() - t0
    elapsed, result = time.perf_counter() - t0, client.last_result
    return {"token_ids": result.token_ids, "elapsed_s": elapsed, "route": result.route, "first_token_s": first,
            "tokens_per_s": len(result.token_ids) / max(elapsed, 1e-9)}


def route_orders(routes: tuple[str, ...]) -> list[list[str]]:
    """The orders :func:`_measure` cycles through: a Williams design (Williams 1949, a Latin square balanced for
    first-order carry-over; for an odd number of routes the square and its rows reversed). Over one cycle (n
    orders for n routes, 2n when n is odd) each route runs first equally often and directly after each other
    route equally often."""
    n, first, lo, hi = len(routes), [0], 1, len(routes) - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(lo if len(first) % 2 else hi)
        lo, hi = (lo + 1, hi) if len(first) % 2 == 0 else (lo, hi - 1)
    square = [[routes[(x + s) % n] for x in first] for s in range(n)]
    return square + [order[::-1] for order in square] if n % 2 else square


def _measure(client, prompts: list[list[int]], routes: tuple[str, ...], max_new_tokens: int,
             repeats: int = 1) -> dict:
    """Every prompt with every route, ``repeats`` times, the routes interleaved so that a change of load on a
    shared machine falls on all of them: each (repeat, prompt) slot takes the next of :func:`route_orders`, so
    that each route follows each other one equally often (with a single cyclic order one route would always follow the same other, and what a run leaves behind — a session
    being released, the collector — would fall on one route's runs only). ``auto`` keeps its own running
    estimates (from the warm-up and its own generations); the fixed routes run on a copy of the warm-up's, so auto
    learns nothing from them. Per route: the runs in order, prompt by prompt within each repeat."""
    import copy

    warm = client.route_estimates
    auto_est = copy.deepcopy(warm)
    runs: dict[str, list] = {r: [] for r in routes}
    orders = route_orders(routes)
    for rep in range(repeats):
        for i, ids in enumerate(prompts):
            for r in orders[(rep * len(prompts) + i) % len(orders)]:
                client.route_estimates = auto_est if r == "auto" else copy.deepcopy(warm)
                runs[r].append(_generate(client, ids, r, max_new_tokens))
    client.route_estimates = warm
    return runs


def _point(address: str, draft_model, prompts: list[list[int]], latency_ms: float, slowdown: float, *,
           routes: tuple[str, ...], max_new_tokens: int, num_speculative_tokens: int, jitter_ms: float,
           bandwidth_kbps: float, seed: int, repeats: int = 1) -> dict:
    """One grid point: every prompt with every route through one WanProxy, after one warm-up shared by all
    routes (short speculative and cloud generations, one per prompt: the channel, the draft, the prompts'
    prefill, the client's estimates of both routes — what a client learns once, not per request)."""
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
    from specdec.models.named_drafts import drafter_for
    from specdec.netem import DirectionProfile, LinkProfile, WanProxy

    way = DirectionProfile(latency_ms, jitter_ms, bandwidth_kbps)
    with WanProxy(0, address, LinkProfile(way, way), seed=seed) as wan, GrpcBackend(wan.address) as backend:
        drafter = SlowDrafter(drafter_for(draft_model), slowdown)
        client = EdgeClient(backend, drafter, draft_model.tokenizer, num_speculative_tokens=num_speculative_tokens,
                            adaptive=True, proactive=True)
        t0 = time.perf_counter()
        for i, ids in enumerate(prompts):  # each prompt once (the verifier's prefix cache then holds it)
            _generate(client, ids, ("speculative", "cloud")[i % 2], WARMUP_TOKENS)
        if len(prompts) < 2:
            _generate(client, prompts[0], "cloud", WARMUP_TOKENS)
        warmup_s = time.perf_counter() - t0
        runs = _measure(client, prompts, routes, max_new_tokens, repeats)
    point: dict[str, Any] = {"one_way_ms": latency_ms, "rtt_ms": 2 * latency_ms, "draft_slowdown": slowdown,
                             "warmup_s": round(warmup_s, 3)}
    for r in routes:
        tokens = sum(len(x["token_ids"]) for x in runs[r])
        point[r] = {"tokens_per_s": tokens / max(sum(x["elapsed_s"] for x in runs[r]), 1e-9),
                    "elapsed_s": [round(x["elapsed_s"], 4) for x in runs[r]],
                    "first_token_s": [round(x["first_token_s"] or 0.0, 4) for x in runs[r]]}
        point[r]["first_token_s_median"] = round(statistics.median(point[r]["first_token_s"]), 4)
        switch_s = [x["route"]["switches"][0]["at_s"] for x in runs[r] if x["route"].get("switches")]
        if r in ("auto", "cloud-first"):  # when its first switch came (a cloud-first start: the hand-over)
            point[r]["first_switch_s"] = [round(t, 4) for t in switch_s]
            point[r]["draft_ready_s"] = [x["route"].get("draft_ready_s") for x in runs[r]]
            # the hand-over's lag behind the draft's readiness (both from the generation's start)
            point[r]["handover_lag_s"] = [round(x["route"]["switches"][0]["at_s"] - x["route"]["draft_ready_s"], 4)
                                          for x in runs[r] if x["route"].get("switches")
                                          and x["route"].get("draft_ready_s") is not None]
    if "auto" in runs:
        point["auto"]["routes"] = [{k: x["route"].get(k) for k in ("initial", "final", "why", "switches", "tokens",
                                                                   "draft_ready_s", "estimates")}
                                   for x in runs["auto"]]
        fixed = [point[r]["tokens_per_s"] for r in routes if r in ("speculative", "cloud")]
        if fixed:
            point["auto_vs_best"] = point["auto"]["tokens_per_s"] / max(fixed)
    point["greedy_identical"] = all(run["token_ids"] == runs[routes[0]][i]["token_ids"]
                                    for r in routes for i, run in enumerate(runs[r]))
    return point


def _warm_process(address: str, draft_model, prompt_ids: list[int]) -> None:
    """One untimed speculative and one cloud generation straight to the verifier, before the first point: the
    process's first forward passes (allocations, kernel choices) are slower, and the first point's warm-up would
    otherwise give its client estimates no later point's client sees."""
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
    from specdec.models.named_drafts import drafter_for

    with GrpcBackend(address) as backend:
        client = EdgeClient(backend, drafter_for(draft_model), draft_model.tokenizer, adaptive=True, proactive=True)
        for route in ("speculative", "cloud"):
            _generate(client, prompt_ids, route, WARMUP_TOKENS)


def run_wan_bench(prompts, one_way_ms: list[float], *, routes: tuple[str, ...] = WAN_ROUTES,
                  draft_slowdowns: tuple[float, ...] = (1.0,), max_new_tokens: int = 64,
                  num_speculative_tokens: int = 4, jitter_ms: float = 0.0, bandwidth_kbps: float = 0.0,
                  target: Path | None = None, draft: Path | None = None, device: str = "auto", dtype: str = "auto",
                  seed: int = 0, plot: Path | None = None, repeats: int = 1, split_cores: bool = True) -> dict:
    """The grid one-way latency × draft slowdown → client tokens/s per route (greedy), as one JSON-able dict.

    Args:
        prompts: :class:`specdec.bench.prompts.BenchPrompt` list (their text gets the chat template).
        one_way_ms: one-way latency of each direction, ms (RTT = 2 ×).
        routes: subset of speculative, cloud, auto, cloud-first (the CLI's ``--route``).
        repeats: every prompt on every route this many times per point (``--wan-repeats``).
        split_cores: the draft and the verifier get half the cores each (:func:`split_threads`; module docstring).

    Raises:
        ValueError: an unknown route, a slowdown < 1, a bad link profile, repeats < 1.
    """
    if repeats < 1:  # before anything loads
        raise ValueError(f"--wan-repeats must be at least 1, got {repeats}")
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.edge_client.client import encode_prompt
    from specdec.embedded import EmbeddedServer
    from specdec.models.named_drafts import is_head_dir, load_draft_model

    from ._shared import resolve_dirs

    bad = [r for r in routes if r not in _ALLOWED_ROUTES]
    if bad:
        raise ValueError(f"--route for --wan: {', '.join(_ALLOWED_ROUTES)}, got {', '.join(bad)}")
    target_dir, draft_dir = resolve_dirs(target, None if draft is not None and is_head_dir(draft) else draft)
    draft_dir = Path(draft) if draft is not None and is_head_dir(draft) else draft_dir
    threads = split_threads(split_cores)
    draft_model = load_draft_model(draft_dir, intra_op_num_threads=threads["draft"])
    ids = [encode_prompt(draft_model.tokenizer, p.prompt) for p in prompts]
    verifier = Verifier(TargetRunner(target_dir, device=device, dtype=dtype, num_threads=threads["target"]),
                        max_batch_wait_ms=1.0)
    points = []
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address:
        _warm_process(address, draft_model, ids[0])
        for slowdown in draft_slowdowns:
            for latency in one_way_ms:
                points.append(_point(address, draft_model, ids, latency, slowdown, routes=tuple(routes),
                                     max_new_tokens=max_new_tokens, num_speculative_tokens=num_speculative_tokens,
                                     jitter_ms=jitter_ms, bandwidth_kbps=bandwidth_kbps, seed=seed,
                                     repeats=repeats))
        feature_bytes = _feature_bytes(address, draft_model)
    report = {"mode": "wan", "draft": str(draft_dir), "draft_kind": "head" if feature_bytes else "model",
              "routes": list(routes), "num_prompts": len(ids), "repeats": repeats,
              "max_new_tokens": max_new_tokens, "threads": threads,
              "num_speculative_tokens": num_speculative_tokens, "jitter_ms": jitter_ms,
              "bandwidth_kbps": bandwidth_kbps, "points": points,
              "min_auto_vs_best": min((p["auto_vs_best"] for p in points if "auto_vs_best" in p), default=None),
              "greedy_identical": all(p["greedy_identical"] for p in points)}
    if feature_bytes:
        report["feature_bytes"] = feature_bytes
    if plot is not None:
        _plot(report, plot)
        report["plot"] = str(plot)
    return report


def _feature_bytes(address: str, draft_model) -> dict | None:
    """For a draft head: the bytes per committed token its features add on the wire, float16 and int8
    (:func:`specdec.bench.feature_bytes.feature_bytes_at`, the head's own feature layers); None for a draft model."""
    request = getattr(draft_model, "feature_request", None)
    if request is None:
        return None
    from .feature_bytes import feature_bytes_at

    return {"layers": list(request.layers), **feature_bytes_at(address, request.layers)}


_STYLE = {"speculative": ("o", "-"), "cloud": ("s", "-"), "auto": ("^", "--"), "cloud-first": ("v", ":")}


def _plot(report: dict, path: Path) -> None:
    """tokens/s against RTT, one panel per draft slowdown (shared y axis), one line per route (matplotlib, Agg),
    each panel titled with its worst auto / best fixed route."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slowdowns = sorted({p["draft_slowdown"] for p in report["points"]})
    fig, axes = plt.subplots(1, len(slowdowns), figsize=(5.2 * len(slowdowns), 3.9), squeeze=False, sharey=True)
    for ax, k in zip(axes[0], slowdowns):
        pts = sorted((p for p in report["points"] if p["draft_slowdown"] == k), key=lambda p: p["rtt_ms"])
        for r in report["routes"]:
            marker, line = _STYLE.get(r, ("o", "-"))
            ax.plot([p["rtt_ms"] for p in pts], [p[r]["tokens_per_s"] for p in pts], marker=marker, linestyle=line,
                    label=r, linewidth=2 if r == "auto" else 1.5)
        worst = min((p["auto_vs_best"] for p in pts if "auto_vs_best" in p), default=None)
        ax.set_title(f"draft slowdown {k:g}x" + (f"  (min auto/best {worst:.2f})" if worst is not None else ""))
        ax.set_xlabel("round-trip time, ms")
        ax.set_xticks([p["rtt_ms"] for p in pts])
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0][0].set_ylabel("client tokens/s")
    axes[0][0].legend()
    times = f" x {report['repeats']}" if report.get("repeats", 1) > 1 else ""
    fig.suptitle(f"{report['num_prompts']} prompts{times} x {report['max_new_tokens']} tokens, greedy, "
                 f"γ <= {report['num_speculative_tokens']}, through the WAN proxy", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_wan_from_cli(prompts_path: Path, wan: str, route: str | None, *, draft_slowdown: str, repeats: int,
                     limit: int | None,
                     max_new_tokens: int, num_speculative_tokens: int, jitter_ms: float, bandwidth_kbps: float,
                     target: Path | None, draft: Path | None, device: str, dtype: str, plot: Path | None,
                     split_cores: bool = True) -> dict:
    """`specdec bench --wan`: parse the CLI's lists (``route``: comma-separated routes, None = all three) and run
    :func:`run_wan_bench` on the first ``limit`` prompts (default 2). Raises ValueError with a one-line message."""
    from .prompts import load_prompts

    routes = tuple(r.strip() for r in route.split(",")) if route else WAN_ROUTES
    slowdowns = tuple(parse_ms_list(draft_slowdown, "--draft-slowdown"))
    return run_wan_bench(load_prompts(prompts_path, limit or 2), parse_ms_list(wan), routes=routes,
                         draft_slowdowns=slowdowns, max_new_tokens=max_new_tokens,
                         num_speculative_tokens=num_speculative_tokens, jitter_ms=jitter_ms,
                         bandwidth_kbps=bandwidth_kbps, target=target, draft=draft, device=device, dtype=dtype,
                         plot=plot, repeats=repeats, split_cores=split_cores)
