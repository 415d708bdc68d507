"""One generation's state across its sessions (:class:`Run`) and its outcome (:class:`GenerationResult`).

A generation runs in one verifier session, or in several after failures (a session the verifier lost is
re-opened over everything committed; a device fallback bridges an unreachable cloud): :class:`Run` holds what
outlives a session (committed ids, stats, seq, the stop state over the whole output) for the loop of
:func:`edge_client.generation.loop.generate`.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

from specdec_runtime.common.stopping import StopChecker, generated_text_for_output
from specdec_runtime.common.types import FinishReason, SamplingParams, StoppingCriteria, TokenLogprobs
from specdec_runtime.edge_client.output import TextOutput
from specdec_runtime.edge_client.stats import GenerationStats

__all__ = ["GenerationResult", "Run", "with_seed"]

# the stopping rule's order, for two stops found on the same token
_STOP_ORDER = (FinishReason.EOS, FinishReason.STOP_STRING, FinishReason.LENGTH, FinishReason.CONTEXT)


@dataclass
class GenerationResult:
    """Outcome of one generation (the fields of `specdec generate --json`)."""

    text: str
    token_ids: list[int]  # generated tokens only
    finish_reason: FinishReason | None
    stats: GenerationStats
    session_id: str = ""  # the last session (a generation re-opened after a failure has several)
    prompt_token_ids: list[int] = field(default_factory=list)
    bytes_sent: int = 0  # wire bytes edge -> verifier (gRPC backend only)
    bytes_received: int = 0
    num_failovers: int = 0  # calls moved to another replica after a failure (edge_client.transport.failover)
    num_unverified_tokens: int = 0  # tokens decoded by the draft alone during a device fallback (not the target's)
    num_sessions: int = 1  # verifier sessions of this generation (> 1 after a re-open or a device fallback)
    num_reopened_sessions: int = 0  # sessions re-opened over all committed ids after the verifier lost one
    #   (NOT_FOUND: expiry, eviction, restart) or could not extend a conversation's session (edge_client.conversation)
    route: dict | None = None  # the route requested, chosen and each switch (edge_client.generation.routing.RouteRun.report)
    # one per generated token when logprobs were asked (raw log-softmax of the target), else None
    logprobs: list[TokenLogprobs] | None = None

    def to_json(self) -> dict:
        s = self.stats
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason.value if self.finish_reason else None,
            "num_generated_tokens": s.num_generated_tokens,
            "num_drafts": s.num_drafts,
            "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "num_forced_tokens": s.num_forced_tokens,
            "num_unjudged_draft_tokens": s.num_unjudged_draft_tokens,
            "acceptance_rate": s.acceptance_rate if s.num_draft_tokens else None,  # null: nothing was drafted
            "mean_accepted_length": s.mean_accepted_length,
            "elapsed_s": s.elapsed_s,
            "ttft_s": s.ttft_s,  # null: no token was committed
            "num_decode_tokens": s.num_decode_tokens,
            "decode_s": s.decode_s,
            "decode_tokens_per_s": s.decode_tokens_per_s,
            "num_failovers": self.num_failovers,
            "num_unverified_tokens": self.num_unverified_tokens,
            "route": self.route,
            **({"logprobs": [{"token_id": t, "logprob": lp.logprob,
                              "top_logprobs": [{"token_id": i, "logprob": v}
                                               for i, v in zip(lp.top_token_ids, lp.top_logprobs)]}
                             for t, lp in zip(self.token_ids, self.logprobs)]}
               if self.logprobs is not None else {}),
        }


def with_seed(sampling: SamplingParams) -> SamplingParams:
    """``sampling`` with a seed (a random one when it has none)."""
    if sampling.seed is not None:
        return sampling
    return dataclasses.replace(sampling, seed=secrets.randbits(63))


@dataclass
class Run:
    """State of one generation across its sessions (one, or several after failures)."""

    prompt_ids: list[int]
    stopping: StoppingCriteria
    out: TextOutput
    committed: list[int] = field(default_factory=list)  # prompt + output, tokens
    stats: GenerationStats = field(default_factory=GenerationStats)
    finish_reason: FinishReason | None = None
    session_ids: list[str] = field(default_factory=list)
    max_context_tokens: int | None = None  # the verifier's, once a session was opened
    num_unverified: int = 0
    edge_stop: StopChecker | None = None  # stop strings over the whole output, once it spans several sessions
    first_seq: int = 1  # seq of the current session's next block (after ExtendSession: its last seq + 1)
    last_seq: int = 0  # seq of the current session's last verified block
    session_committed: int = 0  # the current session's committed length after its last verdict, tokens
    num_reopens: int = 0  # sessions re-opened over the committed ids because the verifier lost (or refused) one
    route: object = None  # edge_client.generation.routing.RouteRun: the generation's route, its mode and switches
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per committed output token, when asked

    def __post_init__(self) -> None:
        self.out.logprobs = self.logprobs  # one list: each chunk hands out the entries of its tokens

    @property
    def num_generated(self) -> int:
        return len(self.committed) - len(self.prompt_ids)

    def span_sessions(self, tokenizer) -> None:
        """The output now spans sessions (or device decoding): check stop strings over all of it on the edge,
        so that one across a boundary stops the generation as it would have stopped one session."""
        if self.edge_stop is not None or not self.stopping.stop_strings:
            return
        criteria = StoppingCriteria(2**31 - 1, (), self.stopping.stop_strings, ignore_eos=True)
        self.edge_stop = StopChecker(tokenizer, criteria, (), len(self.prompt_ids), 2**31)
        if self.num_generated:
            self.edge_stop.append(self.committed[len(self.prompt_ids):])

    def cut(self, tokens: list[int], reason: FinishReason | None) -> tuple[list[int], FinishReason | None]:
        """``tokens`` about to be committed (with the stop ``reason`` found for them, if any), cut at a stop
        string that only the whole output shows; the earliest stop wins, then the stopping rule's order."""
        if self.edge_stop is None or self.edge_stop.finished:
            return tokens, reason
        n, edge_reason = self.edge_stop.append(tokens)
        if edge_reason is None:
            return tokens, reason
        if n < len(tokens) or reason is None:
            return tokens[:n], edge_reason
        return tokens, min(reason, edge_reason, key=_STOP_ORDER.index)

    def result(self, tokenizer, wire_stats: Callable | None, t0: float, num_failovers: int = 0) -> GenerationResult:
        """The GenerationResult of the finished generation (text cut at the earliest stop; wire bytes of all
        its sessions when ``wire_stats``, a backend's ``wire_stats(session_id)``, counts them); sets the
        counters known only at the end (``t0``: ``time.perf_counter()`` when the generation began)."""
        generated = self.committed[len(self.prompt_ids):]
        sent = received = 0
        if wire_stats is not None:
            for sid in self.session_ids:
                st = wire_stats(sid)
                sent, received = sent + st.bytes_sent, received + st.bytes_received
        stats = self.stats
        stats.num_generated_tokens = len(generated)
        end = time.perf_counter()
        stats.elapsed_s = end - t0
        first = self.out.first_token_t  # every commit goes through self.out: the prefill ends at its first
        stats.ttft_s = None if first is None else first - t0
        stats.decode_s = 0.0 if first is None else end - first
        stats.num_decode_tokens = max(0, len(generated) - self.out.first_token_count) if first is not None else 0
        return GenerationResult(
            text=generated_text_for_output(tokenizer, generated, self.finish_reason, self.stopping.stop_strings),
            token_ids=generated,
            finish_reason=self.finish_reason,
            stats=stats,
            session_id=self.session_ids[-1] if self.session_ids else "",
            prompt_token_ids=list(self.prompt_ids),
            bytes_sent=sent,
            bytes_received=received,
            num_failovers=num_failovers,
            num_unverified_tokens=self.num_unverified,
            num_sessions=len(self.session_ids),
            num_reopened_sessions=self.num_reopens,
            route=self.route.report() if self.route is not None else None,
            logprobs=list(self.logprobs) if self.logprobs else None,
        )
