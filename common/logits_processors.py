"""The history-dependent logits processors, one pipeline for the verifier (the authority), the draft and
target-only decoding, applied at EVERY position of a block with that position's own history: the committed ids
plus the block's draft ids before it.

The order of the whole pipeline (as HF transformers' and vLLM's processors, one documented order):

1. ``logit_bias``: logit[t] += bias[t] (OpenAI ``logit_bias``).
2. ``repetition_penalty``: HF ``RepetitionPenaltyLogitsProcessor`` (Keskar et al. 2019, CTRL) over the PROMPT +
   OUTPUT ids: a seen token's logit is divided by the penalty when positive, multiplied when negative.
3. ``presence_penalty`` / ``frequency_penalty``: OpenAI semantics over the turn's OUTPUT ids only (as vLLM
   documents it): logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0). HF has no
   processor for them; :class:`tests`' reference is a documented custom one with the same formula.
4. ``min_tokens``: EOS and stop token ids get -inf until ``min_tokens`` tokens of the turn are generated (HF
   ``MinNewTokensLengthLogitsProcessor``; the token at output index i is generated with i tokens before it, so
   the mask holds while i < min_tokens) — except at a position where nothing else is left (a grammar that can
   only end there): the grammar wins, as the output must match it, so min_tokens is a lower bound only where
   the grammar leaves room (a row of nothing but -inf would have no distribution).
5. then :func:`common.logits.logits_to_probs`: temperature -> top-k -> top-p -> min_p (greedy: the argmax of
   the processed logits).

A grammar / structured-output token mask plugs in at the start, before the bias (:meth:`TokenHistory.apply`
takes an optional ``allowed`` mask).

The state (:class:`TokenHistory`) is incremental: token counts over the history, one ``push`` per token and one
``pop`` to undo; a block of γ positions costs O(γ) updates (:func:`process_block`), never a recount. A session
resumed on another replica, or extended with a new turn, rebuilds it from the committed ids
(:meth:`TokenHistory.sync`). numpy only (the edge has no torch). Arithmetic in the logits' own dtype (float32 for
the target and the draft), element for element as HF does it.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from specdec_runtime.common.types import SamplingParams

__all__ = ["TokenHistory", "process_block"]


class TokenHistory:
    """Token counts of one generation's history for the history-dependent processors of ``params``.

    Args:
        params: the session's sampling parameters (only the history-dependent fields are used here).
        vocab_size: width of the logits rows (count arrays are this long); ids must be below it.
        prompt_length: ids before the turn's output (penalties over the output and min_tokens count from here).
        stop_token_ids: the ids ``min_tokens`` masks (the model's EOS ids unless ignore_eos, plus the stop
            token ids).
        token_ids: the history so far (prompt + committed output), counted once here.
    """

    def __init__(self, params: SamplingParams, vocab_size: int, prompt_length: int,
                 stop_token_ids: Iterable[int] = (), token_ids: Sequence[int] = ()) -> None:
        self.params = params
        self.vocab_size = int(vocab_size)
        self.prompt_length = int(prompt_length)
        self.stop_token_ids = np.array(sorted({int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size}),
                                       dtype=np.int64)
        self.token_ids: list[int] = []
        self._all = np.zeros(self.vocab_size, dtype=np.int32)  # [vocab_size] counts over prompt + output
        self._out = np.zeros(self.vocab_size, dtype=np.int32)  # [vocab_size] counts over the output
        self._bias_ids = np.array([t for t, _ in params.logit_bias], dtype=np.int64)
        self._bias = np.array([b for _, b in params.logit_bias], dtype=np.float64)
        # the ids with a count > 0 (sorted), recomputed only after a count crossed 0: the penalties then touch
        # those ids only, not the whole vocabulary (a few µs per position instead of ~0.5 ms at 49,152 tokens)
        self._seen_ids: np.ndarray | None = None
        self._out_ids: np.ndarray | None = None
        self.extend(token_ids)

    @property
    def num_generated(self) -> int:
        """Output tokens in the history (tokens after ``prompt_length``)."""
        return max(0, len(self.token_ids) - self.prompt_length)

    def push(self, token_id: int) -> None:
        """Append one token to the history (O(1))."""
        t = int(token_id)
        if len(self.token_ids) >= self.prompt_length:
            self._out[t] += 1
            if self._out[t] == 1:
                self._out_ids = None
        self._all[t] += 1
        if self._all[t] == 1:
            self._seen_ids = None
        self.token_ids.append(t)

    def extend(self, token_ids: Iterable[int]) -> None:
        for t in token_ids:
            self.push(t)

    def pop(self, n: int = 1) -> None:
        """Remove the last ``n`` tokens (O(n)): undoes the draft tokens a block pushed."""
        for _ in range(int(n)):
            t = self.token_ids.pop()
            self._all[t] -= 1
            if self._all[t] == 0:
                self._seen_ids = None
            if len(self.token_ids) >= self.prompt_length:
                self._out[t] -= 1
                if self._out[t] == 0:
                    self._out_ids = None

    def sync(self, token_ids: Sequence[int]) -> None:
        """Make the history equal ``token_ids``: pop back to the longest common prefix, push the rest (what
        moved: O(changed tokens) updates, plus one C-speed list comparison)."""
        n = min(len(self.token_ids), len(token_ids))
        if self.token_ids[:n] != list(token_ids[:n]):
            keep = next(i for i in range(n) if self.token_ids[i] != token_ids[i])
        else:
            keep = n
        self.pop(len(self.token_ids) - keep)
        self.extend(token_ids[keep:])

    def apply(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
        """Process one position's logits [vocab_size] IN PLACE with the current history; returns them.

        ``allowed``: optional bool [vocab_size] token mask (a grammar's), applied first (others get -inf).
        Order and sources: the module docstring. Float arithmetic in ``logits.dtype``.
        """
        p = self.params
        if allowed is not None:
            logits[~allowed] = -np.inf
        if len(self._bias_ids):
            logits[self._bias_ids] += self._bias.astype(logits.dtype)
        if p.repetition_penalty != 1.0:
            if self._seen_ids is None:
                self._seen_ids = np.flatnonzero(self._all)
            seen = self._seen_ids
            penalty = logits.dtype.type(p.repetition_penalty)
            vals = logits[seen]
            logits[seen] = np.where(vals < 0, vals * penalty, vals / penalty)
        if p.frequency_penalty or p.presence_penalty:
            if self._out_ids is None:
                self._out_ids = np.flatnonzero(self._out)
            ids = self._out_ids
            if p.frequency_penalty:
                logits[ids] -= logits.dtype.type(p.frequency_penalty) * self._out[ids].astype(logits.dtype)
            if p.presence_penalty:
                logits[ids] -= logits.dtype.type(p.presence_penalty)
        if p.min_tokens and self.num_generated < p.min_tokens and len(self.stop_token_ids):
            kept = logits[self.stop_token_ids].copy()
            logits[self.stop_token_ids] = -np.inf
            if not np.max(logits) > -np.inf:  # a grammar allows only a stop id here: the grammar wins, it ends
                logits[self.stop_token_ids] = kept
        return logits


def process_block(
    history: TokenHistory,
    logits: np.ndarray,  # [num_positions, vocab_size] float32, processed in place
    draft_token_ids: Sequence[int],  # the block's draft ids: row i's history includes draft_token_ids[:i]
) -> np.ndarray:  # [num_positions, vocab_size], the same array
    """Apply the history-dependent processors to every row of a block: row i with the history + the block's
    first i draft tokens, pushed one by one and popped at the end (O(γ) count updates; the history is
    unchanged on return, even on an error). Works for classic blocks (γ + 1 rows, the last the bonus
    position) and bonus_drafted ones (γ rows)."""
    pushed = 0
    try:
        for i in range(logits.shape[0]):
            if i > 0:
                history.push(draft_token_ids[i - 1])
                pushed += 1
            history.apply(logits[i])
    finally:
        history.pop(pushed)
    return logits
