"""Statistics of one generation on the edge: counters the client updates once per verify step.

The counters and their names follow vLLM's ``SpecDecodingStats`` (vllm/v1/spec_decode/metrics.py):
``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens`` and the per-position accepted counts, updated by
one :meth:`GenerationStats.observe` call per verify step as vLLM's ``observe_draft`` does. From them come the
two figures of the glossary (docs/architecture.md): the acceptance rate and τ, the mean accepted length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec_runtime.common.types import Verdict, check_verdict_counts

__all__ = ["GenerationStats", "WireStats"]


@dataclass
class GenerationStats:
    """Counters of one generation (field names = the ``--json`` output of ``specdec generate``).

    ``num_generated_tokens``, ``elapsed_s`` and the two phases (``ttft_s``; ``num_decode_tokens`` over
    ``decode_s``) are set by the client when the generation ends; every other field is updated by
    :meth:`observe`, once per verify step.
    """

    num_generated_tokens: int = 0  # tokens committed after the prompt
    num_drafts: int = 0  # verify steps (draft blocks sent, empty blocks of target-only decoding included)
    num_draft_tokens: int = 0  # draft tokens the verifier judged, all blocks together (a cut block: its judged part)
    num_accepted_tokens: int = 0  # draft tokens the verifier accepted (recovered/bonus tokens not counted)
    elapsed_s: float = 0.0  # wall time of the whole generation (session open to close), s
    # time to first token, s: the generation's start to its first committed token (both prefills and the first
    # block or cloud step); None when no token was committed
    ttft_s: float | None = None
    num_decode_tokens: int = 0  # tokens committed after the first commit (the decode phase)
    decode_s: float = 0.0  # the decode phase, s: the first commit to the end (elapsed_s - ttft_s)
    draft_s: float = 0.0  # edge time spent in the draft model, s (drafting ahead while a block travels included)
    target_forward_s: float = 0.0  # verifier time in target forward passes, s (a batched pass split per row)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [longest block] accepted counts by position
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)  # [longest block] judged draft tokens by position
    num_proactive_hits: int = 0  # blocks drafted ahead (proactive drafting) and sent as they were
    num_forced_tokens: int = 0  # draft tokens a grammar forced, drafted without a draft forward pass
    # draft tokens the verifier did not judge (adaptive verification verified a prefix of their block: they were
    # neither accepted nor rejected, and were sent again at the start of the next block)
    num_unjudged_draft_tokens: int = 0

    def observe(self, block_len: int, verdict: Verdict, draft_s: float = 0.0, proactive_hit: bool = False,
                num_forced: int = 0) -> None:
        """Record one verify step (vLLM's ``SpecDecodingStats.observe_draft``, plus the edge's own timings).

        Args:
            block_len: draft tokens in the block sent (0 for target-only decoding).
            verdict: the verifier's answer: ``num_accepted`` (0..block_len), ``forward_ms`` (ms of the target
                forward pass that verified the block) and ``batch_size`` (rows in that pass; the pass's time is
                shared equally between them).
            draft_s: edge time spent drafting in this step, s (the block sent, and any block drafted ahead).
            proactive_hit: the block sent was drafted ahead while the previous block was in flight.
            num_forced: draft tokens of the block a grammar forced (``DraftBlock.num_forced_tokens``).

        Raises:
            InvalidRequestError (a ValueError): ``verdict.num_accepted`` outside [0, block_len]
                (:func:`common.types.check_verdict_counts`).
        """
        check_verdict_counts(verdict.num_accepted, None, block_len)
        self.num_drafts += 1
        # a cut block (adaptive verification) counts the draft tokens judged; the others are sent again next block
        judged = block_len if verdict.num_verified_positions is None else min(block_len, verdict.num_verified_positions)
        self.num_draft_tokens += judged
        self.num_unjudged_draft_tokens += block_len - judged
        self.num_accepted_tokens += verdict.num_accepted
        self.draft_s += draft_s
        self.target_forward_s += verdict.forward_ms / 1000 / max(1, verdict.batch_size)
        self.num_proactive_hits += int(proactive_hit)
        self.num_forced_tokens += int(num_forced)
        if len(self.num_accepted_tokens_per_pos) < block_len:
            self.num_accepted_tokens_per_pos.extend([0] * (block_len - len(self.num_accepted_tokens_per_pos)))
        for i in range(verdict.num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1
        if len(self.num_draft_tokens_per_pos) < judged:
            self.num_draft_tokens_per_pos.extend([0] * (judged - len(self.num_draft_tokens_per_pos)))
        for i in range(judged):
            self.num_draft_tokens_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens, in [0, 1] (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode speed, tokens/s: ``num_decode_tokens / decode_s``, the prefill left out (it is ``ttft_s``);
        0 when there was no decode phase (no token, or all of them in the first commit)."""
        return self.num_decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """τ: tokens committed per verify step, the recovered/bonus token included = 1 + accepted / steps
        (0 before the first step)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class WireStats:
    """Serialized protobuf bytes (``ByteSize()``, framing excluded) and messages of one session."""

    bytes_sent: int = 0  # edge -> verifier, bytes
    bytes_received: int = 0  # verifier -> edge, bytes
    messages_sent: int = 0
    messages_received: int = 0
