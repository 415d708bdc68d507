"""This replica's state of one session (:class:`Session`): its copy of the store record, its target KV cache,
its stopping state, and the flags of its life cycle (:mod:`cloud_verifier.session.table`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specdec_runtime.cloud_verifier.store import SessionRecord
from specdec_runtime.cloud_verifier.kv.pool import SessionKV
from specdec_runtime.common.errors import SessionNotFoundError
from specdec_runtime.common.logits_processors import TokenHistory
from specdec_runtime.common.stopping import StopChecker
from specdec_runtime.common.types import Verdict


@dataclass
class Session:
    """This replica's state of one session."""

    record: SessionRecord  # this replica's copy of the store record (committed tokens, seq, finish state)
    kv: SessionKV  # the target KV cache, ``capacity`` tokens
    stop: StopChecker  # stopping state over the committed output
    busy: bool = False  # a block of this session is queued or running
    released: bool = False  # closed/expired: KV freed, or to be freed when the block in flight is done
    last_seen: float = field(default_factory=time.time)  # unix time of the last block's end, s
    idle_waiters: list = field(default_factory=list)  # asyncio futures resolved when ``busy`` turns False
    # a verdict whose store commit got no answer (it may or may not have landed): settled at the next request
    unconfirmed: Verdict | None = None
    # token counts of the history-dependent logits processors (penalties, min_tokens), None until a block needs
    # them: brought to the committed ids (which move only with a successful commit) by row_logits, rebuilt from
    # them after a resume or a new turn
    history: TokenHistory | None = None
    # structured output: the grammar's matcher over the turn's committed output (cloud_verifier.session.grammar),
    # None until a block of a session with a grammar needs it
    grammar: object | None = None
    # the draft version's acceptance tally (cloud_verifier.drafts.ledger.DraftTally), None = not labelled
    draft: object | None = None
    # draft-head features of the prompt asked at open (common.features.FeatureRequest, layers resolved), and
    # (start position, float32 [n, width]) per prefilled chunk, until the open answers
    prefill_features: object = None
    prefill_hidden: list = field(default_factory=list)
    # features a resume's re-prefill kept for a client that lacks them (DraftBlock.features_from): (layers, first
    # position, float32 [n, width]) until the next verdict (cloud_verifier.session.features.verdict_features)
    resumed_features: tuple | None = None

    @property
    def committed(self) -> list[int]:
        """Committed token ids (prompt + output)."""
        return self.record.committed_token_ids

    def confirm(self, verdict: Verdict) -> None:
        """Apply a verdict the store committed to this replica's copy of the record (ids, seq, finish state)."""
        r = self.record
        r.committed_token_ids.extend(verdict.committed_token_ids)
        r.last_seq = verdict.seq
        r.finished, r.finish_reason = verdict.finished, verdict.finish_reason


def owned(session: Session, session_id: str, tenant_id: str | None) -> Session:
    """``session`` if it belongs to ``tenant_id`` (None = not checked).

    Raises:
        SessionNotFoundError: another tenant's session (the same message as an unknown one).
    """
    if tenant_id is not None and session.record.tenant_id != tenant_id:
        raise SessionNotFoundError(f"unknown or expired session {session_id!r}")
    return session
