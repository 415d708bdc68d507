"""Per-session logits processors of a verify row, applied to the raw target logits before the verdict.

The processors that depend on a session's own history (logit_bias, repetition/presence/frequency penalties,
min_tokens, grammar masks) run here, at every position of the block with that position's own history (committed
ids + the block's draft ids before it), before the history-free warpers (temperature, top-k, top-p, min_p) and
the rejection rule run over the whole batch. A session that asks for none of them passes through unchanged.
The pipeline and its order: :mod:`common.logits_processors`.

The session's :class:`~common.logits_processors.TokenHistory` (``Session.history``) follows the committed ids,
which move only once a store commit succeeded (``Session.confirm``): each block first brings it to them (the
tokens the last verdict committed: O(γ) count updates), so a failed or refused commit never leaves draft tokens
counted. A session resumed on another replica, or given a new turn (its prompt length and parameters change),
rebuilds it from the committed ids.

Logprobs (:func:`raw_logprobs` / :func:`committed_logprobs`) are taken from the RAW logits, before this
processing (vLLM's default ``logprobs_mode``), so they are the numbers target-only decoding reports for the same
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec_runtime.cloud_verifier.session.grammar import apply_session_grammar
from specdec_runtime.cloud_verifier.session.state import Session
from specdec_runtime.common.logits_processors import TokenHistory, process_block
from specdec_runtime.common.types import DraftBlock, TokenLogprobs


def prepare_row_logits(
    session: Session,
    block: DraftBlock,
    committed_length: int,  # tokens committed before the block (absolute position of its first draft token)
    logits: torch.Tensor,  # [block.num_scored_positions, vocab_size] float32, owned by the caller (in place ok)
) -> torch.Tensor:  # [block.num_scored_positions, vocab_size]
    """The row's logits after its session's history-dependent processors, row i with the history committed ids
    + ``block.draft_token_ids[:i]`` (returned as given when the session has none). Processed in numpy on the
    CPU (a few vector passes over the vocabulary per position), returned on ``logits``' device.

    Raises:
        ValueError: ``committed_length`` is not the session's committed length (the block was validated
            against it; a mismatch is a bug).
    """
    record = session.record
    if record.sampling.grammar:  # first in the pipeline: the ids the grammar forbids get -inf
        logits = apply_session_grammar(session, block, logits)
    if not record.sampling.has_history_processors:
        return logits
    if committed_length != record.committed_length:
        raise ValueError(f"block at {committed_length} tokens, session at {record.committed_length}")
    history = session_history(session, int(logits.shape[-1]))
    rows = logits.detach().cpu().numpy() if logits.device.type == "cpu" else logits.detach().cpu().numpy().copy()
    if not rows.flags.writeable:
        rows = rows.copy()
    process_block(history, rows, block.draft_token_ids)
    out = torch.from_numpy(rows)
    return out if logits.device.type == "cpu" else out.to(logits.device)


def session_history(session: Session, vocab_size: int) -> TokenHistory:
    """``session.history`` brought to the committed ids: built (from all of them) when missing or made for
    another turn or other parameters, else moved by the tokens committed since (O(changed tokens))."""
    record = session.record
    history = session.history
    if (history is None or history.params != record.sampling or history.prompt_length != record.prompt_length
            or history.vocab_size != vocab_size):
        history = TokenHistory(record.sampling, vocab_size, record.prompt_length,
                               session.stop.stop_token_ids, record.committed_token_ids)
        session.history = history
    else:
        history.sync(record.committed_token_ids)
    return history


@dataclass
class RawLogprobs:
    """A verify row's raw log-softmax rows [num_scored_positions, vocab_size] (float64) and its top-N."""

    logprobs: np.ndarray  # [rows, vocab_size] float64
    top_ids: np.ndarray  # [rows, top_n] int64, most likely first, ties: lower id first
    top_n: int


def raw_logprobs(session: Session, logits) -> RawLogprobs | None:
    """The raw log-softmax of a verify row's logits ([rows, vocab_size], numpy or torch; BEFORE
    :func:`prepare_row_logits`, which works in place) when the session asked for logprobs, else None."""
    params = session.record.sampling
    if not params.logprobs:
        return None
    x = logits.detach().cpu().numpy() if isinstance(logits, torch.Tensor) else np.asarray(logits)
    x = x.astype(np.float64)
    lse = np.logaddexp.reduce(x, axis=-1, keepdims=True) if x.shape[-1] else 0.0
    lp = x - lse  # [rows, vocab_size]
    n = int(params.top_logprobs)
    top = np.empty((lp.shape[0], n), dtype=np.int64)
    if n:
        part = np.argpartition(-lp, n - 1, axis=-1)[:, :n] if n < lp.shape[-1] else np.tile(
            np.arange(lp.shape[-1]), (lp.shape[0], 1))
        for r in range(lp.shape[0]):
            cand = part[r]
            top[r] = cand[np.lexsort((cand, -lp[r, cand]))][:n]
    return RawLogprobs(lp, top, n)


def committed_logprobs(raw: RawLogprobs | None, committed_token_ids: list[int]) -> list[TokenLogprobs] | None:
    """Logprobs of a verdict's committed tokens: token j stands at row j of the block (the accepted prefix, then
    the recovered or bonus token at the row after it)."""
    if raw is None:
        return None
    out = []
    for j, t in enumerate(committed_token_ids):
        row = raw.logprobs[j]
        ids = raw.top_ids[j]
        out.append(TokenLogprobs(float(row[int(t)]), tuple(int(i) for i in ids), tuple(float(row[i]) for i in ids)))
    return out
