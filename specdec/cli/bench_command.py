"""`specdec bench`: the benchmark modes (default, --drafts, --clients [--replay], --gamma-sweep, --edge-cloud, --wan,
--json-schema, --chaos)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import typer

from specdec.cli._shared import (
    DEFAULT_MIN_CONFIDENCE, DEFAULT_NUM_SPECULATIVE_TOKENS, DEFAULT_PROMPTS, DEVICE_HELP, DTYPE_HELP,
    NumSpeculativeTokens, check_device, fail, user_errors, app, require_extra,
)
from specdec.cli.checks import resolve_draft_option
from specdec.cli.processing import (
    FREQUENCY_PENALTY, LOGIT_BIAS, MIN_P, MIN_TOKENS, PRESENCE_PENALTY, REPETITION_PENALTY, processing_options,
)


def _check_bench_options(temperature, clients, gamma_sweep, edge_cloud, plot, replay, duration_s, device,
                         dtype, json_schema=None, verify_policy=None) -> list[int] | None:
    """The client counts of --clients (None without it), or exit with one line on options that do not go
    together."""
    if temperature > 0 and (clients or gamma_sweep or edge_cloud or json_schema):
        fail("--temperature > 0 goes with the default benchmark (not --clients, --gamma-sweep, --edge-cloud, "
              "--json-schema)")
    modes = [name for name, on in (("--clients", clients), ("--gamma-sweep", gamma_sweep),
                                   ("--edge-cloud", edge_cloud), ("--json-schema", json_schema)) if on]
    if len(modes) > 1:
        fail(f"{' and '.join(modes)} are separate modes: give one")
    if plot is not None and not gamma_sweep:
        fail("--plot goes with --gamma-sweep")
    _check_plot(plot)
    if replay and not clients:
        fail("--replay needs --clients (e.g. --clients 1,16,64)")
    if duration_s is not None and not replay:
        fail("--duration-s goes with --replay or --chaos")
    if verify_policy is not None:
        from specdec_runtime.cloud_verifier.verify_policy import VERIFY_POLICIES

        if not replay:
            fail("--verify-policy goes with --replay")
        bad = [p for p in verify_policy.split(",") if p not in VERIFY_POLICIES]
        if bad or not verify_policy:
            fail(f"--verify-policy takes {', '.join(VERIFY_POLICIES)} (comma-separated), got {verify_policy!r}")
    require_extra("tools", "specdec bench")
    check_device(device, dtype)
    try:
        return [int(c) for c in clients.split(",")] if clients else None
    except ValueError:
        fail(f"--clients must be comma-separated integers, got {clients!r}")


def _run_mode(bench_mod, prompts, client_counts, *, replay, duration_s, gamma_sweep, edge_cloud, delays_ms, adaptive,
              min_confidence, pin, plot, limit, max_new_tokens, num_speculative_tokens, target, draft, no_hf,
              sampling, progress, cloud_replay=False, json_schema=None, verify_policies=None) -> dict:
    """The report of the one benchmark mode the options select."""
    if json_schema is not None:  # constrained vs unconstrained side by side: specdec/bench/structured.py
        from specdec.bench.structured import run_structured

        return run_structured(json_schema, target=target, draft=draft, limit=limit, max_new_tokens=max_new_tokens,
                              num_speculative_tokens=num_speculative_tokens)
    if replay:
        return bench_mod.run_replay_bench(
            prompts, client_counts,
            duration_s=bench_mod.REPLAY_DEFAULT_DURATION_S if duration_s is None else duration_s,
            limit=limit, max_new_tokens=max_new_tokens, num_speculative_tokens=num_speculative_tokens,
            target=target, draft=draft, progress=progress, cloud=cloud_replay,
            verify_policies=verify_policies.split(",") if verify_policies else None,
        )
    if client_counts:
        return bench_mod.run_clients_bench(
            prompts, client_counts, limit=limit, max_new_tokens=max_new_tokens,
            num_speculative_tokens=num_speculative_tokens, target=target, draft=draft, progress=progress,
        )
    if gamma_sweep:
        return bench_mod.run_gamma_sweep(
            prompts, bench_mod.parse_gamma_sweep(gamma_sweep), limit=limit, max_new_tokens=max_new_tokens,
            target=target, draft=draft, min_confidence=min_confidence, progress=progress, plot=plot,
        )
    if edge_cloud:
        return bench_mod.run_edge_cloud_bench(
            prompts, bench_mod.parse_delays_ms(delays_ms), limit=limit, max_new_tokens=max_new_tokens,
            num_speculative_tokens=num_speculative_tokens, adaptive=adaptive, min_confidence=min_confidence,
            target=target, draft=draft, progress=progress, pin=pin,
        )
    return bench_mod.run_bench(
        prompts, limit=limit, max_new_tokens=max_new_tokens, num_speculative_tokens=num_speculative_tokens,
        target=target, draft=draft, hf_assisted=not no_hf, progress=progress, sampling=sampling,
    )


# The --replay and --wan option groups, as module-level defaults so that the command's signature stays short.
REPLAY = typer.Option(
    False, "--replay", help="With --clients: the verifier under load: recorded draft blocks replayed by N "
    "concurrent sessions of one asyncio process against a verifier process on its own cores")
DURATION_S = typer.Option(None, "--duration-s", help="--replay: measured window per N, s (default 20); --chaos: "
                          "how long requests are started and faults injected, s (default 60)")
VERIFY_POLICY = typer.Option(None, "--verify-policy", help="--replay: the verifier's verify policies side by side, "
                             "interleaved per N, e.g. fixed,adaptive (default: the verifier's own, adaptive)")
WAN = typer.Option(None, "--wan", help="One-way WAN latencies, ms, e.g. 0,20,50,100: routes side by side through "
                   "specdec.netem's proxy (JSON; docs/routing.md)")
ROUTE = typer.Option(None, "--route", help="--wan: routes compared (default: speculative,cloud,auto); --replay: "
                     "'speculative,cloud' also cloud-decodes the sessions")
JITTER_MS = typer.Option(0.0, "--jitter-ms", help="--wan: ± jitter of each direction, ms")
BANDWIDTH_KBPS = typer.Option(0.0, "--bandwidth-kbps", help="--wan: cap per direction, kbit/s (0: none)")
JSON_SCHEMA = typer.Option(None, "--json-schema", help="Constrained (this JSON schema file) vs unconstrained, "
                           "target-only and specdec side by side: one JSON object (specdec/bench/structured.py)")
DRAFT_SLOWDOWN = typer.Option("1", "--draft-slowdown", help="--wan: draft cost × k, e.g. 1,3 (slower devices)")
WAN_REPEATS = typer.Option(1, "--wan-repeats", help="--wan: every prompt on every route this many times per point "
                           "(the routes rotated each time): less noise, proportionally longer")


DRAFT = typer.Option(None, help="Draft: a directory or a prepared draft's name: int8, distilled, head (default: the "
                     "prepared int8 draft); a draft head (`specdec models export-head`) in --wan only")
DRAFTS = typer.Option(None, "--drafts", help="Prepared drafts side by side, e.g. int8,distilled,head (or draft "
                      "directories): each at γ = -g and with adaptive γ against one target-only baseline, greedy; "
                      "acceptance, draft cost, speedup measured and predicted (docs/benchmarks.md)")
CHAOS = typer.Option(False, "--chaos", help="Every fault at once: its own Redis HA + `specdec serve` replicas + "
                     "WAN proxies on loopback, --sessions of mixed kinds for --duration-s, seeded faults, each "
                     "output checked against its reference; one JSON report (docs/benchmarks.md, Chaos)")
STORE = typer.Option("sentinel", "--store", help="--chaos: sentinel (1 master, 2 replicas, 3 sentinels) or cluster "
                     "(3 masters, a replica each)")
SESSIONS = typer.Option(8, "--sessions", help="--chaos: concurrent client sessions")
REPLICAS = typer.Option(2, "--replicas", help="--chaos: `specdec serve` replicas (1-3)")
KV_TOKENS = typer.Option(None, "--kv-cache-budget-tokens", help="--chaos: each replica's KV pool, tokens (default "
                         "48 per session, at least 192: small, sessions are preempted)")


def _emit(bench_mod, report: dict, *, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(report, indent=None))
    else:
        bench_mod.print_report(report)


def _run_chaos(others, store, sessions, duration_s, seed, target, draft, replicas, kv_tokens, plot) -> None:
    """`bench --chaos`: one JSON object on stdout (or one line on a bad option or a stack that did not start);
    ``others``: the options of the other modes (--wan, --clients, --gamma-sweep, --edge-cloud, --json-schema)."""
    from specdec.bench.chaos.run import run_chaos

    if any(o not in (None, False) for o in others):
        fail("--chaos is a mode of its own (not --wan, --clients, --gamma-sweep, --edge-cloud, --json-schema or the "
             "processing flags)")
    _check_plot(plot)
    try:
        report = run_chaos(store=store, sessions=sessions, duration_s=60.0 if duration_s is None else duration_s,
                           seed=0 if seed is None else seed, target=target, draft=draft, replicas=replicas,
                           kv_cache_budget_tokens=kv_tokens, plot=plot)
    except (*user_errors(), ValueError, FileNotFoundError, RuntimeError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    typer.echo(json.dumps(report))


def _check_plot(plot) -> None:
    if plot is not None and not plot.resolve().parent.is_dir():  # before the run, not after it
        fail(f"--plot: no directory {plot.resolve().parent}")


def _run_drafts(prompts, drafts, others, *, as_json: bool, device: str, dtype: str, gamma: int, **kwargs) -> None:
    """`bench --drafts`: the named drafts side by side (specdec/bench/drafts.py), one JSON object on stdout (a
    table without --json), or one line on a bad option or a draft that is not prepared."""
    from specdec.bench import target_placement
    from specdec.bench.drafts import parse_draft_names, run_drafts_bench
    from specdec.bench.report import print_report

    if any(o not in (None, False) for o in others):
        fail("--drafts is a mode of its own (greedy; not --draft, --wan, --clients, --gamma-sweep, --edge-cloud, "
             "--json-schema, --temperature)")
    require_extra("tools", "specdec bench")
    check_device(device, dtype)
    try:
        with target_placement(device, dtype):
            report = run_drafts_bench(prompts, parse_draft_names(drafts), progress=not as_json,
                                      num_speculative_tokens=gamma, **kwargs)
    except (*user_errors(), ValueError, FileNotFoundError, ImportError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    if as_json:
        typer.echo(json.dumps(report))
    else:
        print_report(report)


def _processing(other_mode: bool, **flags) -> dict:
    """The processing flags' settings (warnings logged from here on); one line when they come with a mode other than
    the default benchmark."""
    logging.basicConfig(level=logging.WARNING)
    processing = processing_options(**flags, logprobs=None)
    if processing and other_mode:
        fail("the processing flags (--repetition-penalty ... --min-p) go with the default benchmark")
    return processing


def _run_wan(prompts, wan, route, **kwargs) -> None:
    """`bench --wan`: the routes side by side behind the WAN proxy, one JSON object on stdout (or one line on a
    bad option)."""
    from specdec.bench.wan import run_wan_from_cli

    _check_plot(kwargs.get("plot"))

    try:
        typer.echo(json.dumps(run_wan_from_cli(prompts, wan, route, **kwargs)))
    except (*user_errors(), ValueError, FileNotFoundError) as e:
        fail(str(e))


@app.command()
def bench(
    prompts: Path = typer.Option(
        DEFAULT_PROMPTS, help="Spec-Bench-style jsonl (default: the shipped Spec-Bench development half)"),
    limit: Optional[int] = typer.Option(None, help="N questions, round-robin across categories"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    num_speculative_tokens: NumSpeculativeTokens = DEFAULT_NUM_SPECULATIVE_TOKENS,
    clients: Optional[str] = typer.Option(None, help="Comma-separated concurrent client counts, e.g. 1,4,16"),
    gamma_sweep: Optional[str] = typer.Option(
        None, "--gamma-sweep", help="γ sweep, e.g. 1-8 or 1,2,4,8: fixed γ each, adaptive (≤ max) with and without "
        "confidence truncation, vs target-only"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG of the γ sweep, or of --chaos's sessions and "
                                      "faults (needs matplotlib)"),
    edge_cloud: bool = typer.Option(
        False, "--edge-cloud", help="Verifier in a separate process on its own core vs the edge client: cloud-only "
        "vs specdec (proactive off/on) at each --delays-ms"),
    delays_ms: str = typer.Option("0,20", "--delays-ms", help="--edge-cloud: simulated one-way delays, ms"),
    min_confidence: float = typer.Option(
        DEFAULT_MIN_CONFIDENCE, "--min-confidence",
        help="Confidence truncation threshold of the adaptive variants (--gamma-sweep, --edge-cloud)"),
    adaptive: bool = typer.Option(True, "--adaptive/--fixed-gamma", help="--edge-cloud: adaptive γ (≤ -g) or fixed -g"),
    pin: bool = typer.Option(True, "--pin/--no-pin", help="--edge-cloud: pin edge and verifier to separate cores"),
    target: Optional[Path] = typer.Option(None),
    draft: Optional[str] = DRAFT, drafts: Optional[str] = DRAFTS,
    no_hf: bool = typer.Option(False, "--no-hf", help="Skip HF assisted generation"),
    temperature: float = typer.Option(0.0, help="Sampling temperature of all three variants (0 = greedy)"),
    top_k: int = typer.Option(0, "--top-k", help="Top-k of all variants (0 = off)"),
    top_p: float = typer.Option(1.0, "--top-p", help="Top-p of all variants (1 = off)"),
    seed: Optional[int] = typer.Option(None, help="Seed of the sampled runs (checks they are reproducible)"),
    replay: bool = REPLAY,
    duration_s: Optional[float] = DURATION_S,
    verify_policy: Optional[str] = VERIFY_POLICY,
    device: str = typer.Option("auto", help=f"Target device (every mode; HF assisted stays on CPU): {DEVICE_HELP}"),
    dtype: str = typer.Option("auto", help=f"Target dtype: {DTYPE_HELP}"),
    as_json: bool = typer.Option(False, "--json"),
    wan: Optional[str] = WAN, route: Optional[str] = ROUTE,
    jitter_ms: float = JITTER_MS, bandwidth_kbps: float = BANDWIDTH_KBPS,
    draft_slowdown: str = DRAFT_SLOWDOWN, wan_repeats: int = WAN_REPEATS,
    json_schema: Optional[Path] = JSON_SCHEMA,
    repetition_penalty: float = REPETITION_PENALTY,
    presence_penalty: float = PRESENCE_PENALTY,
    frequency_penalty: float = FREQUENCY_PENALTY,
    logit_bias: list[str] = LOGIT_BIAS,
    min_tokens: int = MIN_TOKENS,
    min_p: float = MIN_P, chaos: bool = CHAOS,
    store: str = STORE, sessions: int = SESSIONS, replicas: int = REPLICAS, kv_tokens: Optional[int] = KV_TOKENS,
):
    """Benchmark target-only vs specdec vs HF assisted; or --drafts/--clients/--gamma-sweep/--edge-cloud/--wan/..."""
    from specdec_runtime.common.types import SamplingParams
    from specdec import bench as bench_mod
    processing = _processing(wan is not None or clients or gamma_sweep or edge_cloud or json_schema or chaos or drafts,
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        logit_bias=logit_bias, min_tokens=min_tokens, min_p=min_p)
    if drafts is not None:  # its own mode: specdec/bench/drafts.py
        return _run_drafts(prompts, drafts, (draft, wan, clients, gamma_sweep, edge_cloud, json_schema, chaos,
                                             temperature or None), as_json=as_json, device=device, dtype=dtype,
                           limit=limit, target=target, max_new_tokens=max_new_tokens, gamma=num_speculative_tokens)
    draft_dir = resolve_draft_option(draft)  # a name (int8, distilled, head) or a directory: a directory from here on
    if chaos:  # its own mode: specdec/bench/chaos/ (--chaos in the help of its options)
        return _run_chaos((wan, clients, gamma_sweep, edge_cloud, json_schema), store, sessions, duration_s, seed,
                          target, draft_dir, replicas, kv_tokens, plot)
    if wan is not None:  # its own mode: specdec/bench/wan.py
        return _run_wan(prompts, wan, route, draft_slowdown=draft_slowdown, repeats=wan_repeats, limit=limit, plot=plot,
                        max_new_tokens=max_new_tokens, num_speculative_tokens=num_speculative_tokens, dtype=dtype,
                        jitter_ms=jitter_ms, bandwidth_kbps=bandwidth_kbps, target=target, device=device,
                        draft=draft_dir)
    client_counts = _check_bench_options(temperature, clients, gamma_sweep, edge_cloud, plot, replay, duration_s,
                                         device, dtype, json_schema, verify_policy)
    try:
        with bench_mod.target_placement(device, dtype):  # the target's device in every mode
            report = _run_mode(
                bench_mod, prompts, client_counts, replay=replay, duration_s=duration_s, gamma_sweep=gamma_sweep,
                cloud_replay="cloud" in (route or "").split(","), json_schema=json_schema, edge_cloud=edge_cloud,
                verify_policies=verify_policy, delays_ms=delays_ms, adaptive=adaptive, min_confidence=min_confidence,
                pin=pin, plot=plot, limit=limit, max_new_tokens=max_new_tokens, target=target, no_hf=no_hf,
                draft=draft_dir, num_speculative_tokens=num_speculative_tokens, progress=not as_json,
                sampling=SamplingParams(temperature, top_k, top_p, seed, **processing))
    except (*user_errors(), FileNotFoundError, ImportError, bench_mod.VerifierProcessError) as e:
        fail(str(e))
    _emit(bench_mod, report, as_json=as_json or json_schema is not None)  # the structured report has no tables
