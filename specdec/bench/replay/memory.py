"""Memory of a verifier process during a replay: KV reservation and open sessions (its /metrics), VmRSS and CPU
time (/proc), idle before, peak during, settled after."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

from ..verifier_process import VerifierProcess

RSS_IDLE_TOLERANCE = 0.05  # RSS counts as back to idle within 5 % (or 16 MiB) of the idle value
RSS_IDLE_TOLERANCE_BYTES = 16 << 20


def _read_metric(url: str, name: str) -> float | None:
    import urllib.request

    try:
        body = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return None
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _proc_status_bytes(pid: int, field_name: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def proc_cpu_s(pid: int | None) -> float | None:
    """CPU time (user + system, all threads) of process ``pid`` so far, s."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def verifier_memory(proc: VerifierProcess) -> dict:
    """The verifier process's reserved KV (/metrics ``specdec_kv_cache_used_bytes``), open sessions and VmRSS."""
    pid = proc.proc.pid if proc.proc is not None else None
    url = proc.metrics_url
    return {
        "kv_cache_used_bytes": _read_metric(url, "specdec_kv_cache_used_bytes") if url else None,
        "sessions_open": _read_metric(url, "specdec_sessions_open") if url else None,
        "rss_bytes": _proc_status_bytes(pid, "VmRSS") if pid else None,
    }


async def poll_peak(proc: VerifierProcess, peak: dict, stop: asyncio.Event, period_s: float = 1.0) -> None:
    """Track the peak KV reservation and RSS of the verifier while a run lasts (one read per period)."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        m = await loop.run_in_executor(None, verifier_memory, proc)
        for k in ("kv_cache_used_bytes", "rss_bytes"):
            if m.get(k) is not None:
                peak[k] = max(peak.get(k) or 0, m[k])
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)


def settled_memory(proc: VerifierProcess, idle_rss: int | None, timeout_s: float = 12.0) -> dict:
    """Memory after a run: polled until no session is open, the KV reservation is 0 and RSS is within
    RSS_IDLE_TOLERANCE_BYTES of ``idle_rss`` (or ``timeout_s`` passes: the verifier's reaper gives freed heap
    pages back once per reap interval, 5 s by default, when it finds no session); the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = verifier_memory(proc)
        settled = (m["sessions_open"] in (0, None) and m["kv_cache_used_bytes"] in (0, None)
                   and (idle_rss is None or m["rss_bytes"] is None
                        or m["rss_bytes"] <= idle_rss + RSS_IDLE_TOLERANCE_BYTES))
        if settled or time.monotonic() > deadline:
            m["settle_s"] = round(timeout_s - max(0.0, deadline - time.monotonic()), 1)
            return m
        time.sleep(0.5)


def rss_back(idle: int | None, after: int | None) -> bool:
    if idle is None or after is None:
        return True
    return after <= idle + max(RSS_IDLE_TOLERANCE * idle, RSS_IDLE_TOLERANCE_BYTES)
