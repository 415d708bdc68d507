"""Logprobs in OpenAI's shapes, from a generation's :class:`~common.types.TokenLogprobs` (raw log-softmax of the
target, the numbers target-only decoding reports): chat's ``choices[].logprobs.content[]`` (token, logprob, bytes,
top_logprobs) and the legacy completions' ``tokens / token_logprobs / top_logprobs / text_offset``."""

from __future__ import annotations


def _token(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """The token's text (decoded alone) and its UTF-8 bytes."""
    text = tokenizer.decode([int(token_id)])
    return text, list(text.encode("utf-8"))


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


def completion_logprobs(tokenizer, token_ids: list[int], logprobs, text_offset: int = 0) -> dict:
    """The completions API's logprobs object (``text_offset``: characters of text before the first token)."""
    tokens, values, tops, offsets = [], [], [], []
    offset = text_offset
    for t, lp in zip(token_ids, logprobs):
        text, _ = _token(tokenizer, t)
        tokens.append(text)
        values.append(lp.logprob)
        top: dict[str, float] = {}
        for i, v in zip(lp.top_token_ids, lp.top_logprobs):
            top.setdefault(_token(tokenizer, i)[0], v)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def response_logprobs(tokenizer, outcome, chat: bool) -> dict | None:
    """The ``logprobs`` of one choice (None when not asked)."""
    if outcome.logprobs is None:
        return None
    if chat:
        return chat_logprobs(tokenizer, outcome.token_ids, outcome.logprobs)
    return completion_logprobs(tokenizer, outcome.token_ids, outcome.logprobs)
