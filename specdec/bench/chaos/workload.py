"""The chaos bench's client sessions: each one an edge device (its own draft model and FailoverBackend over every
replica's WAN proxy) generating requests of mixed kinds back to back until the run's end.

Request kinds (:data:`REQUEST_KINDS`): ``greedy``; ``sampled`` (temperature 0.8, top-p 0.95, a seed per prompt);
``json_schema`` (greedy under a JSON schema grammar); ``penalties`` (greedy with repetition, presence and
frequency penalties and a logit_bias); ``logprobs`` (greedy, each token's logprob and its top 3); ``multiturn``
(two greedy turns of one conversation: the second extends the verifier session, ExtendSession); ``cloud``
(greedy, route=cloud: the verifier decodes, the Decode stream); ``openai`` (a greedy chat completion, streamed,
through the official ``openai`` client to the stack's one `specdec edge-serve`: :mod:`specdec.bench.chaos.
openai_kind`). Which request a session sends next is a
function of (seed, session, request number) only (:func:`request_for`), so a run's requests can be replayed on
a fault-free verifier (:mod:`specdec.bench.chaos.check`).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

REQUEST_KINDS = ("greedy", "sampled", "json_schema", "penalties", "logprobs", "multiturn", "cloud", "openai")
GREEDY_KINDS = ("greedy", "json_schema", "penalties", "logprobs", "multiturn", "cloud", "openai")  # target-only
NUM_SPECULATIVE_TOKENS = 3
MAX_NEW_TOKENS = 32
TURN_TOKENS = 16  # per turn of a multiturn request
SUBJECTS = ("a robot", "the sea", "a red fox", "winter", "a lighthouse", "bread", "a violin", "the moon")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}
# The errors the docs promise under these faults, retried by the session as an application would (a 429):
# RESOURCE_EXHAUSTED when idle sessions admitted earlier hold every KV page for 1 s (docs/architecture.md, the
# KV pool) — a session paused by a WAN stall or a failover keeps its pages meanwhile.
RETRIED_ERRORS = ("RESOURCE_EXHAUSTED",)
MAX_REQUEST_TRIES = 10
LOGIT_BIAS = {198: 4.0, 30: -100.0}  # "\n" favoured, "." banned (ids of the SmolLM2 tokenizer)


@dataclass(frozen=True)
class Request:
    """One request: its kind and the index of its prompt in :data:`SUBJECTS`."""

    kind: str
    prompt: int

    @property
    def text(self) -> str:
        return f"Write two sentences about {SUBJECTS[self.prompt]}."

    def options(self) -> dict:
        """The generation options (:meth:`edge_client.client.EdgeClient.stream_chunks`) of this kind."""
        base = {"max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
        if self.kind == "sampled":
            return {**base, "temperature": 0.8, "top_p": 0.95, "seed": 1000 + self.prompt}
        if self.kind == "json_schema":
            from specdec_runtime.common.grammar import GrammarSpec

            return {"max_new_tokens": MAX_NEW_TOKENS, "grammar": GrammarSpec.json_schema(SCHEMA)}
        if self.kind == "penalties":
            return {**base, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                    "logit_bias": dict(LOGIT_BIAS)}
        if self.kind == "logprobs":
            return {**base, "logprobs": True, "top_logprobs": 3}
        if self.kind == "multiturn":
            return {"max_new_tokens": TURN_TOKENS, "ignore_eos": True}
        return base


def request_for(seed: int, session: int, number: int, kinds: tuple[str, ...] = REQUEST_KINDS) -> Request:
    """The ``number``-th request of session ``session`` (a function of these three and ``kinds`` only)."""
    rng = random.Random(f"chaos-request:{seed}:{session}:{number}")
    return Request(rng.choice(kinds), rng.randrange(len(SUBJECTS)))


@dataclass
class Outcome:
    """What one request gave: ``turns`` (token ids per turn; one turn but for multiturn), ``text`` (the text of
    the first turn), ``logprobs`` (the logprob of each token of the first turn, or None), ``finish_reasons``,
    ``error`` (the error's code name, or ""), timings in s since the run's start. An ``openai`` request has no
    token ids (the API answers text): its ``turns`` stay empty and ``completion_tokens`` counts its tokens."""

    session: int
    number: int
    request: Request
    t_start: float
    t_end: float = 0.0
    turns: list[list[int]] = field(default_factory=list)
    text: str | None = None
    completion_tokens: int = 0  # an openai request's usage.completion_tokens
    logprobs: list[float] | None = None
    finish_reasons: list[str | None] = field(default_factory=list)
    error: str = ""
    error_message: str = ""
    retried_errors: list[str] = field(default_factory=list)  # codes of the tries given up and sent again
    num_failovers: int = 0
    num_reopened_sessions: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.turns) + self.completion_tokens


def _drain(chunks, on_tokens) -> None:
    for chunk in chunks:
        if chunk.token_ids:
            on_tokens(len(chunk.token_ids))


def run_request(client, request: Request, outcome: Outcome, on_tokens=lambda n: None,
                route: str | None = None) -> None:
    """Run ``request`` on ``client`` into ``outcome`` (errors propagate; ``outcome`` keeps what finished).
    ``route``: None = the kind's (cloud for ``cloud``); a reference run passes "speculative"."""
    options = request.options()
    if request.kind == "multiturn":
        with client.chat(**options) as conv:
            for message in (request.text, "Now say it in other words."):
                _drain(conv.send(message, route=route), on_tokens)
                result = conv.last_result
                outcome.turns.append(list(result.token_ids))
                outcome.finish_reasons.append(result.finish_reason.value if result.finish_reason else None)
                outcome.num_failovers += result.num_failovers
                outcome.num_reopened_sessions += result.num_reopened_sessions
        return
    kind_route = "cloud" if request.kind == "cloud" else None
    _drain(client.stream_chunks(request.text, route=route or kind_route, **options), on_tokens)
    result = client.last_result
    outcome.turns.append(list(result.token_ids))
    outcome.text = result.text
    outcome.finish_reasons.append(result.finish_reason.value if result.finish_reason else None)
    outcome.num_failovers, outcome.num_reopened_sessions = result.num_failovers, result.num_reopened_sessions
    if result.logprobs is not None:
        outcome.logprobs = [lp.logprob for lp in result.logprobs]


def error_code(exc: BaseException) -> str:
    """The gRPC status code name of a specdec error (an HTTP status of edge-serve's: the code it stands for,
    docs/openai.md), else the exception's type name."""
    from specdec.bench.chaos.openai_kind import http_error_code

    if http_error_code(exc):
        return http_error_code(exc)
    code = getattr(exc, "code", None)
    return getattr(code, "name", None) or type(exc).__name__


@dataclass
class Progress:
    """Committed tokens as they reach the sessions: (s since the run's start, session, tokens) per chunk."""

    t0: float
    events: list[tuple[float, int, int]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, session: int, n: int) -> None:
        with self._lock:
            self.events.append((time.monotonic() - self.t0, session, n))


def _run_with_retries(client, request: Request, outcome: Outcome, on_tokens, http=None) -> None:
    """:func:`run_request`, sent again (from the start) after an error of :data:`RETRIED_ERRORS`, at most
    :data:`MAX_REQUEST_TRIES` tries; the last error stays in ``outcome.error``. ``http``: the session's
    :class:`~specdec.bench.chaos.openai_kind.EdgeServeClient` (for ``openai`` requests)."""
    for attempt in range(MAX_REQUEST_TRIES):
        outcome.turns, outcome.finish_reasons, outcome.logprobs = [], [], None
        outcome.text, outcome.completion_tokens = None, 0
        try:
            if request.kind == "openai":
                http.run(request, outcome, on_tokens)
            else:
                run_request(client, request, outcome, on_tokens)
            outcome.error = outcome.error_message = ""
            return
        except Exception as exc:  # noqa: BLE001 - every error is counted by the report
            outcome.error = error_code(exc)
            outcome.error_message = str(exc).splitlines()[0][:300] if str(exc) else ""
        if outcome.error not in RETRIED_ERRORS or attempt == MAX_REQUEST_TRIES - 1:
            return
        outcome.retried_errors.append(outcome.error)
        time.sleep(0.5 + 0.25 * attempt)


def session_worker(index: int, addresses: list[str], draft_dir, *, seed: int, end_s: float, progress: Progress,
                   outcomes: list[Outcome], kinds: tuple[str, ...] = REQUEST_KINDS,
                   edge_serve_url: str | None = None) -> None:
    """One edge device: requests back to back until ``end_s`` (s since ``progress.t0``); each outcome is
    appended to ``outcomes`` (errors recorded in it, never raised). ``edge_serve_url``: the stack's edge-serve
    endpoint (``.../v1``), for ``openai`` requests."""
    from specdec.bench.chaos.openai_kind import EdgeServeClient
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    model = OnnxDraftModel(draft_dir, intra_op_num_threads=1)  # one per device: not shared across threads
    order = addresses[index % len(addresses):] + addresses[:index % len(addresses)]  # spread the sessions
    # the budget covers a replica's restart and a Redis promotion; a hung attempt moves on after 15 s
    policy = RetryPolicy(max_attempts=200, budget_s=120.0, attempt_timeout_s=15.0, connect_timeout_s=3.0,
                         max_backoff_s=1.0)
    backend = FailoverBackend(order, policy=policy, seed=seed * 1000 + index)
    http = EdgeServeClient(edge_serve_url) if edge_serve_url else None
    number = 0
    with EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=NUM_SPECULATIVE_TOKENS,
                    timeout_s=300.0, open_timeout_s=300.0) as client:
        while time.monotonic() - progress.t0 < end_s:
            request = request_for(seed, index, number, kinds)
            outcome = Outcome(index, number, request, time.monotonic() - progress.t0)
            _run_with_retries(client, request, outcome, lambda n: progress.add(index, n), http)
            outcome.t_end = time.monotonic() - progress.t0
            outcomes.append(outcome)
            number += 1
    if http is not None:
        http.close()
