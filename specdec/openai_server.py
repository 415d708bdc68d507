"""An OpenAI-compatible HTTP endpoint on the device (``specdec edge-serve``): apps that speak the OpenAI API
(the ``openai`` client, LangChain, chat UIs) call it as if it were OpenAI; it answers with speculative decoding
(the local draft + the cloud verifier, or an embedded verifier).

Built on FastAPI (Starlette) + uvicorn; streaming with server-sent events, as OpenAI's API does
(``data: {chunk}`` lines, ``data: [DONE]`` last). Follows OpenAI's API reference for
``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/completions``:

- parameters: ``model``, ``messages`` / ``prompt``, ``max_tokens`` / ``max_completion_tokens``, ``temperature``,
  ``top_p``, ``seed``, ``stop`` (string or list), ``stream``, ``stream_options.include_usage``; ``top_k`` and
  ``ignore_eos`` as extensions (as vLLM's server has them). ``n`` > 1 and every parameter that would change the
  output but is not supported (``logprobs``, ``logit_bias``, penalties != 0, ``tools``, a ``response_format``
  other than text, ...) are refused with HTTP 400 and a message naming it: never silently ignored.
- responses: ``usage`` (prompt, completion, total tokens), ``finish_reason`` (``stop``: EOS or a stop string;
  ``length``: max tokens or the context limit) and a ``specdec`` object (``acceptance_rate``,
  ``mean_accepted_length``, ``num_unverified_tokens``: tokens decoded by the draft alone during a device
  fallback, never passed off as the target's).
- errors: OpenAI's error JSON ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status of the
  cause: 400 bad request (:class:`InvalidRequestError` included), 401 missing/invalid API key, 404 unknown
  model, 429 the verifier's RESOURCE_EXHAUSTED (limits, capacity; ``Retry-After`` when the verifier gave a
  hint), 502 the verifier refused the endpoint itself (its key, tokenizer), 503 the cloud is unreachable and no
  fallback is allowed (UNAVAILABLE, DEADLINE_EXCEEDED).

Conversation reuse (vLLM's automatic prefix caching, per conversation): a chat request whose rendered prompt
ids start with the ``history_ids`` of a kept :class:`edge_client.conversation.Conversation` (the previous
request's messages + the assistant's reply + a new user message) continues that conversation with
``send_ids(suffix)``: the verifier prefills only the suffix and keeps its KV cache, and the draft its own.
Matching is on token ids, so a client that edited the history, or a reply that ended on a stop string or the
length limit (its ids are not those the template renders), starts a new conversation: never a wrong output.
Kept conversations: a small LRU (``max_conversations``), the least recently used closed first.

Concurrency: one :class:`edge_client.client.EdgeClient` serves every request, and it is not thread-safe (its
drafter holds the ONNX draft's KV cache, ``last_result`` is per client), so generations run one at a time on a
single worker thread, in arrival order; this also makes each kept conversation used by one request at a time.
The HTTP side (SSE streaming, parsing, auth) stays concurrent. Seeded sampled requests start with a cold draft
KV cache, so that the same request gives the same output whatever ran before it (the int8 draft's numbers depend
on how its cache was filled). A client that disconnects mid-stream cancels its
generation at the next committed chunk (the verifier session is closed).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from common.errors import (
    CapacityError,
    DeadlineError,
    InvalidRequestError,
    PreconditionError,
    RateLimitedError,
    SpecdecError,
    UnauthenticatedError,
    VerifierUnavailableError,
)
from common.types import FinishReason
from starlette.requests import Request  # module level: FastAPI resolves the handlers' annotations here

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256  # max_tokens when a request gives none (OpenAI: up to the context; a device endpoint
# keeps it bounded)
DEFAULT_MAX_CONVERSATIONS = 8  # kept conversations (LRU)

# accepted and without effect on the output
_HARMLESS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options",
             "prompt_cache_key", "safety_identifier"}
# supported (the endpoint's own parameters)
_CHAT_PARAMS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
                "stream", "top_k", "n", "ignore_eos"}
_COMPLETION_PARAMS = {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "top_k",
                      "n", "ignore_eos"}
# would change the output and are not supported: refused unless given their neutral value
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "logprobs": lambda v: v in (None, False, 0),
    "top_logprobs": lambda v: v in (None, 0),
    "logit_bias": lambda v: not v,
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"),
    "function_call": lambda v: v in (None, "none"),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "best_of": lambda v: v in (None, 1),
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "modalities": lambda v: v is None or v == ["text"],
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "web_search_options": lambda v: v is None,
}


class ApiError(Exception):
    """An error answered in OpenAI's error JSON with HTTP ``status``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def api_error_for(e: BaseException) -> ApiError:
    """The HTTP error for an exception of a generation (see the module docstring for the mapping)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, InvalidRequestError):
        return ApiError(400, str(e))
    if isinstance(e, RateLimitedError):
        seconds = max(1, -(-e.retry_after_ms // 1000))
        return ApiError(429, str(e), "rate_limit_exceeded", code="rate_limit_exceeded",
                        headers={"Retry-After": str(seconds)})
    if isinstance(e, CapacityError):
        return ApiError(429, str(e), "rate_limit_exceeded", code="capacity_exceeded")
    if isinstance(e, (VerifierUnavailableError, DeadlineError)):
        return ApiError(503, f"the verifier cannot be reached: {e}", "service_unavailable",
                        code="verifier_unavailable")
    if isinstance(e, (UnauthenticatedError, PreconditionError)):
        return ApiError(502, f"the verifier refused this endpoint: {e}", "bad_gateway", code="verifier_refused")
    if isinstance(e, SpecdecError):
        return ApiError(500, str(e) or type(e).__name__, "server_error")
    log.exception("generation failed", exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}", "server_error")


# ------------------------------------------------------------------------------------------- request parsing


@dataclass
class GenRequest:
    """A validated request: prompt token ids and the generation's keyword arguments."""

    prompt_ids: list[int]
    kwargs: dict
    stream: bool
    include_usage: bool
    chat: bool


def _check_params(body: dict, supported: set[str]) -> None:
    for name, value in body.items():
        if name in supported or name in _HARMLESS:
            continue
        neutral = _NEUTRAL.get(name)
        if neutral is not None and neutral(value):
            continue
        if neutral is not None:
            raise ApiError(400, f"parameter '{name}' is not supported by this endpoint (it would change the "
                           "output): leave it out", param=name, code="unsupported_parameter")
        raise ApiError(400, f"unknown or unsupported parameter '{name}'", param=name, code="unsupported_parameter")


def _number(body: dict, name: str, default, kind=float, lo=None, hi=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {value!r}",
                       param=name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ApiError(400, f"'{name}' must be in [{lo}, {hi if hi is not None else 'inf'}], got {value!r}",
                       param=name)
    return kind(value)


def _generation_kwargs(body: dict, chat: bool) -> tuple[dict, bool, bool]:
    n = _number(body, "n", 1, int, 1)
    if n != 1:
        raise ApiError(400, f"n = {n} is not supported: one choice per request (n = 1)", param="n",
                       code="unsupported_parameter")
    max_tokens = body.get("max_completion_tokens") if chat else None
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = body.get("max_tokens"), "max_tokens"
    max_tokens = _number({name: max_tokens}, name, DEFAULT_MAX_TOKENS, int, 1)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise ApiError(400, "'stop' must be a non-empty string or a list of at most 16 of them", param="stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, f"'seed' must be an integer, got {seed!r}", param="seed")
    if seed is not None:
        seed &= (1 << 63) - 1  # the sessions' seed is an unsigned 63-bit integer; OpenAI's may be negative
    stream = body.get("stream", False) or False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    if options and not stream:
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    ignore_eos = body.get("ignore_eos", False) or False
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, "'ignore_eos' must be a boolean", param="ignore_eos")
    kwargs = dict(
        max_new_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, float, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, float, 0.0, 1.0),
        top_k=_number(body, "top_k", 0, int, 0),
        seed=seed,
        stop=tuple(stop),
        ignore_eos=ignore_eos,
    )
    if kwargs["top_p"] == 0.0:
        raise ApiError(400, "'top_p' must be > 0", param="top_p")
    return kwargs, stream, bool(options.get("include_usage"))


def parse_messages(messages) -> list[dict]:
    """OpenAI chat messages → ``[{"role", "content"}]`` with text content (parts of type text joined).

    Raises:
        ApiError(400): not a non-empty list, a role other than system/developer/user/assistant, a content part
            that is not text, or a field that would change the output (``name``, ``tool_calls``).
    """
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", param="messages")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise ApiError(400, f"messages[{i}].role {role!r} is not supported (system, developer, user, assistant)",
                           param="messages")
        for extra in ("name", "tool_calls", "function_call", "audio"):
            if m.get(extra):
                raise ApiError(400, f"messages[{i}].{extra} is not supported", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        out.append({"role": role, "content": content})
    return out


def render_chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Prompt ids of a chat through the tokenizer's chat template, message content as literal text
    (:func:`common.chat.render_chat_ids`: special-token strings typed in a message are not parsed)."""
    from common.chat import render_chat_ids as render

    return [int(t) for t in render(tokenizer, messages, add_generation_prompt=True)]


# ------------------------------------------------------------------------------------------- the engine


@dataclass
class Outcome:
    """What a generation produced, for the response body."""

    text: str
    num_completion_tokens: int
    finish_reason: str
    specdec: dict
    conversation_reused: bool = False
    num_prompt_tokens: int = 0


def _finish_reason(reason: FinishReason | None) -> str:
    return "length" if reason in (FinishReason.LENGTH, FinishReason.CONTEXT) else "stop"


def _outcome(result, num_prompt_tokens: int, reused: bool) -> Outcome:
    s = result.stats
    return Outcome(
        text=result.text,
        num_completion_tokens=len(result.token_ids),
        finish_reason=_finish_reason(result.finish_reason),
        specdec={
            "acceptance_rate": s.acceptance_rate if s.num_draft_tokens else None,
            "mean_accepted_length": s.mean_accepted_length,
            "num_unverified_tokens": result.num_unverified_tokens,
            "num_generated_tokens": s.num_generated_tokens,
            "elapsed_s": s.elapsed_s,
            "conversation_reused": reused,
        },
        conversation_reused=reused,
        num_prompt_tokens=num_prompt_tokens,
    )


def _close_quietly(conv) -> None:
    try:
        conv.close()
    except Exception:  # noqa: BLE001 - best effort: an abandoned verifier session expires by TTL
        pass


@dataclass
class _Job:
    """A generation run on the engine's worker thread, its chunks passed to the event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Engine:
    """Runs generations of one :class:`EdgeClient`, one at a time (see the module docstring), and keeps
    conversations for reuse.

    Args:
        client: the EdgeClient (draft + backend); owned: closed by :meth:`close` with ``on_close``.
        model_id: the id ``/v1/models`` lists and requests name.
        max_conversations: kept conversations (LRU); 0 turns reuse off.
    """

    def __init__(self, client, model_id: str, *, max_conversations: int = DEFAULT_MAX_CONVERSATIONS,
                 on_close: Callable[[], None] | None = None):
        self.client = client
        self.tokenizer = client.tokenizer
        self.model_id = model_id
        self.max_conversations = max_conversations
        self.on_close = on_close
        self.created = int(time.time())
        self._conversations: OrderedDict[int, Any] = OrderedDict()  # id → Conversation, oldest first
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-edge-serve")
        self.num_reused = 0

    # -- conversations (touched on the worker thread only)

    def _take_conversation(self, prompt_ids: list[int]):
        """The kept conversation whose history_ids are the longest proper prefix of ``prompt_ids`` (removed from
        the LRU while in use), or None."""
        best_key, best_len = None, 0
        for key, conv in self._conversations.items():
            hist = conv.history_ids
            if best_len < len(hist) < len(prompt_ids) and prompt_ids[:len(hist)] == list(hist):
                best_key, best_len = key, len(hist)
        return self._conversations.pop(best_key) if best_key is not None else None

    def _keep_conversation(self, conv) -> None:
        if self.max_conversations <= 0:
            conv.close()
            return
        self._conversations[id(conv)] = conv
        while len(self._conversations) > self.max_conversations:
            _close_quietly(self._conversations.popitem(last=False)[1])

    # -- generation

    def _run(self, job: _Job, req: GenRequest) -> None:
        """Worker thread: one generation, its chunks and then ("done", Outcome) or ("error", exc) to ``job``.

        Kept conversations hold verifier sessions (and their KV cache): when the verifier refuses a session
        for capacity or a tenant's session limit (RESOURCE_EXHAUSTED) before anything was streamed, the kept
        conversations are closed and the request is tried once more; the second refusal is the answer (429)."""
        if job.cancelled.is_set():
            return
        # (a seeded sampled request starts from a fresh draft KV cache: EdgeClient._generate resets the drafter)
        for attempt in (1, 2):
            emitted = [False]
            try:
                self._generate(job, req, emitted, reuse=attempt == 1)
                return
            except CapacityError as e:
                if attempt == 1 and not emitted[0] and self._conversations:
                    log.info("verifier refused a session (%s): closing %d kept conversations, trying again", e,
                             len(self._conversations))
                    self._close_conversations()
                    continue
                job.put(("error", e))
                return
            except BaseException as e:  # noqa: BLE001 - answered to the request
                job.put(("error", e))
                return

    def _generate(self, job: _Job, req: GenRequest, emitted: list[bool], reuse: bool) -> None:
        conv, reused = None, False
        try:
            if req.chat and self.max_conversations > 0 and hasattr(self.client, "chat"):
                conv = self._take_conversation(req.prompt_ids) if reuse else None
                reused = conv is not None
                if conv is None:
                    conv = self.client.chat()
                    chunks = conv.send_ids(req.prompt_ids, **req.kwargs)
                else:
                    chunks = conv.send_ids(req.prompt_ids[len(conv.history_ids):], **req.kwargs)
            else:
                chunks = self.client.stream_chunks(req.prompt_ids, **req.kwargs)
            complete = True
            try:
                for chunk in chunks:
                    if job.cancelled.is_set():
                        complete = False
                        break
                    if chunk.text:
                        emitted[0] = True
                        job.put(("chunk", chunk.text))
            finally:
                close = getattr(chunks, "close", None)
                if close is not None:
                    close()
        except BaseException:
            if conv is not None:
                _close_quietly(conv)
            raise
        if not complete:
            if conv is not None:
                _close_quietly(conv)
            return
        result = conv.last_result if conv is not None else self.client.last_result
        if reused:
            self.num_reused += 1
        if conv is not None:
            self._keep_conversation(conv)
        job.put(("done", _outcome(result, len(req.prompt_ids), reused)))

    def _close_conversations(self) -> None:
        while self._conversations:
            _close_quietly(self._conversations.popitem(last=False)[1])

    def submit(self, req: GenRequest) -> _Job:
        """Queue ``req`` on the worker thread; its items arrive on the returned job's queue."""
        job = _Job(asyncio.get_running_loop())
        self._worker.submit(self._run, job, req)
        return job

    def close(self) -> None:
        """Stop the worker (a generation in progress finishes), close the kept conversations and ``on_close``."""
        self._worker.shutdown(wait=True, cancel_futures=True)
        self._close_conversations()
        if self.on_close is not None:
            self.on_close()


# ------------------------------------------------------------------------------------------- the app


def create_app(engine: Engine, api_keys: Callable[[str | None], bool] | None = None):
    """The FastAPI app of ``engine``.

    ``api_keys``: a check of the request's Bearer token (True = allowed); None = no authentication.
    """
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="specdec edge endpoint (OpenAI-compatible)", docs_url=None, redoc_url=None)
    app.state.engine = engine

    def error_response(err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, exc):
        return error_response(ApiError(400, str(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return error_response(ApiError(exc.status_code, str(exc.detail), kind))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_keys is not None and request.url.path.startswith("/v1/"):
            header = request.headers.get("authorization", "")
            token = header[7:].strip() if header[:7].lower() == "bearer " else None
            if not api_keys(token):
                return error_response(ApiError(401, "missing or invalid API key (authorization: Bearer KEY)",
                                               "invalid_request_error", code="invalid_api_key"))
        return await call_next(request)

    async def read_body(request: Request, supported: set[str]) -> dict:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the request body must be JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        _check_params(body, supported)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' is required", param="model")
        if model != engine.model_id:
            raise ApiError(404, f"the model '{model}' does not exist; this endpoint serves '{engine.model_id}'",
                           param="model", code="model_not_found")
        return body

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [
            {"id": engine.model_id, "object": "model", "created": engine.created, "owned_by": "specdec"}]}

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str):
        if model_id != engine.model_id:
            raise ApiError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
        return {"id": engine.model_id, "object": "model", "created": engine.created, "owned_by": "specdec"}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request, _CHAT_PARAMS)
        messages = parse_messages(body.get("messages"))
        kwargs, stream, include_usage = _generation_kwargs(body, chat=True)
        try:
            prompt_ids = render_chat_ids(engine.tokenizer, messages)
        except (ValueError, TypeError) as e:  # the template refused the messages (e.g. roles out of order)
            raise ApiError(400, f"cannot render the messages: {e}", param="messages") from None
        req = GenRequest(prompt_ids, kwargs, stream, include_usage, chat=True)
        return await respond(req, "chat.completion", "chatcmpl-")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request, _COMPLETION_PARAMS)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "'prompt' is empty", param="prompt")
            prompt_ids = [int(t) for t in engine.tokenizer(prompt, add_special_tokens=True)["input_ids"]]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids (one prompt per "
                           "request)", param="prompt")
        kwargs, stream, include_usage = _generation_kwargs(body, chat=False)
        req = GenRequest(prompt_ids, kwargs, stream, include_usage, chat=False)
        return await respond(req, "text_completion", "cmpl-")

    def usage(outcome: Outcome) -> dict:
        return {"prompt_tokens": outcome.num_prompt_tokens, "completion_tokens": outcome.num_completion_tokens,
                "total_tokens": outcome.num_prompt_tokens + outcome.num_completion_tokens}

    async def respond(req: GenRequest, obj: str, id_prefix: str):
        job = engine.submit(req)
        rid = id_prefix + secrets.token_hex(12)
        created = int(time.time())
        first = await _next(job)  # errors before any output (open: unreachable, limits, bad prompt) → status
        if first[0] == "error":
            raise api_error_for(first[1])
        chat = obj == "chat.completion"
        if not req.stream:
            parts = []
            item = first
            while item[0] == "chunk":
                parts.append(item[1])
                item = await _next(job)
            if item[0] == "error":
                raise api_error_for(item[1])
            outcome: Outcome = item[1]
            choice = {"index": 0, "finish_reason": outcome.finish_reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": outcome.text}
            else:
                choice["text"] = outcome.text
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": engine.model_id,
                                 "choices": [choice], "usage": usage(outcome), "specdec": outcome.specdec})

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list, **extra) -> str:
            payload = {"id": rid, "object": chunk_obj, "created": created, "model": engine.model_id,
                       "choices": choices, **extra}
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        def delta(text: str | None, finish: str | None = None, role: bool = False) -> dict:
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
                return {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

        async def events():
            item = first
            try:
                if chat:
                    yield event([delta(None, role=True)])
                while item[0] == "chunk":
                    yield event([delta(item[1])])
                    item = await _next(job)
                if item[0] == "error":
                    err = api_error_for(item[1])
                    yield f"data: {json.dumps(err.body())}\n\n"
                    return
                outcome: Outcome = item[1]
                yield event([delta(None if chat else "", outcome.finish_reason)], specdec=outcome.specdec)
                if req.include_usage:
                    yield event([], usage=usage(outcome))
                yield "data: [DONE]\n\n"
            finally:
                job.cancelled.set()  # a client gone mid-stream: the worker stops at the next chunk

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


async def _next(job: _Job):
    return await job.queue.get()


def key_checker(api_key: str | None = None, api_keys_file: str | None = None) -> Callable[[str | None], bool] | None:
    """The Bearer-token check of the endpoint: ``api_key`` (compared in constant time) and/or the key hashes of
    ``api_keys_file`` (issue 8's ``specdec keys create`` file, :class:`cloud_verifier.auth.ApiKeyStore`);
    None when neither is given (no authentication)."""
    store = None
    if api_keys_file:
        from cloud_verifier.auth import ApiKeyStore

        store = ApiKeyStore(api_keys_file)
    if not api_key and store is None:
        return None

    def check(token: str | None) -> bool:
        if not token:
            return False
        if api_key and hmac.compare_digest(token.encode(), api_key.encode()):
            return True
        return store is not None and store.tenant_for(token) is not None

    return check


def serve(engine: Engine, host: str, port: int, api_keys=None, on_started: Callable[[], None] | None = None) -> None:
    """Run the endpoint with uvicorn until interrupted (SIGINT/SIGTERM); closes ``engine`` at the end."""
    import uvicorn

    app = create_app(engine, api_keys)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    if on_started is not None:
        original = server.startup

        async def startup(*args, **kwargs):
            await original(*args, **kwargs)
            if server.started:
                on_started()

        server.startup = startup
    try:
        server.run()
    finally:
        engine.close()
