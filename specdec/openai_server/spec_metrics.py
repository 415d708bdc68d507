"""Per-request speculative-decoding metrics in the shape vLLM's OpenAI server answers them, and the edge–cloud
fields vLLM has no notion of; plus the one log line per request that ``edge-serve`` prints.

vLLM (``--per-request-spec-decode-metrics summary``, vllm-project/vllm#48915) puts a top-level ``metrics`` object in
the response (the last chunk of a streamed one)::

    "metrics": {"speculative_decoding": {"mean_acceptance_length": 1.23, "draft_acceptance_rate": 0.08,
                "acceptance_histogram": [39, 1, 0, 3], "num_spec_steps": 43, "num_accepted_draft_tokens": 10,
                "num_draft_tokens": 129, "num_spec_tokens": 3}}

``acceptance_histogram[j]``: verify steps that accepted exactly ``j`` draft tokens. Here it is derived from the
accepted counts per position (a step that accepts position ``j`` accepted every position before it):
steps accepting at least ``j`` tokens = ``num_drafts`` for ``j = 0``, ``num_accepted_tokens_per_pos[j - 1]`` after.
``mean_acceptance_length`` = 1 + accepted / steps (tokens per verify step, τ); ``draft_acceptance_rate`` =
accepted / draft tokens (None when nothing was drafted). ``metrics.edge_cloud`` adds what only an edge–cloud
system has: the route taken (and the one asked for), the fallback reason (why the generation left the route it
would have taken: its draft quarantined by the verifier, or no verifier answering; None when it did not), the
network round trip, draft and target time, verify positions the verifier left unjudged (adaptive verification),
tokens decoded unverified during a device fallback, and the draft version.
"""

from __future__ import annotations

import logging

log = logging.getLogger("specdec.edge_serve")


def acceptance_histogram(num_drafts: int, accepted_per_pos: list[int]) -> list[int]:
    """Verify steps that accepted exactly j draft tokens, j = 0..len(accepted_per_pos)."""
    at_least = [num_drafts, *accepted_per_pos, 0]
    return [max(0, at_least[j] - at_least[j + 1]) for j in range(len(at_least) - 1)]


def speculative_decoding(stats, num_spec_tokens: int) -> dict:
    """vLLM's ``metrics.speculative_decoding`` of one generation's statistics (edge_client.stats.GenerationStats)."""
    steps = stats.num_drafts
    return {
        "mean_acceptance_length": 1.0 + stats.num_accepted_tokens / steps if steps else None,
        "draft_acceptance_rate": stats.num_accepted_tokens / stats.num_draft_tokens if stats.num_draft_tokens
        else None,
        "acceptance_histogram": acceptance_histogram(steps, list(stats.num_accepted_tokens_per_pos)),
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": stats.num_accepted_tokens,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_spec_tokens": num_spec_tokens,
    }


def edge_cloud(result, rtt_ms: float | None, draft_version: tuple[str, str]) -> dict:
    """The edge–cloud fields of one generation (``result``: edge_client.generation.run.GenerationResult)."""
    s, route = result.stats, result.route or {}
    name, version = draft_version
    return {
        "route": route.get("final") or route.get("requested") or "speculative",
        "route_requested": route.get("requested") or "speculative",
        "route_switches": len(route.get("switches", ())),
        "fallback_reason": route.get("fallback") or None,
        "rtt_ms": None if rtt_ms is None else round(rtt_ms, 3),
        "draft_ms": round(s.draft_s * 1000, 3),
        "target_forward_ms": round(s.target_forward_s * 1000, 3),
        "num_unjudged_draft_tokens": s.num_unjudged_draft_tokens,
        "num_unverified_tokens": result.num_unverified_tokens,
        "num_sessions": result.num_sessions,
        "num_failovers": result.num_failovers,
        "draft_version": f"{name}@{version}" if name else None,
    }


def merge(metrics: list[dict]) -> dict:
    """One response's ``metrics`` from its choices' (n > 1: counts added, rates recomputed)."""
    if len(metrics) == 1:
        return metrics[0]
    specs = [m["speculative_decoding"] for m in metrics]
    steps = sum(s["num_spec_steps"] for s in specs)
    accepted = sum(s["num_accepted_draft_tokens"] for s in specs)
    drafted = sum(s["num_draft_tokens"] for s in specs)
    width = max(len(s["acceptance_histogram"]) for s in specs)
    hist = [sum(s["acceptance_histogram"][j] for s in specs if j < len(s["acceptance_histogram"]))
            for j in range(width)]
    spec = {"mean_acceptance_length": 1.0 + accepted / steps if steps else None,
            "draft_acceptance_rate": accepted / drafted if drafted else None, "acceptance_histogram": hist,
            "num_spec_steps": steps, "num_accepted_draft_tokens": accepted, "num_draft_tokens": drafted,
            "num_spec_tokens": max(s["num_spec_tokens"] for s in specs)}
    return {"speculative_decoding": spec, "edge_cloud": metrics[0]["edge_cloud"]}


def log_request(request_id: str, tenant: str, outcomes: list, finish: str | None = None) -> None:
    """The one line per request: id, tenant, route, draft (``Outcome.draft``: a delivered draft's name@version,
    a local draft's or head's directory name), prompt and output tokens, time to first token, decode tokens/s,
    acceptance, finish reason (no prompt or text: docs/security.md, "Logs")."""
    if not outcomes:
        log.info("request %s tenant=%s finish=%s", request_id, tenant or "-", finish or "error")
        return
    first = outcomes[0]
    m = merge([o.metrics for o in outcomes])
    spec, ec = m["speculative_decoding"], m["edge_cloud"]
    ttft, tps = first.timing
    rate = spec["draft_acceptance_rate"]
    log.info("request %s tenant=%s route=%s draft=%s prompt_tokens=%d output_tokens=%d ttft_ms=%s tok_s=%s "
             "acceptance=%s mean_accepted_length=%s finish=%s", request_id, tenant or "-", ec["route"],
             first.draft or "-", first.num_prompt_tokens, sum(o.num_completion_tokens for o in outcomes),
             "-" if ttft is None else f"{ttft * 1000:.0f}", "-" if tps is None else f"{tps:.1f}",
             "-" if rate is None else f"{rate:.3f}",
             "-" if spec["mean_acceptance_length"] is None else f"{spec['mean_acceptance_length']:.2f}",
             finish or ",".join(o.finish_reason for o in outcomes))
