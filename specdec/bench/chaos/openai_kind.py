"""The chaos bench's ``openai`` request kind: a greedy chat completion, streamed, sent with the official
``openai`` client to the stack's `specdec edge-serve` (:class:`specdec.bench.chaos.stack.EdgeServe`: the
OpenAI-compatible endpoint on the device, a FailoverBackend over every replica's WAN proxy).

The API answers text, not token ids: the outcome keeps the content and ``usage.completion_tokens``, and the check
compares them with the text and the length of the target-only reference (:mod:`specdec.bench.chaos.check`).
HTTP statuses are named by the gRPC code they stand for (docs/openai.md, errors): 429 RESOURCE_EXHAUSTED (retried
by the session as the others), 503 UNAVAILABLE.
"""

from __future__ import annotations

HTTP_TIMEOUT_S = 300.0  # one request: edge-serve runs one generation at a time, the others queue
_HTTP_CODES = {429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 502: "FAILED_PRECONDITION", 400: "INVALID_ARGUMENT"}


def http_error_code(exc: BaseException) -> str | None:
    """The code name of an ``openai`` client error with an HTTP status (``HTTP_<status>`` for others); None for
    any other exception."""
    status = getattr(exc, "status_code", None)
    if not isinstance(status, int) or not type(exc).__module__.startswith("openai"):
        return None
    return _HTTP_CODES.get(status, f"HTTP_{status}")


class EdgeServeClient:
    """One session's ``openai`` client of the edge-serve endpoint at ``base_url`` (``http://host:port/v1``)."""

    def __init__(self, base_url: str, model: str = "chaos"):
        import openai

        self.model = model
        self._client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)

    def run(self, request, outcome, on_tokens) -> None:
        """``request`` (:class:`~specdec.bench.chaos.workload.Request`) as a streamed greedy chat completion into
        ``outcome``: its text, ``completion_tokens`` and finish reason. ``on_tokens(n)``: one token per content
        delta as it arrives (a delta may hold several: the rest is counted at the end, from the usage).

        Raises:
            openai.APIError: an HTTP error, or an error event after streaming began.
        """
        options = request.options()
        stream = self._client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": request.text}], temperature=0,
            max_tokens=options["max_new_tokens"], stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": options["ignore_eos"]})
        parts, counted, finish, completion = [], 0, None, None
        for chunk in stream:
            if chunk.usage is not None:
                completion = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta is not None and choice.delta.content:
                    parts.append(choice.delta.content)
                    counted += 1
                    on_tokens(1)
                finish = choice.finish_reason or finish
        completion = counted if completion is None else completion
        if completion > counted:
            on_tokens(completion - counted)
        outcome.text, outcome.completion_tokens = "".join(parts), completion
        outcome.finish_reasons.append(finish)

    def close(self) -> None:
        self._client.close()
