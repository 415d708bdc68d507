"""The stopping rule of a session, applied to committed tokens only (the same rule as target-only decoding).

A verify step offers a block of candidate tokens (accepted draft tokens + the recovered/bonus token); the
earliest stop in the block wins and nothing after it is committed. Order of checks at one token (as vLLM's
``StopChecker``): EOS / stop token id, then stop string, then max_new_tokens (LENGTH), then the context limit
(CONTEXT).

Stop strings are matched in the decoded generated text (``skip_special_tokens=True``, as vLLM), across token
boundaries, incrementally: an :class:`~common.detok.IncrementalDecoder` yields the new stable text of each
token (a multi-byte character split across tokens counts when its last byte arrives), and only matches that
end in that new text are looked for, against a tail of max stop-string length − 1 earlier characters. The
whole output is never re-decoded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from specdec_runtime.common.detok import IncrementalDecoder, find_stop_string
from specdec_runtime.common.types import FinishReason, StoppingCriteria


class StopChecker:
    """Per-session stopping rule, applied to committed tokens only; the same rule as target-only decoding.

    Args:
        tokenizer: HF tokenizer (only used when ``criteria.stop_strings`` is non-empty).
        criteria: max_new_tokens, stop_token_ids, stop_strings, ignore_eos.
        eos_token_ids: the model's EOS ids (ignored when ``criteria.ignore_eos``; stop_token_ids still stop).
        prompt_length: prompt tokens, counted against ``max_context_tokens``.
        max_context_tokens: context length of the target; generation stops when prompt + generated reaches it.

    Raises:
        ValueError: invalid criteria, negative prompt_length, or a prompt that leaves no room in the context
            (prompt_length >= max_context_tokens).
    """

    def __init__(
        self,
        tokenizer,
        criteria: StoppingCriteria,
        eos_token_ids: Iterable[int],
        prompt_length: int,
        max_context_tokens: int,
    ):
        criteria.validate()
        if prompt_length < 0:
            raise ValueError(f"prompt_length must be >= 0, got {prompt_length}")
        if prompt_length >= max_context_tokens:
            raise ValueError(
                f"prompt of {prompt_length} tokens leaves no room in a context of {max_context_tokens} tokens"
            )
        self.criteria = criteria
        self.prompt_length = prompt_length
        self.max_context_tokens = max_context_tokens
        eos = frozenset() if criteria.ignore_eos else frozenset(int(t) for t in eos_token_ids if t is not None)
        self._stop_ids = eos | frozenset(int(t) for t in criteria.stop_token_ids)
        self._stop_strings = tuple(criteria.stop_strings)
        self._tail_len = max((len(s) for s in self._stop_strings), default=1) - 1
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens=True) if self._stop_strings else None
        self._tail = ""  # the last _tail_len characters of the stable generated text
        self.generated_token_ids: list[int] = []
        self.finished = False
        self.finish_reason: FinishReason | None = None

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The ids that end the generation: EOS (unless ignore_eos) and the criteria's stop_token_ids (what
        min_tokens masks, :mod:`common.logits_processors`)."""
        return self._stop_ids

    @property
    def num_generated(self) -> int:
        """Committed output tokens so far."""
        return len(self.generated_token_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens that may still be committed before LENGTH/CONTEXT (0 once finished); a cap on block size."""
        if self.finished:
            return 0
        return min(
            self.criteria.max_new_tokens - self.num_generated,
            self.max_context_tokens - self.prompt_length - self.num_generated,
        )

    def checkpoint(self) -> tuple:
        """The stopping state, for :meth:`restore`: a verify step offers its candidates before the store commit,
        and a commit that fails must leave the session as if the step never ran (a retried block is then counted
        once, not twice)."""
        decoder = self._decoder.checkpoint() if self._decoder is not None else None
        return len(self.generated_token_ids), self._tail, decoder, self.finished, self.finish_reason

    def restore(self, state: tuple) -> None:
        """Go back to a :meth:`checkpoint` taken on this checker: the tokens appended since are forgotten."""
        num_generated, self._tail, decoder, self.finished, self.finish_reason = state
        del self.generated_token_ids[num_generated:]
        if decoder is not None:
            self._decoder.restore(decoder)

    def append(self, token_ids: Sequence[int]) -> tuple[int, FinishReason | None]:
        """Offer candidate tokens in order (an accepted block + next token).

        Returns ``(num_committed, finish_reason)``: tokens are committed up to and including the EARLIEST
        stopping token; tokens after it are not committed (not added to ``generated_token_ids``).

        Stops: an EOS id (unless criteria.ignore_eos) or a criteria.stop_token_ids id → EOS; a stop string
        appearing in the decoded generated text → STOP_STRING (the token that completes it is committed);
        max_new_tokens reached → LENGTH; prompt_length + generated == max_context_tokens → CONTEXT.

        Raises:
            RuntimeError: if already finished.
        """
        if self.finished:
            raise RuntimeError(f"append() after the session finished ({self.finish_reason.value})")
        for i, token_id in enumerate(token_ids):
            token_id = int(token_id)
            self.generated_token_ids.append(token_id)
            reason = self._check(token_id)
            if reason is not None:
                self.finished = True
                self.finish_reason = reason
                return i + 1, reason
        return len(token_ids), None

    def _check(self, token_id: int) -> FinishReason | None:
        if token_id in self._stop_ids:
            return FinishReason.EOS
        if self._decoder is not None:
            new_text = self._decoder.append([token_id])
            if new_text:
                text = self._tail + new_text
                # No stop string lies wholly in the tail (we would have stopped), so any match ends in new_text.
                if any(s in text for s in self._stop_strings):
                    return FinishReason.STOP_STRING
                self._tail = text[-self._tail_len :] if self._tail_len else ""
        n = len(self.generated_token_ids)
        if n >= self.criteria.max_new_tokens:
            return FinishReason.LENGTH
        if self.prompt_length + n >= self.max_context_tokens:
            return FinishReason.CONTEXT
        return None


def generated_text_for_output(
    tokenizer,
    generated_ids: Sequence[int],
    finish_reason: FinishReason | None,
    stop_strings: Sequence[str],
    *,
    skip_special_tokens: bool = True,
) -> str:
    """Decoded output text (``skip_special_tokens=True``, no tokenization-space cleanup), truncated before the
    earliest stop string when ``finish_reason`` is STOP_STRING (vLLM's default: the stop string is not part of
    the returned text). Tokens of a stop_token_ids stop keep their text (HF generate's behaviour).

    The reference for :class:`~common.detok.IncrementalDetokenizer`: its deltas concatenate to this.
    """
    text = tokenizer.decode(
        [int(t) for t in generated_ids], skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )
    if finish_reason == FinishReason.STOP_STRING:
        cut = find_stop_string(text, stop_strings)
        if cut >= 0:
            text = text[:cut]
    return text
