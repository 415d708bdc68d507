"""The kernel limit of a replay: N single-row target forwards vs one N-row forward over recorded contexts, and the
share of the workload's prefill (which does not batch) in kernel time."""

from __future__ import annotations

import time

from .._shared import safe_ratio
from .recording import RecordedPrompt, Recording

KERNEL_REPEATS = 3


def measure_kernel_limit(runner, prompts: list[RecordedPrompt], n: int, num_speculative_tokens: int,
                         repeats: int | None = None) -> dict:
    """N single-row target forwards of γ + 1 tokens vs ONE N-row forward over the same contexts.

    Row i: recorded prompt i mod P half-way through its session (its committed length there, its last committed
    token and its recorded block, padded to γ). KV caches are zero-filled (attention costs the same whatever
    the keys hold). Times are medians over ``repeats`` (serial: the sum of the N single-row forwards).
    """
    import numpy as np

    from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow

    gamma = num_speculative_tokens
    repeats = repeats or (KERNEL_REPEATS if n > 16 else 2 * KERNEL_REPEATS - 1)
    rows, kvs, contexts = [], [], []
    try:
        for p, k in _kernel_steps(prompts, n, gamma):
            committed = p.committed_before(k)
            draft = list(p.steps[k].draft_token_ids)
            draft = (draft + committed[-gamma:] * gamma)[:gamma]  # short block (end of a session): padded
            ctx = len(committed)
            kv = runner.allocate(ctx + gamma)
            kvs.append(kv)
            contexts.append(ctx)
            rows.append(ForwardRow(kv, [committed[-1], *draft], ctx - 1, "all"))
        runner.forward(rows[:1])  # warm-up
        runner.forward(rows)
        serial, batched, serial_cpu, batched_cpu = [], [], [], []
        for r in range(repeats):  # the order alternates: a slow patch of a shared machine hits both alike
            for kind in (("serial", "batched") if r % 2 == 0 else ("batched", "serial")):
                t, c = time.perf_counter(), time.process_time()
                if kind == "serial":
                    for row in rows:
                        runner.forward([row])
                    serial.append(time.perf_counter() - t)
                    serial_cpu.append(time.process_time() - c)
                else:
                    runner.forward(rows)
                    batched.append(time.perf_counter() - t)
                    batched_cpu.append(time.process_time() - c)
    finally:
        for kv in kvs:
            runner.free(kv)
    s, b = float(np.median(serial)), float(np.median(batched))
    return {
        "speedup": safe_ratio(s, b),
        "speedup_cpu": safe_ratio(float(np.median(serial_cpu)), float(np.median(batched_cpu))),
        "serial_ms": round(s * 1000, 2),
        "single_row_ms": round(s * 1000 / n, 2),
        "batched_ms": round(b * 1000, 2),
        "single_row_cpu_ms": round(float(np.median(serial_cpu)) * 1000 / n, 2),
        "batched_cpu_ms": round(float(np.median(batched_cpu)) * 1000, 2),
        "mean_context_tokens": round(sum(contexts) / len(contexts), 1),
        "tokens_per_row": gamma + 1,
        "repeats": repeats,
    }


def _kernel_steps(prompts: list[RecordedPrompt], n: int, gamma: int) -> list[tuple[RecordedPrompt, int]]:
    """(prompt, step index) of each of the N rows: recorded prompt i mod P half-way through its session."""
    out = []
    for i in range(n):
        p = prompts[i % len(prompts)]
        full = [k for k, s in enumerate(p.steps) if len(s.draft_token_ids) == gamma] or list(range(len(p.steps)))
        out.append((p, full[len(full) // 2]))
    return out


def kernel_kv_tokens(prompts: list[RecordedPrompt], n: int, gamma: int, page_size: int = 16) -> int:
    """KV pool tokens the kernel limit of N rows (and the prefill share's prompt) holds at once: every row's
    context + γ in whole KV pages, plus the longest prompt. The bench's own runner is sized to it (the verifier's
    default pool may be smaller than 256 half-way sessions need: its admission counts KV pages held)."""
    tokens = sum(-(-(p.steps[k].committed_length + gamma) // page_size) * page_size
                 for p, k in _kernel_steps(prompts, n, gamma))
    return tokens + max(len(p.prompt_token_ids) for p in prompts) + page_size


def measure_prefill_share(runner, rec: Recording, kernel: dict, v_cores, lg_cores, v_threads: int) -> dict:
    """How much of the replayed work is prefill, in kernel time: one forward of a typical prompt prefill
    chunk vs the recorded sessions' verify forwards, serial and batched (explains a speedup below the kernel
    limit: prefill is compute-bound and gains nothing from batching)."""
    import torch

    from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow
    from ..edge_cloud import set_process_affinity

    lengths = sorted(len(p.prompt_token_ids) for p in rec.prompts)
    median = lengths[len(lengths) // 2]
    if v_cores:
        set_process_affinity(v_cores)
    torch.set_num_threads(v_threads)
    kv = runner.allocate(median)
    times = []
    try:
        for _ in range(2):
            c = time.process_time()
            runner.forward([ForwardRow(kv, [1] * (median - 1), 0, "none")])
            times.append((time.process_time() - c) * 1000)
    finally:
        runner.free(kv)
        if lg_cores:
            set_process_affinity(lg_cores)
    per_token_ms = min(times) / max(1, median - 1)
    prefill_ms = sum(len(p.prompt_token_ids) - 1 for p in rec.prompts) * per_token_ms
    blocks = rec.num_steps
    n_rows = round(kernel["serial_ms"] / kernel["single_row_ms"]) if kernel["single_row_ms"] else 1
    serial_ms = blocks * kernel["single_row_cpu_ms"] + prefill_ms
    batched_ms = blocks * kernel["batched_cpu_ms"] / n_rows + prefill_ms
    return {
        "basis": "CPU time of the recorded workload's forwards: every prompt prefilled once, every block verified "
                 "alone (serial) or in full N-row forwards (batched)",
        "prefill_cpu_ms_per_prompt_token": round(per_token_ms, 3),
        "of_serial_kernel_time": round(prefill_ms / serial_ms, 3),
        "of_batched_kernel_time": round(prefill_ms / batched_ms, 3),
        "kernel_limit_speedup_with_prefill": round(serial_ms / batched_ms, 3),
    }
