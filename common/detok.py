"""Incremental detokenization of committed tokens: streaming text deltas, stop-string aware.

Two layers:

- :class:`IncrementalDecoder` turns a growing list of token ids into *stable* text deltas, decoding only a
  short window of recent tokens each time (the prefix_offset/read_offset scheme of vLLM's
  ``detokenize_incrementally`` and HF ``TextStreamer``), so the cost per call does not grow with the output.
  Text is stable once no later token can change it: a decode that ends in U+FFFD (a multi-byte character
  whose bytes are split across tokens, as byte-level BPE such as SmolLM2's does for CJK and emoji) is held
  back until the character completes.
- :class:`IncrementalDetokenizer` streams that text to an application and, in addition, holds back any tail
  that could be the beginning of a stop string, so that nothing at or after a stop string is ever streamed.

Both decode with ``clean_up_tokenization_spaces=False`` (cleanup rewrites text across token boundaries, which
no incremental decoder can reproduce; SmolLM2's tokenizer has it off anyway), exactly as
:func:`common.stopping.generated_text_for_output` does, so that the concatenation of all deltas equals that
function's result for the same tokens, however the tokens are split into calls.

Exactness: for byte-level BPE tokenizers (GPT-2 family, SmolLM2, Llama 3, Qwen) decoding is concatenation of
bytes followed by UTF-8 decoding, so a window decode starting at a character boundary is exactly the
corresponding suffix of the full decode and the deltas are exact. For SentencePiece-style tokenizers the window
keeps at least one token of left context (as vLLM does) so that leading-space handling matches.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from specdec_runtime.common.types import FinishReason

REPLACEMENT_CHAR = "\ufffd"

# Rebase the decode window once it holds more tokens than this (and its text ends on a character boundary).
_MAX_WINDOW_TOKENS = 8


def find_stop_string(text: str, stop_strings: Iterable[str]) -> int:
    """Index in ``text`` of the earliest occurrence of any of ``stop_strings``, or -1 if none occurs.

    "Earliest" is the smallest start index; the text before it contains no stop string at all. This is the
    truncation point of output text that finished with FinishReason.STOP_STRING (vLLM's default: the stop
    string is not part of the returned text).
    """
    best = -1
    for s in stop_strings:
        i = text.find(s)
        if i >= 0 and (best < 0 or i < best):
            best = i
    return best


def stop_prefix_length(text: str, stop_strings: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper, non-empty prefix of some stop string.

    That suffix may still grow into a stop string, so it must not be streamed yet. 0 when there is none.
    """
    best = 0
    for s in stop_strings:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class IncrementalDecoder:
    """Stable text of a growing token sequence, decoded through a short window of recent tokens.

    ``append(ids)`` returns the newly stable text (str, possibly empty); ``flush()`` returns the rest, with any
    incomplete trailing character decoded as the tokenizer decodes it (U+FFFD). The concatenation of all
    returned strings equals ``tokenizer.decode(all_ids, skip_special_tokens=..., clean_up_tokenization_spaces=
    False)`` for byte-level BPE tokenizers.

    Window invariant: ``_start`` is a token index at a character boundary (the decode of the tokens before it
    did not end in U+FFFD) and ``_consumed`` characters of ``decode(ids[_start:])`` have been returned.
    Trailing U+FFFD characters are held back (they are an incomplete character, or a byte-fallback byte run,
    that later tokens may complete); the text before them is stable.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._start = 0  # window start, a token index at a character boundary
        self._consumed = 0  # characters of decode(ids[_start:]) already returned
        self._boundaries: list[int] = [0]  # token indices >= _start at which the window's decode ended cleanly

    @property
    def token_ids(self) -> list[int]:
        """All token ids appended so far (do not mutate)."""
        return self._ids

    def checkpoint(self) -> tuple:
        """The decoder's state, for :meth:`restore` (O(window) to take: the token list is append-only)."""
        return len(self._ids), self._start, self._consumed, list(self._boundaries)

    def restore(self, state: tuple) -> None:
        """Go back to a :meth:`checkpoint` of this decoder: as if the tokens appended since were never seen."""
        num_ids, self._start, self._consumed, boundaries = state
        del self._ids[num_ids:]
        self._boundaries = list(boundaries)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def append(self, token_ids: Iterable[int]) -> str:
        """Add tokens; return the text that became stable (str, "" when all of it is held back)."""
        new = [int(t) for t in token_ids]
        if not new:
            return ""
        self._ids.extend(new)
        n = len(self._ids)
        window = self._decode(self._ids[self._start :])
        stable = len(window.rstrip(REPLACEMENT_CHAR))
        delta = window[self._consumed : stable] if stable > self._consumed else ""
        self._consumed = max(self._consumed, stable)
        if stable == len(window):  # ends on a character boundary
            self._boundaries.append(n)
        if n - self._start > _MAX_WINDOW_TOKENS:
            self._rebase(len(window))
        return delta

    def _rebase(self, window_len: int) -> None:
        """Move the window start to the latest boundary before the end of the fully decoded tokens, so that the
        new window keeps at least one decoded token as left context (SentencePiece leading-space handling)."""
        decoded_end = self._boundaries[-1]
        starts = [b for b in self._boundaries if self._start < b < decoded_end]
        if not starts:
            return  # no boundary yet (a long run of incomplete characters): keep the window
        start = starts[-1]
        held = window_len - self._consumed  # characters after the consumed text (trailing U+FFFD)
        self._consumed = max(0, len(self._decode(self._ids[start:])) - held)
        self._start = start
        self._boundaries = [b for b in self._boundaries if b >= start]

    def flush(self) -> str:
        """Return all text not returned yet, held-back trailing characters included (U+FFFD if incomplete)."""
        window = self._decode(self._ids[self._start :])
        rest = window[self._consumed :]
        self._consumed = max(self._consumed, len(window))
        return rest


class IncrementalDetokenizer:
    """Streams text deltas of committed tokens.

    Never emits a broken multi-byte character (a character split across tokens is held back until complete:
    a decode ending in U+FFFD is held), and holds back any tail that could be the beginning of a stop string,
    so that nothing at or after a stop string is ever streamed; a held tail is released as soon as the text
    continues in a way that cannot complete the stop string.

    Invariant: the concatenation of all push() and finish() results equals
    ``common.stopping.generated_text_for_output(tokenizer, all_token_ids, finish_reason, stop_strings)``
    (with the same ``skip_special_tokens``), whatever way the tokens are split into push() calls.

    Cost per push: one decode (two when the window moves) of a window of about _MAX_WINDOW_TOKENS +
    len(token_ids) tokens (longer only over a run of pushes that all end inside a character), and a stop-string
    scan of the held text only (at most max stop-string length − 1 characters plus the new text).

    Raises:
        ValueError: on an empty stop string.
        RuntimeError: push() or finish() after finish().
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str] = (), skip_special_tokens: bool = True):
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
        self._stop_strings = tuple(stop_strings)
        # Stable text not emitted yet. Invariant: no stop-string occurrence (complete, or a prefix reaching the
        # end of the text) starts in the emitted text, so only this held text needs scanning.
        self._held = ""
        self._stop_seen = False  # a complete stop string is in the held text: stream nothing more
        self._parts: list[str] = []
        self.finished = False

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def token_ids(self) -> list[int]:
        """All token ids pushed so far (do not mutate)."""
        return self._decoder.token_ids

    @property
    def decoded_length(self) -> int:
        """Characters of stable text decoded so far: emitted (:attr:`text`) plus held back (a possible start of a
        stop string). Text past it belongs to tokens pushed later, or completes a character split across tokens
        (at most one character)."""
        return len(self.text) + len(self._held)

    def _emit(self, s: str) -> str:
        if s:
            self._parts.append(s)
        return s

    def push(self, token_ids: list[int]) -> str:
        """Add committed tokens; return the new text that is safe to stream (possibly "")."""
        if self.finished:
            raise RuntimeError("IncrementalDetokenizer.push() after finish()")
        delta = self._decoder.append(token_ids)
        if not delta:
            return ""
        held = self._held + delta
        if self._stop_seen:  # kept only for a finish() whose reason is not STOP_STRING
            self._held = held
            return ""
        if not self._stop_strings:
            self._held = ""
            return self._emit(held)
        cut = find_stop_string(held, self._stop_strings)
        if cut >= 0:
            self._stop_seen = True
        else:
            cut = len(held) - stop_prefix_length(held, self._stop_strings)
        self._held = held[cut:]
        return self._emit(held[:cut])

    def finish(self, finish_reason: FinishReason | None) -> str:
        """Flush the rest (incomplete trailing characters included); truncated at the earliest stop string
        when ``finish_reason`` is STOP_STRING. Returns the final delta."""
        if self.finished:
            raise RuntimeError("IncrementalDetokenizer.finish() called twice")
        self.finished = True
        rest = self._held + self._decoder.flush()
        self._held = ""
        if finish_reason == FinishReason.STOP_STRING:
            cut = find_stop_string(rest, self._stop_strings)
            if cut >= 0:
                rest = rest[:cut]
        return self._emit(rest)
