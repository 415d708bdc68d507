"""An OpenAI-compatible HTTP endpoint on the device (``specdec edge-serve``): apps that speak the OpenAI API
(the ``openai`` client, LangChain, chat UIs) call it as if it were OpenAI; it answers with speculative decoding
(the local draft + the cloud verifier, or an embedded verifier).

Built on FastAPI (Starlette) + uvicorn; streaming with server-sent events, as OpenAI's API does
(``data: {chunk}`` lines, ``data: [DONE]`` last). Follows OpenAI's API reference for
``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/completions``:

- parameters: ``model``, ``messages`` / ``prompt``, ``max_tokens`` / ``max_completion_tokens``, ``temperature``,
  ``top_p``, ``seed``, ``stop`` (string or list), ``stream``, ``stream_options.include_usage``; ``top_k`` and
  ``ignore_eos`` as extensions (as vLLM's server has them); ``n``, ``logprobs`` / ``top_logprobs`` (streamed
  with each chunk's tokens), penalties, ``logit_bias`` and the extensions of docs/openai.md. Every parameter
  that would change the output but is not supported is refused with HTTP 400 and a message naming it: never
  silently ignored.
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

Modules: :mod:`.app` (routes, authentication, :func:`serve`), :mod:`.request` (request bodies → prompt ids and
generation arguments), :mod:`.engine` (the worker thread, kept conversations), :mod:`.streaming` (JSON and SSE
responses), :mod:`.errors` (OpenAI's error JSON, HTTP status per exception).
"""

from __future__ import annotations

from .app import create_app, key_checker, serve
from .engine import DEFAULT_MAX_CONVERSATIONS, Engine, Outcome
from .errors import ApiError, api_error_for
from .request import DEFAULT_MAX_TOKENS, GenRequest, parse_messages, render_chat_ids

__all__ = [
    "DEFAULT_MAX_CONVERSATIONS",
    "DEFAULT_MAX_TOKENS",
    "ApiError",
    "Engine",
    "GenRequest",
    "Outcome",
    "api_error_for",
    "create_app",
    "key_checker",
    "parse_messages",
    "render_chat_ids",
    "serve",
]
