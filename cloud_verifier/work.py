"""The batcher's queue item (:class:`Work`): one verify step of a session's draft block, or one prefill chunk
(:mod:`cloud_verifier.batcher`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from specdec_runtime.cloud_verifier.session.state import Session
from specdec_runtime.common.types import DraftBlock

__all__ = ["Work"]


@dataclass
class Work:
    """One queued unit: a verify step (``block`` is not None) or a prefill chunk.

    ``tokens`` are fed at positions ``start_position`` .. ``start_position + len(tokens) - 1`` of the session's
    KV cache: for a verify step, the last committed token and the γ draft tokens (γ + 1 rows of logits), or
    for a ``bonus_drafted`` block of n tokens the last committed token and its first n − 1 (n rows).
    """

    session: Session
    tokens: list[int]
    start_position: int  # tokens
    future: asyncio.Future  # resolved with the Verdict (verify), None (prefill) or the error
    block: DraftBlock | None = None
    seq: int = 0
    enqueued: float = field(default_factory=time.perf_counter)  # perf_counter time, s
    started: bool = False  # taken into a forward pass: it runs to its end (committed wholly), whoever waits
    deferred_since: float | None = None  # monotonic s of its first step without KV pages (kv_scheduler)
    raw_logprobs: object = None  # row_logits.RawLogprobs of a verify row whose session asked for logprobs
    full_block: DraftBlock | None = None  # the block as queued; ``block`` is the part this step verifies
    # the target's features of this item's tokens, float32 [len(tokens), width], when its block (or, for a
    # prefill chunk, its session's open) asked for them (common.features): set by KVScheduler.after_forward
    hidden: object = None

    @property
    def features(self):
        """The common.features.FeatureRequest (layers resolved) this item's forward pass keeps, or None."""
        return self.full_block.features if self.full_block is not None else self.session.prefill_features
