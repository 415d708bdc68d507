"""Streamed output: committed tokens → text chunks, each flagged verified (checked by the target) or not.

:class:`Chunk` is what :meth:`edge_client.client.EdgeClient.stream_chunks` yields; :class:`TextOutput` turns the
tokens a generation commits into chunks (incremental detokenization with stop strings held back,
:class:`common.detok.IncrementalDetokenizer`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from specdec_runtime.common.detok import IncrementalDetokenizer
from specdec_runtime.common.types import FinishReason

__all__ = ["Chunk", "TextOutput"]


@dataclass(frozen=True)
class Chunk:
    """A piece of streamed text (:meth:`edge_client.client.EdgeClient.stream_chunks`).

    ``verified``: every token behind the text was checked by the target; False for text of tokens decoded by
    the draft model alone during a device fallback (text that mixes both counts as unverified).

    ``token_ids`` / ``logprobs``: the committed tokens handed out with this chunk and, when the generation asked
    for logprobs, their :class:`common.types.TokenLogprobs` (one per token, the target's). Tokens whose text is
    held back (a possible stop string, a split character) travel with the next chunk that has text; those of
    text never streamed (a stop string) are in the result only (``GenerationResult.logprobs`` has them all).
    """

    text: str
    verified: bool = True
    token_ids: tuple[int, ...] = ()
    logprobs: tuple = ()


class TextOutput:
    """Committed tokens → text chunks, each flagged verified or not. Text of unverified tokens is never flagged
    verified, even when it is streamed with later tokens (a held-back start of a stop string, or a character
    split across tokens).

    Args:
        tokenizer: the generation's tokenizer (HF-style).
        stop_strings: the generation's stop strings (text from one on is never streamed).
    """

    def __init__(self, tokenizer, stop_strings) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, stop_strings)
        self.unverified_until = 0  # characters of output text (from the start) that may hold unverified text
        # the generation's per-token logprobs (edge_client.generation.run.Run shares its list: extended before each
        # push), and the tokens / entries not yet handed out with a chunk
        self.logprobs: list = []
        self._handed_logprobs = 0
        self._pending_ids: list[int] = []
        # every route commits through push: its first tokens mark the end of the prefill (time to first token)
        self.first_token_t: float | None = None  # time.perf_counter() when the first token was committed
        self.first_token_count = 0  # tokens committed with it (a first block may commit several)

    def push(self, token_ids: list[int], verified: bool) -> list[Chunk]:
        """Chunks of the new text ``token_ids`` make streamable (possibly none: text held back)."""
        if token_ids and self.first_token_t is None:
            self.first_token_t, self.first_token_count = time.perf_counter(), len(token_ids)
        start = len(self.detok.text)
        delta = self.detok.push(token_ids)
        if not verified:  # their text, and a character they may have begun
            self.unverified_until = self.detok.decoded_length + 1
        self._pending_ids.extend(token_ids)
        return self._split(start, delta)

    def finish(self, finish_reason: FinishReason | None) -> list[Chunk]:
        """Chunks of the text still held back, once the generation ended with ``finish_reason``."""
        start = len(self.detok.text)
        return self._split(start, self.detok.finish(finish_reason))

    def _split(self, start: int, delta: str) -> list[Chunk]:
        if not delta:
            return []
        cut = min(max(0, self.unverified_until - start), len(delta))
        chunks = [Chunk(delta[:cut], False)] if cut else []
        if cut < len(delta):
            chunks.append(Chunk(delta[cut:], True))
        # the tokens since the last chunk (and their logprobs) go with the last chunk of this text
        new_logprobs = tuple(self.logprobs[self._handed_logprobs:])
        self._handed_logprobs = len(self.logprobs)
        last = chunks[-1]
        chunks[-1] = Chunk(last.text, last.verified, tuple(self._pending_ids), new_logprobs)
        self._pending_ids = []
        return chunks
