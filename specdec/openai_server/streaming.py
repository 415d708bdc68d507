"""Responses: a generation's items (chunks, then its outcome or an error) as one OpenAI JSON body, or streamed
as server-sent events (``data: {chunk}`` lines, ``data: [DONE]`` last)."""

from __future__ import annotations

import dataclasses
import json
import secrets
import time

from .engine import Engine, Outcome, _Job, next_item
from .errors import api_error_for
from .logprobs import response_logprobs
from .request import GenRequest
from .structured import ChoiceDeltas, chat_message


def usage(outcomes: list[Outcome]) -> dict:
    """Usage of a response: the prompt once, the completion tokens of every choice."""
    prompt = outcomes[0].num_prompt_tokens if outcomes else 0
    completion = sum(o.num_completion_tokens for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def respond(engine: Engine, req: GenRequest, obj: str, id_prefix: str):
    """The response to ``req`` (object type ``obj``: "chat.completion" or "text_completion"): an error before
    any output is raised as :class:`ApiError` (an HTTP status); after it, a streamed response ends with an error
    event. ``req.n`` choices, generated one after the other (streamed with their indices)."""
    from fastapi.responses import JSONResponse, StreamingResponse

    job = engine.submit(req)
    rid = id_prefix + secrets.token_hex(12)
    created = int(time.time())
    first = await next_item(job)  # errors before any output (open: unreachable, limits, bad prompt) → status
    if first[0] == "error":
        raise api_error_for(first[1])
    chat = obj == "chat.completion"
    if not req.stream:
        return JSONResponse(await _whole_body(job, first, rid, obj, created, engine, chat, req.tools))
    events = _SseEvents(rid, "chat.completion.chunk" if chat else "text_completion", created, engine, chat,
                        req.tools)
    return StreamingResponse(events.stream(job, first, req.include_usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _whole_body(job: _Job, first: tuple, rid: str, obj: str, created: int, engine: Engine,
                      chat: bool, tools=None) -> dict:
    """The non-streamed response body: every choice's outcome collected (an error raised)."""
    outcomes: list[Outcome] = []
    item = first
    while item[0] != "done":
        if item[0] == "error":
            raise api_error_for(item[1])
        if item[0] == "choice":
            outcomes.append(item[1])
        item = await next_item(job)
    choices = []
    for outcome in outcomes:
        choice = {"index": outcome.index, "finish_reason": outcome.finish_reason,
                  "logprobs": response_logprobs(engine.tokenizer, outcome, chat)}
        if chat:  # with tools offered, call blocks become tool_calls (.structured.chat_message)
            choice["message"], choice["finish_reason"] = chat_message(outcome.text, outcome.finish_reason, tools)
        else:
            choice["text"] = outcome.text
        choices.append(choice)
    return {"id": rid, "object": obj, "created": created, "model": engine.model_id,
            "choices": choices, "usage": usage(outcomes), "specdec": outcomes[0].specdec}


class _SseEvents:
    """The server-sent events of one streamed response (chunk objects of OpenAI's chat or completions API)."""

    def __init__(self, rid: str, chunk_obj: str, created: int, engine: Engine, chat: bool, tools=None):
        self.rid, self.chunk_obj, self.created, self.chat = rid, chunk_obj, created, chat
        self.tools, self._deltas = tools, {}  # per choice: its ChoiceDeltas (tool-call deltas)
        self.model_id, self.tokenizer = engine.model_id, engine.tokenizer

    def event(self, choices: list, **extra) -> str:
        payload = {"id": self.rid, "object": self.chunk_obj, "created": self.created, "model": self.model_id,
                   "choices": choices, **extra}
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def delta(self, index: int, text: str | None, finish: str | None = None, role: bool = False,
              logprobs: dict | None = None) -> dict:
        if self.chat:
            d = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            return {"index": index, "delta": d, "finish_reason": finish, "logprobs": logprobs}
        return {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}

    async def stream(self, job: _Job, first: tuple, include_usage: bool):
        """The events: per choice (a role delta,) one per chunk, its logprobs (when asked: one event carrying
        every token's entry, before the finish), its finish; then (usage,) ``[DONE]``; or an error event."""
        chat = self.chat
        item, started, outcomes = first, set(), []
        try:
            while item[0] != "done":
                if item[0] == "error":
                    err = api_error_for(item[1])
                    yield f"data: {json.dumps(err.body())}\n\n"
                    return
                index = item[1] if item[0] == "chunk" else item[1].index
                if chat and index not in started:
                    started.add(index)
                    yield self.event([self.delta(index, None, role=True)])
                deltas = self._deltas.setdefault(index, ChoiceDeltas(self.tools if chat else None))
                if item[0] == "chunk":
                    for d in (deltas.feed(item[2]) if chat else [{"content": item[2]}]):
                        yield self.event([{**self.delta(index, d.get("content")), "delta": d}] if chat
                                         else [self.delta(index, d["content"])])
                else:
                    outcome: Outcome = item[1]
                    outcomes.append(outcome)
                    rest, finish = deltas.finish(outcome.finish_reason)
                    for d in rest:
                        yield self.event([{**self.delta(index, None), "delta": d}])
                    outcome = dataclasses.replace(outcome, finish_reason=finish)
                    lp = response_logprobs(self.tokenizer, outcome, chat)
                    if lp is not None:
                        yield self.event([self.delta(index, None if chat else "", logprobs=lp)])
                    yield self.event([self.delta(index, None if chat else "", outcome.finish_reason)],
                                     specdec=outcome.specdec)
                item = await next_item(job)
            if include_usage:
                yield self.event([], usage=usage(outcomes))
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # a client gone mid-stream: the worker stops at the next chunk
