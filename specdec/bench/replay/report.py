"""The ``--replay`` report as a table."""

from __future__ import annotations

from ..cells import fmt


def print_replay_report(report: dict, console) -> None:
    """The ``--replay`` report as a rich table (``specdec bench --replay`` without ``--json``)."""
    from rich.table import Table

    t = Table(title="Verifier under load: recorded blocks replayed by one asyncio process "
                    "(verifier in its own process)")
    for col in ("N", "tok/s", "serial tok/s", "speedup vs serial", "kernel limit", "kernel limit w/ prefill",
                "mean batch", "host ms/step", "p50 ms", "p99 ms", "errors", "mismatches", "sessions done", "KV preempted",
                "KV after",
                "RSS idle→after"):
        t.add_column(col, justify="right")
    for n, m in report["replay"].items():
        mem = m.get("memory") or {}
        idle, after = mem.get("idle") or {}, mem.get("after") or {}
        rss = (f"{(idle.get('rss_bytes') or 0) / 2**20:.0f}→{(after.get('rss_bytes') or 0) / 2**20:.0f} MiB"
               if idle.get("rss_bytes") else "—")
        t.add_row(n, fmt(m["tokens_per_s"], ".1f"), fmt((m.get("serial") or {}).get("tokens_per_s"), ".1f"),
                  fmt(m["speedup_vs_serial"]), fmt(m["kernel_limit_speedup"]),
                  fmt(m["kernel"]["prefill_share"]["kernel_limit_speedup_with_prefill"]),
                  fmt(m["mean_batch_size"]), _host(m), fmt(m["verify_latency_ms"]["p50"], ".1f"),
                  fmt(m["verify_latency_ms"]["p99"], ".1f"), str(m["errors"]), str(m["mismatches"]),
                  str(m["sessions_completed"]), fmt(m.get("kv_preemptions"), ".0f"),
                  fmt(after.get("kv_cache_used_bytes"), ".0f"), rss)
    console.print(t)


def _host(m: dict) -> str:
    """The verifier's host time per step outside the forward pass and its share of the step: "3.1 (4%)"."""
    if m.get("host_ms_per_step") is None:
        return "—"
    return f"{m['host_ms_per_step']:.1f} ({m['host_fraction_of_step']:.0%})"
