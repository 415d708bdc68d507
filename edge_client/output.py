"""Streamed output: committed tokens → text chunks, each flagged verified (checked by the target) or not.

:class:`Chunk` is what :meth:`edge_client.client.EdgeClient.stream_chunks` yields; :class:`TextOutput` turns the
tokens a generation commits into chunks (incremental detokenization with stop strings held back,
:class:`common.detok.IncrementalDetokenizer`).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.detok import IncrementalDetokenizer
from common.types import FinishReason

__all__ = ["Chunk", "TextOutput"]


@dataclass(frozen=True)
class Chunk:
    """A piece of streamed text (:meth:`edge_client.client.EdgeClient.stream_chunks`).

    ``verified``: every token behind the text was checked by the target; False for text of tokens decoded by
    the draft model alone during a device fallback (text that mixes both counts as unverified).
    """

    text: str
    verified: bool = True


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

    def push(self, token_ids: list[int], verified: bool) -> list[Chunk]:
        """Chunks of the new text ``token_ids`` make streamable (possibly none: text held back)."""
        start = len(self.detok.text)
        delta = self.detok.push(token_ids)
        if not verified:  # their text, and a character they may have begun
            self.unverified_until = self.detok.decoded_length + 1
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
        return chunks
