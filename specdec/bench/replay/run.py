"""Measuring: the whole ``--replay`` run (recording, verifier processes pinned apart from the load generator, and
for each N the kernel limit, the batched and the serial replay, the verifier's memory) and its report."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

from .._shared import progress_bar, safe_ratio, resolve_dirs, current_target_placement, threading_config, package_versions
from ..prompts import load_prompts
from ..verifier_process import VERIFIER_STARTUP_TIMEOUT_S, VerifierProcess
from .host_time import host_time_fields, preemption_fields, read_preemptions, read_step_times, read_verify_policy
from .policies import policy_ratios, policy_summary
from .kernel import measure_prefill_share, kernel_kv_tokens, measure_kernel_limit
from .memory import (
    RSS_IDLE_TOLERANCE, RSS_IDLE_TOLERANCE_BYTES, poll_peak, proc_cpu_s, rss_back, settled_memory, verifier_memory,
)
from .recording import Recording, load_or_record
from .sessions import tally_metrics, replay_sessions

REPLAY_DEFAULT_LIMIT = 16  # prompts recorded when no limit is given (round-robin across categories)
REPLAY_DEFAULT_DURATION_S = 20.0
REPLAY_WARMUP_S = 3.0  # untimed replay on each verifier process before its first timed run
REPLAY_NOTES = [  # how to read the report (its "notes")
    "tokens_per_s = the sum over session slots of committed tokens from the slot's first to its last verdict "
    "inside the window / that span (sessions open, prefill and close included): a rate between verdicts, which "
    "does not depend on where the window cuts a batch step (tokens_per_s_window = tokens received inside the "
    "window / the window: it also counts the verdicts of the step that opened the window, computed before it, "
    "and leaves out the step its end cuts: 1.17x / 1.75x the rate at 64 / 256 sessions with 5 / 18 s steps); "
    "the window starts once every session slot has had its first verdict "
    "(ramp_s: the initial burst of N prefills); speedup_vs_serial = tokens_per_s / that of the same verifier "
    "process type with max_batch_size=1 driven by the same N sessions over a window of the same length (one "
    "block per forward pass whatever is queued; the same sessions, so both replays reach blocks of the same "
    "sessions at the same depth and the recorded acceptance of what each verifies is alike: tokens_per_verdict)",
    "speedup_vs_serial_blocks = verdicts_per_s / the serial one's (blocks verified per second, measured as "
    "tokens_per_s is): the kernel limit's own unit, free of the recorded acceptance of the blocks each window "
    "happened to reach",
    "kernel_limit_speedup = time of N single-row target forwards of γ+1 tokens / one N-row forward over the "
    "same contexts, measured in this process on the verifier's cores with its thread count while both "
    "verifiers are idle; it leaves out prefill, which does not batch (see kernel.prefill_share)",
    "host_ms_per_step = the batched verifier's mean time per batch step outside the target forward pass (step: "
    "first item taken off the queue .. answers sent; collecting, rows, verdicts, stopping, commits), "
    "host_fraction_of_step = host s / step s, over the window (its specdec_batch_*_seconds histograms); "
    "collect_ms_per_step is the collecting part of it (waiting up to max_batch_wait_ms for more blocks included)",
    "kv_preemptions = sessions whose KV pages the verifier dropped for an earlier admitted session's rows "
    "(recompute preemption) from the first open to the last close, kv_recomputed_tokens = positions recomputed "
    "after them (0 and 0: the KV pool held every session)",
    "each verdict is compared with the recorded one (num_accepted, next_token_id, committed_length, "
    "finished): a difference is a mismatch and abandons the session",
]


def _core_plan(pin: bool, notes: list[str]) -> tuple[set[int] | None, set[int] | None]:
    """(load generator cores, verifier cores): the first allowed core, and the rest; (None, None) unpinned."""
    if not pin:
        notes.append("CPU pinning off: the load generator and the verifier share every core")
        return None, None
    if not hasattr(os, "sched_getaffinity"):
        notes.append("CPU pinning unavailable on this platform: load generator and verifier NOT pinned")
        return None, None
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        notes.append(f"only {len(allowed)} core allowed: load generator and verifier NOT pinned apart")
        return None, None
    return {allowed[0]}, set(allowed[1:])


def _check_replay_args(client_counts, duration_s: float, max_new_tokens: int, num_speculative_tokens: int,
                       max_batch_size: int) -> list[int]:
    from specdec_runtime.common.errors import InvalidRequestError

    counts = list(dict.fromkeys(int(c) for c in client_counts))
    if not counts or min(counts) < 1:
        raise InvalidRequestError(f"client counts must be >= 1, got {client_counts}")
    if not duration_s > 0:
        raise InvalidRequestError(f"--duration-s must be > 0, got {duration_s}")
    if max_new_tokens < 1 or num_speculative_tokens < 1 or max_batch_size < 1:
        raise InvalidRequestError("max_new_tokens, num_speculative_tokens and max_batch_size must be >= 1")
    return counts


def run_replay_bench(
    prompts: Path,
    client_counts: list[int],
    *,
    duration_s: float = REPLAY_DEFAULT_DURATION_S,
    limit: int | None = None,
    max_new_tokens: int = 128,
    num_speculative_tokens: int = 4,
    target: Path | None = None,
    draft: Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    max_batch_size: int | None = None,
    warmup_s: float = REPLAY_WARMUP_S,
    serial: bool = True,
    pin: bool = True,
    cache_dir: Path | None = None,
    progress: bool = False,
    startup_timeout_s: float = VERIFIER_STARTUP_TIMEOUT_S,
    cloud: bool = False,
    verify_policies: list[str] | None = None,
) -> dict:
    """Replay recorded draft blocks from N concurrent sessions against a verifier process (package docstring).

    Returns ``{"replay": {"N": {"tokens_per_s", "speedup_vs_serial", "kernel_limit_speedup", "mean_batch_size",
    "verify_latency_ms": {"p50", "p99"}, "errors", "mismatches", "sessions_completed", "serial": {...},
    "kernel": {...}, "memory": {...}, ...}}, "recording": {...}, "config": {...}, "notes": [...]}``.
    ``serial=False`` skips the one-block-per-forward verifier (no ``speedup_vs_serial``). ``device``/``dtype``:
    the target's (verifiers, recording, kernel limit); None = :func:`~specdec.bench._shared.target_placement`'s.
    ``cloud``: the same sessions also cloud-decoded (Decode) by N clients against the batched verifier: each N gets
    ``"cloud"`` (its metrics) and ``"speculative_vs_cloud"`` (tokens/s and verifier CPU-s per 1,000 tokens).
    ``verify_policies`` (e.g. ``["fixed", "adaptive"]``): a batched verifier per policy, replayed in turn for each N
    (:mod:`~specdec.bench.replay.policies`; top-level figures: the first's). None: the verifier's default.
    """
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner

    counts = _check_replay_args(client_counts, duration_s, max_new_tokens, num_speculative_tokens, max_batch_size or 1)
    if max_batch_size is None:  # the batched verifier can take every session's block into one pass (kernel limit)
        max_batch_size = max(32, max(counts))
    notes: list[str] = []
    if limit is None:
        limit = REPLAY_DEFAULT_LIMIT
        notes.append(f"no --limit: {limit} prompts (round-robin across categories), recorded once and cached")
    questions = load_prompts(prompts, limit)
    target_dir, draft_dir = resolve_dirs(target, draft)
    dev, dt, dtype_name = _resolve_placement(device, dtype)
    t0 = time.perf_counter()
    runner_box: list = []

    def runner_factory():
        if not runner_box:
            runner_box.append(TargetRunner(target_dir, device=str(dev), dtype=dt))
        return runner_box[0]

    rec = load_or_record(prompts, questions, limit, target_dir, draft_dir, runner_factory,
                         max_new_tokens=max_new_tokens, num_speculative_tokens=num_speculative_tokens,
                         device=str(dev), dtype=dtype_name, cache_dir=cache_dir, progress=progress)
    # the bench's own runner holds the kernel limit's N half-way contexts at once: its pool is sized to them
    kv_tokens = max(65536, kernel_kv_tokens(rec.prompts, max(counts), num_speculative_tokens))
    if runner_box and runner_box[0].kv_cache_budget_tokens < kv_tokens:
        runner_box.clear()  # the recording's runner: too small a pool (weights loaded once more)
    runner = runner_box[0] if runner_box else TargetRunner(target_dir, device=str(dev), dtype=dt,
                                                           kv_cache_budget_tokens=kv_tokens)
    lg_cores, v_cores = _core_plan(pin, notes)
    v_threads = len(v_cores) if v_cores else max(1, (os.cpu_count() or 2) // 2)
    batched_procs, serial_proc = _verifier_processes(
        target_dir, str(dev), dtype_name, max_batch_size, max(256, 2 * max(counts)), serial=serial, v_cores=v_cores,
        v_threads=v_threads, startup_timeout_s=startup_timeout_s, verify_policies=verify_policies)
    batched_proc = next(iter(batched_procs.values()))
    report, exit_status = _run_counts(
        counts, rec, runner, batched_procs, serial_proc, duration_s=duration_s, warmup_s=warmup_s, lg_cores=lg_cores,
        v_cores=v_cores, v_threads=v_threads, num_speculative_tokens=num_speculative_tokens, progress=progress,
        cloud=cloud)
    config = _replay_config(
        prompts, limit, rec, duration_s=duration_s, warmup_s=warmup_s, max_new_tokens=max_new_tokens,
        num_speculative_tokens=num_speculative_tokens, max_batch_size=max_batch_size, device=str(dev),
        dtype=dtype_name, lg_cores=lg_cores, v_cores=v_cores, v_threads=v_threads,
        pinned_with=batched_proc.pinned_with, exit_status=exit_status, target_dir=target_dir, draft_dir=draft_dir,
        run_s=round(time.perf_counter() - t0, 2))
    return {"replay": report, "recording": _recording_summary(rec), "config": config, "notes": notes + REPLAY_NOTES}


def _verifier_processes(target_dir: Path, device: str, dtype: str, max_batch_size: int, max_sessions: int, *,
                        serial: bool, v_cores, v_threads: int, startup_timeout_s: float,
                        verify_policies: list[str] | None = None):
    """({verify policy (None: the default): batched verifier}, one-block-per-forward verifier or None), not started,
    all on the verifier cores (the one-block verifier verifies whole blocks: its rows are never cut)."""
    env = {"SPECDEC_DEVICE": device, "SPECDEC_DTYPE": dtype, "SPECDEC_MAX_BATCH_SIZE": str(max_batch_size),
           "SPECDEC_MAX_SESSIONS": str(max_sessions)}
    batched = {policy: VerifierProcess(target_dir, None, startup_timeout_s, cores=v_cores, metrics=True,
                                       env={**env, **({"SPECDEC_VERIFY_POLICY": policy} if policy else {})},
                                       torch_threads=v_threads)
               for policy in (verify_policies or [None])}
    serial_proc = (VerifierProcess(target_dir, None, startup_timeout_s, cores=v_cores, metrics=True,
                                    env={**env, "SPECDEC_MAX_BATCH_SIZE": "1", "SPECDEC_VERIFY_POLICY": "fixed"},
                                    torch_threads=v_threads)
                   if serial else None)
    return batched, serial_proc


def _replay_config(prompts: Path, limit: int, rec: Recording, *, duration_s: float, warmup_s: float,
                   max_new_tokens: int, num_speculative_tokens: int, max_batch_size: int, device: str, dtype: str,
                   lg_cores, v_cores, v_threads: int, pinned_with, exit_status: dict, target_dir: Path,
                   draft_dir: Path, run_s: float) -> dict:
    return {
        "prompts": str(Path(prompts).expanduser()),
        "limit": limit,
        "num_prompts": len(rec.prompts),
        "duration_s": duration_s,
        "warmup_s": warmup_s,
        "max_new_tokens": max_new_tokens,
        "num_speculative_tokens": num_speculative_tokens,
        "max_batch_size": max_batch_size,
        "device": device,
        "dtype": dtype,
        "decoding": "greedy",
        "transport": "grpc.aio on loopback: one channel and one Verify stream per session slot, one asyncio process",
        "load_generator_cores": sorted(lg_cores) if lg_cores else None,
        "verifier_cores": sorted(v_cores) if v_cores else None,
        "verifier_torch_threads": v_threads,
        "verifier_pinned_with": pinned_with,
        "verifier_exit_status": exit_status,
        "target": str(target_dir),
        "draft": str(draft_dir),
        "cpu_count": os.cpu_count(),
        "threading": threading_config(),
        "versions": package_versions(),
        "run_s": run_s,
    }


def _resolve_placement(device: str | None, dtype: str | None):
    """(torch device, torch dtype, dtype name) of the target: the arguments, else the bench's placement."""
    from specdec_runtime.cloud_verifier.target.runner import resolve_device, resolve_dtype

    placement = current_target_placement()
    dev = resolve_device(device or placement["device"])
    dt = resolve_dtype(dtype or placement["dtype"], dev)
    return dev, dt, str(dt).replace("torch.", "")


def _run_counts(counts: list[int], rec: Recording, runner, batched_procs: dict,
                serial_proc: VerifierProcess | None, *, duration_s: float, warmup_s: float, lg_cores, v_cores,
                v_threads: int, num_speculative_tokens: int, progress: bool, cloud: bool = False
                ) -> tuple[dict, dict]:
    """(report per N, exit status of each verifier process): this process on the load generator's cores, the
    verifiers started and warmed up, each N measured, then the verifiers stopped and this process restored."""
    import torch

    from ..edge_cloud import set_process_affinity

    saved_affinity = os.sched_getaffinity(0) if lg_cores else None
    saved_threads = torch.get_num_threads()
    report: dict[str, dict] = {}
    bar = None
    try:
        if lg_cores:
            set_process_affinity(lg_cores)
        procs = [*batched_procs.values(), *([serial_proc] if serial_proc is not None else [])]
        for p in procs:
            p.start()
        for p in procs:  # untimed: first forward passes, allocator growth, channels
            asyncio.run(replay_sessions(p.address, rec.prompts, min(4, max(counts)), warmup_s,
                                        max_new_tokens=rec.max_new_tokens,
                                        tokenizer_fingerprint=rec.tokenizer_fingerprint))
        bar = progress_bar(progress, len(counts), "replay", "N")
        for i, n in enumerate(counts):
            report[str(n)] = _measure_n(
                n, i, rec, runner, batched_procs, serial_proc, duration_s=duration_s, lg_cores=lg_cores,
                v_cores=v_cores, v_threads=v_threads, num_speculative_tokens=num_speculative_tokens, cloud=cloud,
            )
            torch.set_num_threads(saved_threads)
            if bar is not None:
                bar.set_postfix_str(f"N={n} {report[str(n)]['tokens_per_s'] or 0:.1f} tok/s", refresh=False)
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        exit_status = {}
        named = [(f"batched:{k}" if k else "batched", p) for k, p in batched_procs.items()]
        for name, p in (*named, ("serial", serial_proc)):
            if p is not None:
                with contextlib.suppress(Exception):
                    exit_status[name] = p.stop()
                p.remove_log()
        if saved_affinity is not None:
            set_process_affinity(saved_affinity)
        torch.set_num_threads(saved_threads)
    return report, exit_status


def _recording_summary(rec: Recording) -> dict:
    return {
        "path": str(rec.path),
        "cached": rec.cached,
        "record_s": round(rec.record_s, 2),
        "num_prompts": len(rec.prompts),
        "num_blocks": rec.num_steps,
        "num_output_tokens": sum(len(p.output_token_ids) for p in rec.prompts),
        "mean_prompt_tokens": round(sum(len(p.prompt_token_ids) for p in rec.prompts) / len(rec.prompts), 1),
        "mean_accepted_length": safe_ratio(sum(len(p.output_token_ids) for p in rec.prompts), rec.num_steps),
    }


def _measure_n(n: int, index: int, rec: Recording, runner, batched_procs: dict,
               serial_proc: VerifierProcess | None, *, duration_s: float, lg_cores, v_cores, v_threads: int,
               num_speculative_tokens: int, cloud: bool = False) -> dict:
    """Kernel limit, then the batched and the serial replay (order alternating with ``index``), for one N; with
    ``cloud`` the same sessions cloud-decoded against the batched verifier last."""
    import torch

    from ..edge_cloud import set_process_affinity

    if v_cores:
        set_process_affinity(v_cores)
    torch.set_num_threads(v_threads)
    try:
        kernel = measure_kernel_limit(runner, rec.prompts, n, num_speculative_tokens)
    finally:
        if lg_cores:
            set_process_affinity(lg_cores)
    kernel["prefill_share"] = measure_prefill_share(runner, rec, kernel, v_cores, lg_cores, v_threads)
    policies = list(batched_procs)
    batched_proc = batched_procs[policies[0]]
    order = [("batched", p) for p in policies] + [("serial", None)]
    order = (order if index % 2 == 0 else order[::-1]) + ([("cloud", None)] if cloud else [])
    out: dict[str, Any] = {}
    by_policy: dict[str, dict] = {}
    memory: dict[str, Any] = {}
    for mode, policy in order:
        if mode == "serial" and serial_proc is None:
            continue
        proc = serial_proc if mode == "serial" else batched_procs[policy] if mode == "batched" else batched_proc
        before = read_verify_policy(proc.metrics_url) if mode == "batched" else None
        got, idle, peak, after = _replay_mode(proc, rec, n, duration_s, cloud=mode == "cloud")
        if mode == "batched" and policy is not None:
            by_policy[policy] = policy_summary(got, before, read_verify_policy(proc.metrics_url))
        if mode == "batched" and policy != policies[0]:
            continue
        out[mode] = got
        if mode == "batched":
            memory = {
                "idle": idle, "peak": peak, "after": after,
                "kv_back_to_idle": after["kv_cache_used_bytes"] == idle["kv_cache_used_bytes"],
                "rss_back_to_idle": rss_back(idle["rss_bytes"], after["rss_bytes"]),
                "rss_tolerance": f"{RSS_IDLE_TOLERANCE:.0%} of idle or {RSS_IDLE_TOLERANCE_BYTES >> 20} MiB",
            }
    entry = _entry(out, kernel, memory)
    if by_policy:
        entry["verify_policy"] = by_policy
        entry["tokens_per_s_vs_" + policies[0]] = policy_ratios(by_policy, policies[0])
    return entry


def _replay_mode(proc: VerifierProcess, rec: Recording, clients: int, duration_s: float, cloud: bool = False):
    """One timed replay by ``clients`` sessions against ``proc``: (its metrics, the verifier's memory idle before,
    at its peak during, settled after)."""
    idle = verifier_memory(proc)
    peak: dict = {}
    cpu: dict[str, float | None] = {}
    steps: dict[str, dict | None] = {}
    pid = proc.proc.pid if proc.proc is not None else None

    def on_window(what: str) -> None:  # CPU time and step histograms at the window's start and end
        cpu[what] = proc_cpu_s(pid)
        steps[what] = read_step_times(proc.metrics_url)

    async def run():
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_peak(proc, peak, stop))
        try:
            return await replay_sessions(proc.address, rec.prompts, clients, duration_s,
                                         max_new_tokens=rec.max_new_tokens,
                                         tokenizer_fingerprint=rec.tokenizer_fingerprint,
                                         on_window=on_window, cloud=cloud)
        finally:
            stop.set()
            await poller

    preempted_before = read_preemptions(proc.metrics_url)
    tally = asyncio.run(run())
    preempted = preemption_fields(preempted_before, read_preemptions(proc.metrics_url))
    after = settled_memory(proc, idle["rss_bytes"])
    metrics = {"clients": clients, **tally_metrics(tally), **preempted}
    cpu_s = (cpu["end"] - cpu["start"]) if cpu.get("end") is not None and cpu.get("start") is not None else None
    metrics["verifier_cpu_s"] = round(cpu_s, 2) if cpu_s is not None else None
    metrics["tokens_per_verifier_cpu_s"] = safe_ratio(tally.tokens, cpu_s or 0)
    # the verifier's host time per batch step outside the forward pass (its batcher's histograms)
    metrics.update(host_time_fields(steps.get("start"), steps.get("end")))
    return metrics, idle, peak, after


def _entry(out: dict, kernel: dict, memory: dict) -> dict:
    """The report of one N: the batched replay's metrics, the speedups over the serial one and the fractions of
    the kernel limit they reach."""
    batched = out["batched"]
    entry = {
        "tokens_per_s": batched["tokens_per_s"],
        "speedup_vs_serial": (safe_ratio(batched["tokens_per_s"] or 0, out["serial"]["tokens_per_s"] or 0)
                              if "serial" in out else None),
        "speedup_vs_serial_window": (safe_ratio(batched["tokens_per_s_window"] or 0,
                                            out["serial"]["tokens_per_s_window"] or 0) if "serial" in out else None),
        "kernel_limit_speedup": kernel["speedup"],
        **{k: v for k, v in batched.items() if k != "tokens_per_s"},
        "kernel": kernel,
        "memory": memory,
    }
    if "cloud" in out:  # the same sessions cloud-decoded: capacity side by side (docs/routing.md)
        entry["cloud"] = out["cloud"]
        entry["speculative_vs_cloud"] = {name: {
            "tokens_per_s": m["tokens_per_s"],
            "verifier_cpu_s_per_1000_tokens": safe_ratio(1000, m["tokens_per_verifier_cpu_s"] or 0),
            "target_forward_passes": m.get("target_forward_passes"),
            "forward_passes_per_1000_tokens": safe_ratio(1000 * (m.get("target_forward_passes") or 0),
                                                     m.get("num_tokens") or 0)}
            for name, m in (("speculative", batched), ("cloud", out["cloud"]))}
    if "serial" in out:
        entry["serial"] = out["serial"]
        if entry["speedup_vs_serial"] and kernel["speedup"]:
            entry["fraction_of_kernel_limit"] = round(entry["speedup_vs_serial"] / kernel["speedup"], 3)
        blocks = safe_ratio(batched.get("verdicts_per_s") or 0, out["serial"].get("verdicts_per_s") or 0)
        entry["speedup_vs_serial_blocks"] = blocks
        if blocks and kernel["speedup"]:
            entry["fraction_of_kernel_limit_blocks"] = round(blocks / kernel["speedup"], 3)
        # the same ratios per CPU second of the verifier (kernel: of this process): what other jobs on a shared
        # machine take from the verifier's core drops out
        cpu_speedup = safe_ratio(batched["tokens_per_verifier_cpu_s"] or 0,
                             out["serial"]["tokens_per_verifier_cpu_s"] or 0)
        entry["speedup_vs_serial_cpu"] = cpu_speedup
        if cpu_speedup and kernel.get("speedup_cpu"):
            entry["fraction_of_kernel_limit_cpu"] = round(cpu_speedup / kernel["speedup_cpu"], 3)
        with_prefill = kernel["prefill_share"]["kernel_limit_speedup_with_prefill"]
        if cpu_speedup and with_prefill:
            entry["fraction_of_kernel_limit_with_prefill_cpu"] = round(cpu_speedup / with_prefill, 3)
    return entry
