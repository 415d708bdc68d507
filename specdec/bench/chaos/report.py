"""The chaos run's one JSON report and its plot (sessions' committed tokens over time, the faults marked).

Pause after a fault: for each session with a request in flight when the fault was injected, the time from the
injection to its next committed token; the fault's pause is the longest of them (faults with no request in
flight have none). Reported per fault kind as p50 / p99 / max over the faults of that kind, s.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict

from specdec.bench.chaos.faults import FAULT_KINDS, FaultEvent
from specdec.bench.chaos.workload import RETRIED_ERRORS, Outcome, Progress


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def fault_pauses(events: list[FaultEvent], outcomes: list[Outcome], progress: Progress) -> dict[str, list[float]]:
    """Pause after each fault (see the module docstring), s, by fault kind."""
    token_times: dict[int, list[float]] = defaultdict(list)
    for t, session, _ in progress.events:
        token_times[session].append(t)
    for times in token_times.values():
        times.sort()
    pauses: dict[str, list[float]] = defaultdict(list)
    for e in events:
        gaps = []
        for o in outcomes:
            if o.t_start < e.t_s < o.t_end:
                times = token_times.get(o.session, [])
                i = bisect.bisect_right(times, e.t_s)
                if i < len(times) and times[i] <= o.t_end:
                    gaps.append(times[i] - e.t_s)
        if gaps:
            pauses[e.kind].append(max(gaps))
    return pauses


def build_report(*, config: dict, outcomes: list[Outcome], problems: list[dict], events: list[FaultEvent],
                 progress: Progress, cleanup: dict, rss: dict, extra: dict) -> dict:
    """The JSON-able report (the keys are described in docs/benchmarks.md, "Chaos")."""
    verdicts = Counter(p["verdict"] for p in problems)
    for p in problems:  # which faults a problem overlapped: where to look for its cause
        p["faults_during"] = [e.kind for e in events if p["t_start"] <= e.t_s <= p["t_end"]
                              or (e.recovered_s is not None and e.t_s <= p["t_start"] <= e.recovered_s)]
    pauses = fault_pauses(events, outcomes, progress)
    return {
        "mode": "chaos", **config,
        "requests": len(outcomes),
        "requests_by_kind": dict(sorted(Counter(o.request.kind for o in outcomes).items())),
        "tokens": sum(o.num_tokens for o in outcomes),
        "faults": len(events),
        "faults_by_kind": {k: sum(e.kind == k for e in events) for k in FAULT_KINDS},
        "min_faults_per_kind": min(sum(e.kind == k for e in events) for k in FAULT_KINDS),
        "fault_errors": [e.to_json() for e in events if e.error],
        "mismatches": verdicts.get("mismatch", 0),
        "lost": verdicts.get("lost", 0),
        "truncated": verdicts.get("truncated", 0),
        "logprobs_missing": verdicts.get("logprobs_missing", 0),
        "problems": problems[:20],
        "errors_by_code": dict(sorted(Counter([o.error for o in outcomes if o.error]
                                              + [c for o in outcomes for c in o.retried_errors]).items())),
        "retried_requests": sum(bool(o.retried_errors) for o in outcomes),
        "undocumented_errors": sum(bool(o.error) and o.error not in RETRIED_ERRORS for o in outcomes),
        "failovers": sum(o.num_failovers for o in outcomes),
        "reopened_sessions": sum(o.num_reopened_sessions for o in outcomes),
        "pause_s": {k: {"n": len(v), "p50": round(_percentile(v, 50), 3), "p99": round(_percentile(v, 99), 3),
                        "max": round(max(v), 3)} for k, v in sorted(pauses.items())},
        **cleanup,
        "rss_growth_bytes": rss,
        **extra,
        "fault_events": [e.to_json() for e in events],
    }


_COLORS = {"replica_kill": "tab:red", "replica_drain": "tab:orange", "redis_master_kill": "tab:purple",
           "redis_restart": "tab:pink", "wan_stall": "tab:blue", "wan_reset": "tab:cyan", "wan_latency": "tab:green"}


def plot_progress(report: dict, progress: Progress, events: list[FaultEvent], path) -> None:
    """Committed tokens of each session over time (one line each), every fault a shaded span from its
    injection to its recovery, coloured by kind (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    per_session: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for t, session, n in sorted(progress.events):
        prev = per_session[session][-1][1] if per_session[session] else 0
        per_session[session].append((t, prev + n))
    for session, points in sorted(per_session.items()):
        ax.plot([p[0] for p in points], [p[1] for p in points], linewidth=0.9, color="0.35", alpha=0.7)
    seen = set()
    for e in events:
        end = e.recovered_s if e.recovered_s is not None else e.t_s
        label = None if e.kind in seen else e.kind
        seen.add(e.kind)
        ax.axvspan(e.t_s, max(end, e.t_s + 0.15), color=_COLORS.get(e.kind, "k"), alpha=0.25, label=label)
        ax.axvline(e.t_s, color=_COLORS.get(e.kind, "k"), linewidth=1.0)
    ax.set_xlabel("time since start, s")
    ax.set_ylabel("committed tokens per session")
    ax.set_title(f"chaos ({report['store']}): {report['sessions']} sessions, {report['requests']} requests, "
                 f"{report['faults']} faults, {report['mismatches']} mismatches, {report['lost']} lost", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
