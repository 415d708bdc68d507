"""The turn a model drafter drafts for: where its output starts and which ids min_tokens masks, and the
history-dependent logits processors' state (penalties, min_tokens: :class:`common.logits_processors.TokenHistory`)
brought incrementally to the tokens drafted from. One home for what every drafter that applies the session's
processors to its own logits keeps per generation."""

from __future__ import annotations

from specdec_runtime.common.logits_processors import TokenHistory
from specdec_runtime.common.types import SamplingParams, StoppingCriteria

__all__ = ["TurnHistory"]


class TurnHistory:
    """Per generation: ``prompt_length`` (output counts from there), ``stop_ids`` (the ids min_tokens masks:
    the tokenizer's EOS unless ignore_eos, and the stop token ids), and the processors' counts. Before
    :meth:`begin`, the whole history counts as output."""

    def __init__(self):
        self.prompt_length = 0
        self.stop_ids: frozenset[int] = frozenset()
        self._history: TokenHistory | None = None

    @property
    def turn(self) -> tuple[int, frozenset[int]]:
        """(prompt length, stop ids)."""
        return self.prompt_length, self.stop_ids

    def begin(self, prompt_length: int, stopping: StoppingCriteria, eos_token_id: int | None) -> None:
        """The generation (or conversation turn) about to be drafted; the counts start afresh."""
        ids = set(int(t) for t in stopping.stop_token_ids)
        if eos_token_id is not None and not stopping.ignore_eos:
            ids.add(int(eos_token_id))
        self.prompt_length, self.stop_ids = int(prompt_length), frozenset(ids)
        self._history = None

    def processor(self, sampling: SamplingParams, token_ids: list[int], vocab_size: int) -> TokenHistory | None:
        """The history-dependent processors' state brought to ``token_ids``, or None when the session has none
        (incremental: only the tokens that changed since the last call are counted)."""
        if not sampling.has_history_processors:
            return None
        h = self._history
        if (h is None or h.params != sampling or h.prompt_length != self.prompt_length
                or h.vocab_size != vocab_size):
            h = self._history = TokenHistory(sampling, vocab_size, self.prompt_length, self.stop_ids, token_ids)
        else:
            h.sync(token_ids)
        return h
