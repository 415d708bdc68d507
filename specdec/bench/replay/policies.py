"""``bench --replay --verify-policy fixed,adaptive``: one batched verifier per verify policy, the same recorded
blocks replayed against each (interleaved per N), and per policy what the issue of adaptive verification asks to
see side by side: tokens/s, verified positions per committed token, mean verified positions per block (k), step
time, errors, mismatches; the verifier's cost model and calibration error (its /metrics)."""

from __future__ import annotations

from .._shared import safe_ratio

__all__ = ["policy_ratios", "policy_summary"]


def policy_summary(metrics: dict, before: dict | None, after: dict | None) -> dict:
    """One policy's figures for one N: from the replay's metrics (``_replay_mode``) and two readings of the
    verifier's verify-policy metrics (:func:`~specdec.bench.replay.host_time.read_verify_policy`) around it."""
    out = {k: metrics.get(k) for k in ("tokens_per_s", "verified_positions_per_token", "mean_verified_positions",
                                        "tokens_per_verdict", "step_ms_per_step", "mean_batch_size", "errors",
                                        "mismatches", "sessions_completed")}
    if before and after:
        pos = {k: after["positions"].get(k, 0.0) - before["positions"].get(k, 0.0) for k in ("drafted", "verified")}
        out["verified_fraction_of_drafted"] = safe_ratio(pos["verified"], pos["drafted"])
        out["cost_model_s"] = after["cost_model_s"]
        out["calibration_error"] = after["calibration_error"]
    return out


def policy_ratios(by_policy: dict[str, dict], base: str) -> dict[str, float | None]:
    """tokens/s of each policy over ``base``'s (the first policy given)."""
    ref = by_policy[base].get("tokens_per_s") or 0
    return {p: safe_ratio(m.get("tokens_per_s") or 0, ref) for p, m in by_policy.items()}
