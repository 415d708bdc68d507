"""Responses: a generation's items (chunks, then its outcome or an error) as one OpenAI JSON body, or streamed
as server-sent events (``data: {chunk}`` lines, ``data: [DONE]`` last)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time

from .engine import Engine, Outcome, Job, next_item
from .errors import api_error_for
from .logprobs import TextOffsets, chat_logprobs, completion_logprobs, response_logprobs
from .request import GenRequest
from .spec_metrics import log_request, merge
from .structured import ChoiceDeltas, chat_message

# How often a request that streams nothing yet (a non-streamed one, or one before its first token) looks whether
# its client is still there: such a request has no send that would fail, so only a look tells it is abandoned.
DISCONNECT_POLL_S = 0.25


class Abandoned(Exception):
    """The client went away before its response was ready; the generation was stopped at its next chunk."""


async def _cancel_when_gone(request, job: Job) -> None:
    """Set ``job.cancelled`` once ``request``'s client has disconnected (polled every DISCONNECT_POLL_S)."""
    while not job.cancelled.is_set():
        if await request.is_disconnected():
            job.cancelled.set()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


def usage(outcomes: list[Outcome]) -> dict:
    """Usage of a response: the prompt once, the completion tokens of every choice."""
    prompt = outcomes[0].num_prompt_tokens if outcomes else 0
    completion = sum(o.num_completion_tokens for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def respond(engine: Engine, req: GenRequest, obj: str, id_prefix: str, tenant: str = "", request=None):
    """The response to ``req`` (object type ``obj``: "chat.completion" or "text_completion"): an error before
    any output is raised as :class:`ApiError` (an HTTP status); after it, a streamed response ends with an error
    event. ``req.n`` choices, generated one after the other (streamed with their indices). One log line per
    request (:func:`.spec_metrics.log_request`; ``tenant``: the caller's, "" = none).

    ``request``: the HTTP request; while nothing is streamed to it (a non-streamed response, or before a streamed
    one's first token) its disconnect is watched, and a client gone stops the generation at its next chunk (the
    worker is free for the requests behind it) and is logged ``finish=abandoned``. A streamed response that has
    begun stops on its failed send instead."""
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    job = engine.submit(req)
    rid = id_prefix + secrets.token_hex(12)
    created = int(time.time())
    watch = asyncio.create_task(_cancel_when_gone(request, job)) if request is not None else None
    try:
        first = await next_item(job)  # errors before any output (open: unreachable, limits, bad prompt) → status
        if first[0] == "cancelled":
            raise Abandoned()
        if first[0] == "error":
            raise api_error_for(first[1])
        chat = obj == "chat.completion"
        if not req.stream:
            body = await _whole_body(job, first, rid, obj, created, engine, chat, req.tools)
            log_request(rid, tenant, body.pop("_outcomes"))
            return JSONResponse(body)
    except Abandoned:
        log_request(rid, tenant, [], "abandoned")
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    except BaseException:
        log_request(rid, tenant, [], "error")
        job.cancelled.set()  # the handler itself was cancelled (server shutdown): stop the worker too
        raise
    finally:
        if watch is not None:
            watch.cancel()
    events = _SseEvents(rid, "chat.completion.chunk" if chat else "text_completion", created, engine, chat,
                        req.tools)
    events.tenant = tenant
    return StreamingResponse(events.stream(job, first, req.include_usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _whole_body(job: Job, first: tuple, rid: str, obj: str, created: int, engine: Engine,
                      chat: bool, tools=None) -> dict:
    """The non-streamed response body: every choice's outcome collected (an error raised)."""
    outcomes: list[Outcome] = []
    item = first
    while item[0] != "done":
        if item[0] == "error":
            raise api_error_for(item[1])
        if item[0] == "cancelled":
            raise Abandoned()
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
            "choices": choices, "usage": usage(outcomes), "specdec": outcomes[0].specdec,
            "metrics": merge([o.metrics for o in outcomes]), "_outcomes": outcomes}


class _SseEvents:
    """The server-sent events of one streamed response (chunk objects of OpenAI's chat or completions API)."""

    def __init__(self, rid: str, chunk_obj: str, created: int, engine: Engine, chat: bool, tools=None):
        self.rid, self.chunk_obj, self.created, self.chat = rid, chunk_obj, created, chat
        self.tools, self._deltas = tools, {}  # per choice: its _ChoiceStream
        self.model_id, self.tokenizer = engine.model_id, engine.tokenizer
        self.tenant = ""  # the caller's, for the request's log line

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

    async def stream(self, job: Job, first: tuple, include_usage: bool):
        """The events: per choice (a role delta,) one per chunk (with its tokens' logprobs when asked, as
        OpenAI streams them), its finish (with the logprobs of tokens not streamed yet: held-back text, a stop
        string); then (usage,) ``[DONE]``; or an error event."""
        chat = self.chat
        item, started, outcomes, logged = first, set(), [], False
        try:
            while item[0] not in ("done", "cancelled"):  # cancelled: its client is gone, nobody reads on
                if item[0] == "error":
                    err = api_error_for(item[1])
                    log_request(self.rid, self.tenant, outcomes, "error")
                    logged = True
                    yield f"data: {json.dumps(err.body())}\n\n"
                    return
                index = item[1] if item[0] == "chunk" else item[1].index
                if chat and index not in started:
                    started.add(index)
                    yield self.event([self.delta(index, None, role=True)])
                state = self._deltas.setdefault(index, _ChoiceStream(ChoiceDeltas(self.tools if chat else None)))
                if item[0] == "chunk":
                    for e in self._chunk_events(index, state, item):
                        yield e
                else:
                    outcomes.append(item[1])
                    for e in self._finish_events(index, state, item[1]):
                        yield e
                item = await next_item(job)
            log_request(self.rid, self.tenant, outcomes)
            logged = True
            if include_usage:
                yield self.event([], usage=usage(outcomes))
            yield "data: [DONE]\n\n"
        finally:
            if not logged:  # the client went away mid-stream (the stream was cancelled at a send or a wait)
                log_request(self.rid, self.tenant, outcomes, "abandoned")
            job.cancelled.set()  # a client gone mid-stream: the worker stops at the next chunk

    def _logprobs(self, state: "_ChoiceStream", token_ids: list[int], logprobs: list) -> dict | None:
        """The logprobs object of ``token_ids`` (the next ones of the choice not streamed yet), None if none."""
        if not logprobs:
            return None
        state.num_logprobs += len(logprobs)
        if self.chat:
            return chat_logprobs(self.tokenizer, token_ids, logprobs)
        return completion_logprobs(self.tokenizer, token_ids, logprobs, state.offsets)

    def _chunk_events(self, index: int, state: "_ChoiceStream", item: tuple) -> list[str]:
        """The events of one chunk; its tokens' logprobs go with the last (held over when its text is held)."""
        text = item[2]
        state.pending_ids += item[3] if len(item) > 3 else []
        state.pending_logprobs += item[4] if len(item) > 4 else []
        if self.chat:
            choices = [{**self.delta(index, d.get("content")), "delta": d} for d in state.deltas.feed(text)]
        else:
            choices = [self.delta(index, text)]
        if choices and state.pending_logprobs:
            choices[-1]["logprobs"] = self._logprobs(state, state.pending_ids, state.pending_logprobs)
            state.pending_ids, state.pending_logprobs = [], []
        return [self.event([c]) for c in choices]

    def _finish_events(self, index: int, state: "_ChoiceStream", outcome: Outcome) -> list[str]:
        """The events of a choice's end: held-back text, the logprobs not streamed yet, the finish."""
        rest, finish = state.deltas.finish(outcome.finish_reason)
        outcome = dataclasses.replace(outcome, finish_reason=finish)
        choices = [{**self.delta(index, None), "delta": d} for d in rest]
        if outcome.logprobs is not None and len(outcome.logprobs) > state.num_logprobs:
            n = state.num_logprobs
            lp = self._logprobs(state, outcome.token_ids[n:], outcome.logprobs[n:])
            if choices:
                choices[-1]["logprobs"] = lp
            else:
                choices.append(self.delta(index, None if self.chat else "", logprobs=lp))
        events = [self.event([c]) for c in choices]
        events.append(self.event([self.delta(index, None if self.chat else "", outcome.finish_reason)],
                                 specdec=outcome.specdec, metrics=outcome.metrics))
        return events


@dataclasses.dataclass
class _ChoiceStream:
    """What one streamed choice carries between its events."""

    deltas: ChoiceDeltas  # tool-call deltas (chat)
    num_logprobs: int = 0  # logprob entries streamed
    offsets: TextOffsets = dataclasses.field(default_factory=TextOffsets)  # completions: text_offset so far
    pending_ids: list = dataclasses.field(default_factory=list)  # tokens of held-back text, with their logprobs
    pending_logprobs: list = dataclasses.field(default_factory=list)
