"""One log line per session when this replica lets it go (closed, reaped, or handed to another replica), as
serving engines print one per request: its id, tenant, route, draft version, prompt and output tokens, time to
first token, tokens per second, acceptance and finish reason. No prompt, token id or text (docs/security.md,
"Logs"). The counts come from the session's tally (:class:`cloud_verifier.drafts.ledger.DraftTally`), updated once
per verdict by the batcher."""

from __future__ import annotations

import logging

log = logging.getLogger("specdec.requests")


class _NoTally:
    label = None
    num_drafts = num_draft_tokens = num_accepted_tokens = num_decode_steps = num_committed = first_committed = 0
    first_commit_at = last_commit_at = None


_NO_TALLY = _NoTally()


def route_of(num_drafts: int, num_draft_tokens: int, num_decode_steps: int) -> str:
    """"speculative" (every step carried draft tokens), "cloud" (cloud decode or target-only steps only),
    "speculative+cloud" (both), "none" (no step)."""
    if not num_drafts:
        return "none"
    if not num_decode_steps:
        return "speculative"
    return "cloud" if num_decode_steps == num_drafts or not num_draft_tokens else "speculative+cloud"


def log_session_end(session, how: str = "released") -> None:
    """The session's line (``how``: "closed", "reaped", "released"). A session resumed here from the store has no
    tally (its counts stayed with the replica that opened it): its line has the record's token counts only."""
    tally, record = getattr(session, "draft", None) or _NO_TALLY, session.record
    output = max(0, record.committed_length - record.prompt_length)
    ttft = (tally.first_commit_at - record.created_at) if tally.first_commit_at is not None else None
    span = (tally.last_commit_at - tally.first_commit_at) if tally.first_commit_at is not None else 0.0
    tok_s = (tally.num_committed - tally.first_committed) / span if span > 0 else None
    rate = tally.num_accepted_tokens / tally.num_draft_tokens if tally.num_draft_tokens else None
    tau = 1 + tally.num_accepted_tokens / tally.num_drafts if tally.num_drafts else None
    finish = record.finish_reason.value if record.finished and record.finish_reason is not None else how
    log.info("session %s tenant=%s route=%s draft=%s prompt_tokens=%d output_tokens=%d ttft_ms=%s tok_s=%s "
             "acceptance=%s mean_accepted_length=%s finish=%s", record.session_id, record.tenant_id or "-",
             route_of(tally.num_drafts, tally.num_draft_tokens, tally.num_decode_steps), tally.label or "-",
             record.prompt_length, output, "-" if ttft is None else f"{max(0.0, ttft) * 1000:.0f}",
             "-" if tok_s is None else f"{tok_s:.1f}", "-" if rate is None else f"{rate:.3f}",
             "-" if tau is None else f"{tau:.2f}", finish)
