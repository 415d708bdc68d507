"""Responses: a generation's items (chunks, then its outcome or an error) as one OpenAI JSON body, or streamed
as server-sent events (``data: {chunk}`` lines, ``data: [DONE]`` last)."""

from __future__ import annotations

import json
import secrets
import time

from .engine import Engine, Outcome, _Job, next_item
from .errors import api_error_for
from .request import GenRequest


def usage(outcome: Outcome) -> dict:
    return {"prompt_tokens": outcome.num_prompt_tokens, "completion_tokens": outcome.num_completion_tokens,
            "total_tokens": outcome.num_prompt_tokens + outcome.num_completion_tokens}


async def respond(engine: Engine, req: GenRequest, obj: str, id_prefix: str):
    """The response to ``req`` (object type ``obj``: "chat.completion" or "text_completion"): an error before
    any output is raised as :class:`ApiError` (an HTTP status); after it, a streamed response ends with an error
    event."""
    from fastapi.responses import JSONResponse, StreamingResponse

    job = engine.submit(req)
    rid = id_prefix + secrets.token_hex(12)
    created = int(time.time())
    first = await next_item(job)  # errors before any output (open: unreachable, limits, bad prompt) → status
    if first[0] == "error":
        raise api_error_for(first[1])
    chat = obj == "chat.completion"
    if not req.stream:
        return JSONResponse(await _whole_body(job, first, rid, obj, created, engine.model_id, chat))
    events = _SseEvents(rid, "chat.completion.chunk" if chat else "text_completion", created, engine.model_id, chat)
    return StreamingResponse(events.stream(job, first, req.include_usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _whole_body(job: _Job, first: tuple, rid: str, obj: str, created: int, model_id: str, chat: bool) -> dict:
    """The non-streamed response body: every chunk collected, then the outcome (an error raised)."""
    parts = []
    item = first
    while item[0] == "chunk":
        parts.append(item[1])
        item = await next_item(job)
    if item[0] == "error":
        raise api_error_for(item[1])
    outcome: Outcome = item[1]
    choice = {"index": 0, "finish_reason": outcome.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": outcome.text}
    else:
        choice["text"] = outcome.text
    return {"id": rid, "object": obj, "created": created, "model": model_id,
            "choices": [choice], "usage": usage(outcome), "specdec": outcome.specdec}


class _SseEvents:
    """The server-sent events of one streamed response (chunk objects of OpenAI's chat or completions API)."""

    def __init__(self, rid: str, chunk_obj: str, created: int, model_id: str, chat: bool):
        self.rid, self.chunk_obj, self.created, self.model_id, self.chat = rid, chunk_obj, created, model_id, chat

    def event(self, choices: list, **extra) -> str:
        payload = {"id": self.rid, "object": self.chunk_obj, "created": self.created, "model": self.model_id,
                   "choices": choices, **extra}
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def delta(self, text: str | None, finish: str | None = None, role: bool = False) -> dict:
        if self.chat:
            d = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            return {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
        return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

    async def stream(self, job: _Job, first: tuple, include_usage: bool):
        """The events: (a role delta,) one per chunk, the finish (or an error event), (usage,) ``[DONE]``."""
        chat = self.chat
        item = first
        try:
            if chat:
                yield self.event([self.delta(None, role=True)])
            while item[0] == "chunk":
                yield self.event([self.delta(item[1])])
                item = await next_item(job)
            if item[0] == "error":
                err = api_error_for(item[1])
                yield f"data: {json.dumps(err.body())}\n\n"
                return
            outcome: Outcome = item[1]
            yield self.event([self.delta(None if chat else "", outcome.finish_reason)], specdec=outcome.specdec)
            if include_usage:
                yield self.event([], usage=usage(outcome))
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # a client gone mid-stream: the worker stops at the next chunk
