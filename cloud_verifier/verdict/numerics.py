"""Guards against bad numbers from the target: a verify row whose logits cannot be verified never commits.

A target forward pass can yield NaN or +inf logits (an overflow in half precision, a broken kernel, corrupted
weights or KV cache), or finite logits that turn into no usable distribution after logits processing (e.g.
logits so large that ``logits / temperature`` overflows). Left alone, greedy verification would commit the
argmax of a NaN row (an arbitrary id) and sampling would fail deep inside the rejection rule.

:func:`verify_row` checks the row first (NaN, +inf, or a position where no logit is finite: a fault; a few
``-inf`` logits are fine, they are masked tokens), then runs the rejection rule
(:func:`common.rejection.verify_block`), which already falls back to the target distribution p when the residual
norm(max(0, p − q)) has no mass; a distribution with no mass at all, or a token outside the vocabulary, is a
fault too. A fault raises :class:`~common.errors.TargetOutputError` (INTERNAL, a clear message, nothing
committed) and counts ``specdec_nonfinite_logits_total``; the batcher releases that session's KV cache so its
next block rebuilds it from the store. The other rows of the batch are untouched.

:func:`verify_rows`, what the batcher calls, gives the verdicts of a whole forward pass at once as tensor ops
where the logits are (:mod:`cloud_verifier.verdict.sampler`) with the same guards, vectorised;
:func:`verify_row` stays as its one-row numpy reference.
"""

from __future__ import annotations

import numpy as np

from specdec_runtime.cloud_verifier import metrics
from specdec_runtime.cloud_verifier.verdict.sampler import BatchedRejectionSampler, VerifyRow
from specdec_runtime.common.errors import TargetOutputError
from specdec_runtime.common.rejection import RejectionResult, verify_block
from specdec_runtime.common.types import NO_TOKEN, DraftBlock, SamplingParams


def logits_fault(logits: np.ndarray, valid_vocab_size: int | None = None) -> str | None:
    """Why a row's logits [positions, vocab_size] cannot be verified, or None when they can: NaN, +inf, or a
    position whose logits (the first ``valid_vocab_size`` columns) are all -inf."""
    x = np.asarray(logits)
    if valid_vocab_size is not None and valid_vocab_size < x.shape[-1]:
        x = x[..., :valid_vocab_size]
    if np.isfinite(x).all():
        return None
    if np.isnan(x).any():
        return "NaN logits"
    if np.isposinf(x).any():
        return "+inf logits"
    if np.isneginf(x).all(axis=-1).any():
        return "a position with no finite logit"
    return None  # some -inf entries (masked tokens) and finite others: a valid distribution


def verify_row(block: DraftBlock, logits: np.ndarray, sampling: SamplingParams, start_position: int,
               valid_vocab_size: int, session_id: str = "") -> RejectionResult:
    """:func:`common.rejection.verify_block` on one row, guarded (see the module docstring).

    ``logits``: [γ + 1, vocab_size] ([γ, vocab_size] for a ``bonus_drafted`` block:
    ``block.num_scored_positions``); ``start_position``: the committed length, tokens;
    ``valid_vocab_size``: ids at or past it are not tokens. The verdict's ``next_token_id`` is NO_TOKEN only after a
    ``bonus_drafted`` block accepted whole (no bonus token).

    Raises:
        TargetOutputError: the row's logits are not finite, processing left no distribution to sample from, or
            the verdict's token is outside [0, valid_vocab_size) (counted in ``specdec_nonfinite_logits_total``).
    """
    reason = logits_fault(logits, valid_vocab_size)
    if reason is None:
        try:
            with np.errstate(all="ignore"):
                result = verify_block(block, logits, sampling, start_position, valid_vocab_size)
        except (ValueError, FloatingPointError, IndexError) as e:
            reason = f"no distribution to sample from after logits processing ({e})"
        else:
            accepted_whole = block.bonus_drafted and result.num_accepted == len(block.draft_token_ids)
            if 0 <= result.next_token_id < valid_vocab_size or (accepted_whole and result.next_token_id == NO_TOKEN):
                return result
            reason = "a token outside the vocabulary"
    raise _fault(session_id, reason)


_SAMPLER = BatchedRejectionSampler()


def verify_rows(rows: list[VerifyRow], valid_vocab_size: int,
                session_ids: list[str] | None = None) -> list[RejectionResult | TargetOutputError]:
    """The verdicts of every verify row of one forward pass at once (:class:`BatchedRejectionSampler`: tensor
    ops where the logits are), guarded as :func:`verify_row` guards one row, vectorised: per row its
    RejectionResult, or the TargetOutputError (counted in ``specdec_nonfinite_logits_total``) that
    :func:`verify_row` would raise for it — NaN, +inf, a position with no finite logit, no distribution to
    sample from after logits processing, a token outside the vocabulary. A faulty row never changes the others.

    ``rows[i].logits``: [block.num_scored_positions, vocab_size] (numpy or torch, one device for all rows).
    ``session_ids``: named in the errors' messages.
    """
    session_ids = session_ids or [""] * len(rows)
    shaped = [i for i, r in enumerate(rows) if np.shape(r.logits)[:1] == (r.block.num_scored_positions,)]
    outcomes: list = [None] * len(rows)
    for i in set(range(len(rows))) - set(shaped):
        outcomes[i] = _fault(session_ids[i], f"no distribution to sample from after logits processing (target "
                             f"logits have {np.shape(rows[i].logits)[0]} rows for a block scoring "
                             f"{rows[i].block.num_scored_positions} positions)")
    for i, got in zip(shaped, _SAMPLER([rows[i] for i in shaped], valid_vocab_size)):
        if isinstance(got, str):
            outcomes[i] = _fault(session_ids[i], got)
            continue
        accepted_whole = rows[i].block.bonus_drafted and got.num_accepted == len(rows[i].block.draft_token_ids)
        if 0 <= got.next_token_id < valid_vocab_size or (accepted_whole and got.next_token_id == NO_TOKEN):
            outcomes[i] = got
        else:
            outcomes[i] = _fault(session_ids[i], "a token outside the vocabulary")
    return outcomes


def _fault(session_id: str, reason: str) -> TargetOutputError:
    metrics.NONFINITE_LOGITS.inc()
    return TargetOutputError(
        f"the target produced unusable logits for session {session_id}: {reason}; nothing was committed, and the "
        "session's KV cache is rebuilt before its next block"
    )
