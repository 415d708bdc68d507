"""The verdict stage of one batch step, per verify row: the rejection rule of every row at once, and the
:class:`~common.types.Verdict` of a row once stopping chose what it commits (used by
:class:`cloud_verifier.batcher.Batcher`).

Speculative decoding's rejection rule (Leviathan, Kalman & Matias 2023, Algorithm 1): the longest accepted prefix
of the draft block, then one token of the target's own (recovered after a rejection, bonus after a full block).
"""

from __future__ import annotations

import logging

import torch

from specdec_runtime.cloud_verifier.session.features import verdict_features
from specdec_runtime.cloud_verifier.verdict.numerics import verify_rows
from specdec_runtime.cloud_verifier.verdict.row_logits import prepare_row_logits, raw_logprobs
from specdec_runtime.cloud_verifier.verdict.sampler import VerifyRow
from specdec_runtime.common.errors import TargetOutputError
from specdec_runtime.common.types import NO_TOKEN, Verdict

log = logging.getLogger(__name__)


def rejections(works: list, logits: list, valid_vocab_size: int, sessions) -> list:
    """The rejection rule of every verify row of one forward pass; per row a RejectionResult or the exception
    that row raised (the other rows are unaffected).

    ``works``: the rows' batcher Work items; ``logits``: per row [block.num_scored_positions, vocab_size] float32
    (numpy or torch, on the target's device); token ids at or past ``valid_vocab_size`` are logit padding.
    Each row first goes through its session's history-dependent processors
    (:func:`cloud_verifier.verdict.row_logits.prepare_row_logits`). A row with NaN/inf logits gets TargetOutputError
    (nothing committed) and its session is released from ``sessions`` (the session table): its KV cache is
    rebuilt next block. Then ONE batched verdict for all rows (:func:`cloud_verifier.verdict.numerics.verify_rows`; the
    per-row numpy :func:`~cloud_verifier.verdict.numerics.verify_row` is its reference).
    """
    outcomes: list = [None] * len(works)
    rows, at = [], []  # the rows the batched verdict runs on, and their places in outcomes
    for j, (work, row_logits) in enumerate(zip(works, logits)):
        record = work.session.record
        try:
            work.raw_logprobs = raw_logprobs(work.session, row_logits)  # raw: before the in-place processing
            prepared = prepare_row_logits(work.session, work.block, record.committed_length,
                                          torch.as_tensor(row_logits))
        except Exception as e:  # noqa: BLE001 - one row's fault is that row's answer
            outcomes[j] = e
            continue
        rows.append(VerifyRow(work.block, prepared, record.sampling, record.committed_length))
        at.append(j)
    # one batched verdict for all rows (tensor ops where the logits are); only ids and counts come back
    try:
        verdicts = verify_rows(rows, valid_vocab_size, [works[j].session.record.session_id for j in at])
    except Exception as e:  # noqa: BLE001 - a bug: these rows fail, the batch loop keeps serving
        log.exception("batched verdict failed")
        verdicts = [e] * len(rows)
    for j, verdict in zip(at, verdicts):
        if isinstance(verdict, TargetOutputError):
            sessions.release(works[j].session.record.session_id)
        outcomes[j] = verdict
    return outcomes


def make_verdict(work, next_token_id: int, n: int, num_committed: int, committed: list[int],
                 reason, queue_ms: float, forward_ms: float, batch_size: int) -> Verdict:
    """The Verdict of a verify row (batcher Work ``work``) whose rejection rule accepted ``n`` draft tokens and
    proposed ``next_token_id`` (NO_TOKEN: none), of which stopping kept ``committed`` (``num_committed`` tokens);
    ``queue_ms``/``forward_ms``: its wait and the forward pass, ms; ``batch_size``: verify blocks in the pass."""
    block = work.block
    full = getattr(work, "full_block", None)
    num_drafted = len(block.draft_token_ids)  # γ (γ + 1 in a bonus_drafted block, which has no bonus token)
    num_accepted = min(n, num_committed)
    return Verdict(
        num_accepted=num_accepted,
        next_token_id=next_token_id if num_committed > n else NO_TOKEN,
        is_bonus=(not block.bonus_drafted and num_committed > n and n == num_drafted and num_drafted > 0),
        committed_token_ids=committed,
        committed_length=work.start_position + 1 + len(committed),
        finished=reason is not None,
        finish_reason=reason,
        queue_ms=queue_ms,
        forward_ms=forward_ms,
        batch_size=batch_size,
        seq=work.seq,
        # a prefix of the queued block was verified (adaptive verification): the edge knows its tail was not judged
        num_verified_positions=len(block.draft_token_ids) if full is not None and full is not block else None,
        # the target's features of the committed positions (start_position ..: the tokens fed and kept)
        features=verdict_features(work, len(committed)),
    )
