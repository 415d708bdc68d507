"""The verifier's host time per batch step outside the target forward pass, read from its /metrics over a replay's
window: the batcher's ``specdec_batch_step_seconds`` / ``specdec_batch_host_seconds`` /
``specdec_batch_collect_seconds`` histograms (cloud_verifier/metrics.py), their sums and counts at the window's
start and end. On a GPU the forward pass shrinks to milliseconds and this host work does not: it is what the
accelerator would sit idle for."""

from __future__ import annotations

import urllib.request

STEP_METRICS = ("specdec_batch_step_seconds", "specdec_batch_host_seconds", "specdec_batch_collect_seconds")
FORWARD_PASSES = "specdec_target_forward_passes_total"  # the target runner's counter (cloud_verifier/metrics.py)


def _metrics_text(url: str | None) -> str | None:
    """The text the /metrics address ``url`` serves; None when there is no URL or it does not answer."""
    if not url:
        return None
    try:
        return urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return None


def _read_metrics(url: str | None) -> dict[str, float] | None:
    """{sample name: value} of every unlabelled sample the /metrics address ``url`` serves; None when there is no
    URL or it does not answer."""
    body = _metrics_text(url)
    if body is None:
        return None
    out = {}
    for line in body.splitlines():
        name, _, rest = line.partition(" ")
        if rest and not name.startswith("#") and "{" not in name:
            out[name] = float(rest.split()[0])
    return out


def read_step_times(url: str | None) -> dict[str, float] | None:
    """{"<histogram>_sum": s, "<histogram>_count": steps} of the step histograms at ``url`` (a /metrics address),
    and the target's forward-pass counter (``FORWARD_PASSES``, 0 when not served); None when there is no URL, it
    does not answer or does not serve the histograms."""
    served = _read_metrics(url)
    wanted = [f"{m}_{part}" for m in STEP_METRICS for part in ("sum", "count")]
    if served is None or any(name not in served for name in wanted):
        return None
    return {**{name: served[name] for name in wanted}, FORWARD_PASSES: served.get(FORWARD_PASSES, 0.0)}


PREEMPTION_COUNTERS = ("specdec_kv_preemptions_total", "specdec_kv_recomputed_tokens_total")


def read_preemptions(url: str | None) -> dict[str, float] | None:
    """{counter: value} of the verifier's KV preemption counters (cloud_verifier/kv/scheduler.py) at ``url`` (a
    /metrics address); None when there is no URL or it does not answer (a counter it does not serve reads 0)."""
    served = _read_metrics(url)
    return None if served is None else {name: served.get(name, 0.0) for name in PREEMPTION_COUNTERS}


def preemption_fields(before: dict | None, after: dict | None) -> dict:
    """The replay report's ``kv_preemptions`` (sessions preempted) and ``kv_recomputed_tokens`` (positions
    recomputed after a preemption) from the sessions' start to their last close; None when a reading is missing."""
    if not before or not after:
        return {"kv_preemptions": None, "kv_recomputed_tokens": None}
    return {"kv_preemptions": int(after[PREEMPTION_COUNTERS[0]] - before[PREEMPTION_COUNTERS[0]]),
            "kv_recomputed_tokens": int(after[PREEMPTION_COUNTERS[1]] - before[PREEMPTION_COUNTERS[1]])}


def host_time_fields(start: dict | None, end: dict | None) -> dict:
    """The replay report's host-time fields over a window, from two :func:`read_step_times` readings:
    ``host_ms_per_step`` (mean host time of a step outside the forward pass, ms), ``host_fraction_of_step``
    (host seconds / step seconds), ``step_ms_per_step``, ``collect_ms_per_step`` (the collecting part of the host
    time, waiting for more blocks included), ``steps`` and ``target_forward_passes`` (the target's forward passes
    over the window: a step runs one, prefill chunks included). All None when a reading is missing or no step
    ran."""
    fields = {"host_ms_per_step": None, "host_fraction_of_step": None, "step_ms_per_step": None,
              "collect_ms_per_step": None, "steps": None, "target_forward_passes": None}
    if not start or not end:
        return fields

    def delta(name: str) -> float:
        return end[name] - start[name]

    steps = delta("specdec_batch_step_seconds_count")
    step_s = delta("specdec_batch_step_seconds_sum")
    fields["steps"] = int(steps)
    fields["target_forward_passes"] = int(end.get(FORWARD_PASSES, 0.0) - start.get(FORWARD_PASSES, 0.0))
    if steps <= 0 or step_s <= 0:
        return fields
    host_s = delta("specdec_batch_host_seconds_sum")
    fields.update(
        host_ms_per_step=round(1000 * host_s / steps, 3),
        host_fraction_of_step=round(host_s / step_s, 4),
        step_ms_per_step=round(1000 * step_s / steps, 3),
        collect_ms_per_step=round(1000 * delta("specdec_batch_collect_seconds_sum") / steps, 3),
    )
    return fields


def read_verify_policy(url: str | None) -> dict | None:
    """The verify policy's gauges and counters at ``url`` (a /metrics address, cloud_verifier/metrics.py):
    {"cost_model_s": {term: s}, "calibration_error": {"raw", "calibrated"}, "positions": {"drafted",
    "verified"}}; None when there is no URL or it does not answer."""
    body = _metrics_text(url)
    if body is None:
        return None
    out: dict = {"cost_model_s": {}, "calibration_error": {}, "positions": {}}
    fields = {"specdec_verify_cost_seconds": ("cost_model_s", "term"),
              "specdec_verify_calibration_error": ("calibration_error", "estimate"),
              "specdec_verify_positions_total": ("positions", "kind")}
    for line in body.splitlines():
        name, _, rest = line.partition("{")
        if name in fields and rest:
            key, label = fields[name]
            labels, _, value = rest.partition("} ")
            got = dict(part.split("=", 1) for part in labels.split(",") if "=" in part)
            out[key][got.get(label, "").strip('"')] = float(value.split()[0])
    return out
