"""Logprobs in OpenAI's shapes, from a generation's :class:`~common.types.TokenLogprobs` (raw log-softmax of the
target, the numbers target-only decoding reports): chat's ``choices[].logprobs.content[]`` (token, logprob, bytes,
top_logprobs) and the legacy completions' ``tokens / token_logprobs / top_logprobs / text_offset``.

A token is named by its raw bytes (:func:`common.token_bytes.token_bytes`), not by its text decoded alone: byte-level
BPE splits a CJK character or an emoji over tokens that are not UTF-8 alone. ``bytes`` carries them as they are
(their concatenation is the UTF-8 of the text); ``token`` is their text, or ``bytes:\\xNN...`` where they do not
decode alone (OpenAI's form); ``text_offset`` counts the characters of the text before a token (a token inside a
character: where that character starts).
"""

from __future__ import annotations

import codecs

from specdec_runtime.common.token_bytes import token_bytes


def _token(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """The token's name (its text, or ``bytes:\\xNN..``) and its raw bytes."""
    raw = token_bytes(tokenizer, token_id)
    try:
        return raw.decode("utf-8"), list(raw)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


class TextOffsets:
    """Character offsets of a choice's tokens in its text, streamed or not: the text is the UTF-8 decoding of the
    tokens' bytes (invalid bytes as U+FFFD, as the tokenizer decodes them), and an incomplete character is held
    in the decoder until its last token comes."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.num_chars = 0  # characters decoded so far

    def next(self, raw: list[int]) -> int:
        """The offset of the token with bytes ``raw`` (the one after those already seen)."""
        offset = self.num_chars
        self.num_chars += len(self._decoder.decode(bytes(raw)))
        return offset


def chat_logprobs(tokenizer, token_ids: list[int], logprobs) -> dict:
    """``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], "refusal": None}``."""
    content = []
    for t, lp in zip(token_ids, logprobs):
        text, raw = _token(tokenizer, t)
        top = []
        for i, v in zip(lp.top_token_ids, lp.top_logprobs):
            alt, alt_raw = _token(tokenizer, i)
            top.append({"token": alt, "logprob": v, "bytes": alt_raw})
        content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, token_ids: list[int], logprobs, offsets: TextOffsets | None = None) -> dict:
    """The completions API's logprobs object. ``offsets``: the choice's :class:`TextOffsets` so far (a stream's,
    carried over its chunks); None = these tokens start the text."""
    offsets = offsets if offsets is not None else TextOffsets()
    tokens, values, tops, text_offset = [], [], [], []
    for t, lp in zip(token_ids, logprobs):
        text, raw = _token(tokenizer, t)
        tokens.append(text)
        values.append(lp.logprob)
        top: dict[str, float] = {}
        for i, v in zip(lp.top_token_ids, lp.top_logprobs):
            top.setdefault(_token(tokenizer, i)[0], v)
        tops.append(top)
        text_offset.append(offsets.next(raw))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": text_offset}


def response_logprobs(tokenizer, outcome, chat: bool) -> dict | None:
    """The ``logprobs`` of one choice (None when not asked)."""
    if outcome.logprobs is None:
        return None
    if chat:
        return chat_logprobs(tokenizer, outcome.token_ids, outcome.logprobs)
    return completion_logprobs(tokenizer, outcome.token_ids, outcome.logprobs)
