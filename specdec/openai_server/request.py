"""Request conversion: an OpenAI request body checked (parameters supported or neutral, the model served) and
turned into prompt token ids and the generation's keyword arguments."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from specdec_runtime.common.types import MAX_NEW_TOKENS, StoppingCriteria

from .errors import ApiError

# max_tokens when a request gives none: the generation default of the SDK and the CLI (OpenAI: up to the
# context; a device endpoint keeps it bounded)
DEFAULT_MAX_TOKENS = StoppingCriteria.max_new_tokens

# accepted and without effect on the output
_HARMLESS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options",
             "prompt_cache_key", "safety_identifier"}
# supported (the endpoint's own parameters; min_tokens, repetition_penalty, min_p, top_k and ignore_eos are
# extensions with vLLM's names)
_PROCESSING = {"presence_penalty", "frequency_penalty", "logit_bias", "min_tokens", "repetition_penalty", "min_p"}
CHAT_PARAMS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
                "stream", "top_k", "n", "ignore_eos", "logprobs", "top_logprobs", *_PROCESSING,
                "response_format", "tools", "tool_choice"}  # structured output: .structured, .tools
COMPLETION_PARAMS = {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "top_k",
                      "n", "ignore_eos", "logprobs", *_PROCESSING}
MAX_N = 8  # choices per request (generated one after the other)
# would change the output and are not supported: refused unless given their neutral value
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
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



@dataclass
class GenRequest:
    """A validated request: prompt token ids and the generation's keyword arguments.

    n: independent generations (choices), choice i seeded ``seed + i`` when the request is seeded.
    logprobs: the response reports logprobs (chat: ``logprobs=true``; completions: ``logprobs=N``), with
    ``kwargs["top_logprobs"]`` alternatives per token.
    """

    prompt_ids: list[int]
    kwargs: dict
    stream: bool
    include_usage: bool
    chat: bool
    n: int = 1
    logprobs: bool = False
    tools: object | None = None  # the checked tools request (.tools.ToolRequest), chat only

    def choice_kwargs(self, index: int) -> dict:
        """The generation options of choice ``index`` (its own seed: ``seed + index`` when seeded)."""
        seed = self.kwargs.get("seed")
        if seed is None or index == 0:
            return self.kwargs
        return {**self.kwargs, "seed": (seed + index) & ((1 << 63) - 1)}


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
    if not math.isfinite(value):  # Python's json reads NaN and Infinity; NaN passes every range comparison
        raise ApiError(400, f"'{name}' must be a finite number, got {value!r}", param=name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ApiError(400, f"'{name}' must be in [{lo}, {hi if hi is not None else 'inf'}], got {value!r}",
                       param=name)
    return kind(value)


def _processing_kwargs(body: dict, chat: bool, vocab_size: int) -> tuple[dict, bool]:
    """The logits-processing options of ``body`` (only those set) and whether logprobs are reported
    (``vocab_size``: logit_bias token ids must be below it)."""
    from specdec_runtime.common.types import MAX_TOP_LOGPROBS

    kw: dict = {}
    for name, lo, hi, default, kind in (("presence_penalty", -2.0, 2.0, 0.0, float),
                                        ("frequency_penalty", -2.0, 2.0, 0.0, float),
                                        ("min_p", 0.0, 1.0, 0.0, float), ("min_tokens", 0, None, 0, int)):
        value = _number(body, name, default, kind, lo, hi)
        if value != default:
            kw[name] = value
    rep = _number(body, "repetition_penalty", 1.0, float, 0.0)
    if rep <= 0.0:
        raise ApiError(400, f"'repetition_penalty' must be > 0, got {rep!r}", param="repetition_penalty")
    if rep != 1.0:
        kw["repetition_penalty"] = rep
    bias = body.get("logit_bias")
    if bias:
        kw["logit_bias"] = _logit_bias(bias, vocab_size)
    if chat:
        logprobs = body.get("logprobs") or False
        if not isinstance(logprobs, bool):
            raise ApiError(400, "'logprobs' must be a boolean", param="logprobs")
        top = _number(body, "top_logprobs", 0, int, 0, MAX_TOP_LOGPROBS)
        if top and not logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    else:  # the legacy completions API: logprobs = N alternatives (0..5)
        top = _number(body, "logprobs", None, int, 0, 5)
        logprobs = top is not None
        top = top or 0
    if logprobs:
        kw["logprobs"], kw["top_logprobs"] = True, top
    return kw, logprobs


def _logit_bias(bias, vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias (token id strings -> bias in [-100, 100]) as {id: bias}; ids in [0, vocab_size)."""
    if not isinstance(bias, dict):
        raise ApiError(400, "'logit_bias' must be an object of token id -> bias", param="logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ApiError(400, f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100 or token < 0:
            raise ApiError(400, f"'logit_bias' of token {key} must be a number in [-100, 100], got {value!r}",
                           param="logit_bias")
        if token >= vocab_size:
            raise ApiError(400, f"'logit_bias' token id must be in [0, {vocab_size}), got {token}",
                           param="logit_bias")
        out[token] = float(value)
    return out


def _generation_kwargs(body: dict, chat: bool) -> tuple[dict, bool, bool]:
    max_tokens = body.get("max_completion_tokens") if chat else None
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = body.get("max_tokens"), "max_tokens"

    max_tokens = _number({name: max_tokens}, name, DEFAULT_MAX_TOKENS, int, 1, MAX_NEW_TOKENS)
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
    )  # top_p 0: the most likely token only (common.types.SamplingParams), as OpenAI clients mean it
    return kwargs, stream, bool(options.get("include_usage"))


def _request(body: dict, prompt_ids: list[int], chat: bool, vocab_size: int) -> GenRequest:
    kwargs, stream, include_usage = _generation_kwargs(body, chat)
    processing, logprobs = _processing_kwargs(body, chat, vocab_size)
    if processing.get("min_tokens", 0) > kwargs["max_new_tokens"]:
        raise ApiError(400, f"'min_tokens' must be <= the max tokens ({kwargs['max_new_tokens']}), got "
                       f"{processing['min_tokens']}", param="min_tokens")
    n = _number(body, "n", 1, int, 1, MAX_N)
    return GenRequest(prompt_ids, {**kwargs, **processing}, stream, include_usage, chat=chat, n=n,
                      logprobs=logprobs)


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
    from specdec_runtime.common.chat import render_chat_ids as render

    return [int(t) for t in render(tokenizer, messages, add_generation_prompt=True)]


def _has_lone_surrogate(value: Any) -> bool:
    """Whether a string anywhere in the JSON value ``value`` (keys included) holds a lone UTF-16 surrogate."""
    todo = [value]
    while todo:  # a loop, not recursion: bodies may nest deeply
        v = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return False


def _check_text(body: dict) -> None:
    """JSON may escape a lone surrogate ("\\ud800"), which is no Unicode text: no tokenizer encodes it."""
    why = "a lone UTF-16 surrogate (an escape such as \\ud800 without its pair): it is not valid Unicode text"
    for name, value in body.items():
        if _has_lone_surrogate(name):  # never echoed: the error JSON could not encode it either
            raise ApiError(400, f"a parameter name holds {why}")
        if _has_lone_surrogate(value):
            raise ApiError(400, f"'{name}' holds {why}", param=name)


def check_content_type(header: str | None) -> None:
    """A request body must be declared JSON, as OpenAI's API requires: ``application/json`` with or without
    parameters (``; charset=utf-8``). A request without the header is read as JSON (curl -d sends its own form
    type, but simple clients send none; the official clients send application/json).

    Raises:
        ApiError(400): another media type (e.g. text/plain, application/x-www-form-urlencoded).
    """
    if header is None:
        return
    media_type = header.split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(400, f"Content-Type {header.strip()[:100]!r} is not supported: send the body as "
                       "application/json")


def check_body(body: Any, supported: set[str], model_id: str) -> dict:
    """``body`` when it is a JSON object of supported (or neutral) parameters naming the served model.

    Raises:
        ApiError: 400 (not an object, a parameter refused, no model, a string that is not valid Unicode: a lone
            surrogate, param the top-level field holding it), 404 (another model).
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_text(body)
    _check_params(body, supported)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required", param="model")
    if model != model_id:
        raise ApiError(404, f"the model '{model}' does not exist; this endpoint serves '{model_id}'",
                       param="model", code="model_not_found")
    return body


def chat_request(body: dict, tokenizer) -> GenRequest:
    """The generation of a ``/v1/chat/completions`` body (checked by :func:`check_body`); response_format and
    tools (:func:`.structured.structured_request`): a grammar, and tool messages in the generic format."""
    from .structured import structured_request

    grammar, tools, raw_messages = structured_request(body, tokenizer)
    messages = parse_messages(raw_messages)
    _generation_kwargs(body, chat=True)  # parameter errors before template errors
    _processing_kwargs(body, chat=True, vocab_size=len(tokenizer))
    try:
        prompt_ids = render_chat_ids(tokenizer, messages)
    except (ValueError, TypeError) as e:  # the template refused the messages (e.g. roles out of order)
        raise ApiError(400, f"cannot render the messages: {e}", param="messages") from None
    req = _request(body, prompt_ids, chat=True, vocab_size=len(tokenizer))
    req.kwargs.update(grammar)
    req.tools = tools
    return req


def completion_request(body: dict, tokenizer) -> GenRequest:
    """The generation of a ``/v1/completions`` body (checked by :func:`check_body`): a prompt string (tokenized
    as is, no chat template) or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' is empty", param="prompt")
        prompt_ids = [int(t) for t in tokenizer(prompt, add_special_tokens=True)["input_ids"]]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
        prompt_ids = list(prompt)
    else:
        raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids (one prompt per "
                       "request)", param="prompt")
    return _request(body, prompt_ids, chat=False, vocab_size=len(tokenizer))
