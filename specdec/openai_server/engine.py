"""The engine: generations of one EdgeClient run one at a time on a worker thread, their chunks passed to the event
loop, and conversations kept for reuse (LRU)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from specdec_runtime.common.errors import CapacityError
from specdec_runtime.common.types import FinishReason

from .request import GenRequest

log = logging.getLogger(__name__)

DEFAULT_MAX_CONVERSATIONS = 8  # kept conversations (LRU)


@dataclass
class Outcome:
    """What a generation produced, for the response body."""

    text: str
    num_completion_tokens: int
    finish_reason: str
    specdec: dict
    conversation_reused: bool = False
    num_prompt_tokens: int = 0
    index: int = 0  # the choice (n > 1: one generation per choice)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None  # common.types.TokenLogprobs per token, when asked
    # vLLM's per-request "metrics" object and the edge-cloud fields (.spec_metrics)
    metrics: dict = field(default_factory=dict)
    timing: tuple = (None, None)  # (time to first token s, decode tokens/s), for the request's log line
    draft: str | None = None  # the draft's name in the request's log line (:func:`draft_name`)


def _finish_reason(reason: FinishReason | None) -> str:
    return "length" if reason in (FinishReason.LENGTH, FinishReason.CONTEXT) else "stop"


def draft_name(client) -> str | None:
    """The name of ``client``'s draft: ``name@version`` of a draft the verifier delivered, else the directory
    name of the local draft model or head (``model_dir``), ``"ngram"`` for n-gram drafting; None without a
    draft (target-only decoding) or when the drafter names no directory."""
    name, version = getattr(client, "draft_version", None) or ("", "")
    if name:
        return f"{name}@{version}"
    drafter = getattr(client, "drafter", None)
    if drafter is None:
        return None
    model_dir = getattr(getattr(drafter, "model", None), "model_dir", None)
    if model_dir is not None:
        return Path(model_dir).name
    from specdec_runtime.edge_client.drafting.ngram import NgramDrafter

    return "ngram" if isinstance(drafter, NgramDrafter) else None


def _outcome(result, num_prompt_tokens: int, reused: bool, index: int = 0, client=None) -> Outcome:
    from .spec_metrics import edge_cloud, speculative_decoding

    s = result.stats
    estimates = getattr(client, "route_estimates", None)
    metrics = {"speculative_decoding": speculative_decoding(s, getattr(client, "num_speculative_tokens", 0)),
               "edge_cloud": edge_cloud(result, getattr(estimates, "rtt_ms", None),
                                        getattr(client, "draft_version", None) or ("", ""))}
    return Outcome(
        metrics=metrics,
        timing=(s.ttft_s, s.decode_tokens_per_s if s.num_decode_tokens else None),
        draft=draft_name(client),
        index=index,
        token_ids=list(result.token_ids),
        logprobs=result.logprobs,
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
class Job:
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

    def _run(self, job: Job, req: GenRequest) -> None:
        """Worker thread: the request's ``req.n`` generations one after the other, each its ("chunk", index,
        text, token_ids, logprobs) items and ("choice", Outcome); then ("done", None), ("error", exc) or, once
        ``job.cancelled`` is set (its client gone), ("cancelled", None) to ``job``.

        Kept conversations hold verifier sessions (and their KV cache): when the verifier refuses a session
        for capacity or a tenant's session limit (RESOURCE_EXHAUSTED) before anything was streamed, the kept
        conversations are closed and the request is tried once more; the second refusal is the answer (429)."""
        if job.cancelled.is_set():
            job.put(("cancelled", None))
            return
        # (a seeded sampled request starts from a fresh draft KV cache: edge_client.generation.loop resets the drafter)
        for attempt in (1, 2):
            emitted = [False]
            try:
                for index in range(req.n):
                    if job.cancelled.is_set():
                        break
                    self._generate(job, req, emitted, reuse=attempt == 1, index=index)
                job.put(("cancelled", None) if job.cancelled.is_set() else ("done", None))
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

    def _generate(self, job: Job, req: GenRequest, emitted: list[bool], reuse: bool, index: int = 0) -> None:
        """Choice ``index`` of ``req`` (the first of a chat may continue a kept conversation)."""
        conv, reused = None, False
        kwargs = req.choice_kwargs(index)
        try:
            if req.chat and index == 0 and self.max_conversations > 0 and hasattr(self.client, "chat"):
                conv = self._take_conversation(req.prompt_ids) if reuse else None
                reused = conv is not None
                if conv is None:
                    conv = self.client.chat()
                    chunks = conv.send_ids(req.prompt_ids, **kwargs)
                else:
                    chunks = conv.send_ids(req.prompt_ids[len(conv.history_ids):], **kwargs)
            else:
                chunks = self.client.stream_chunks(req.prompt_ids, **kwargs)
            complete = True
            try:
                for chunk in chunks:
                    if job.cancelled.is_set():
                        complete = False
                        break
                    if chunk.text:
                        emitted[0] = True
                        # with its tokens' logprobs (empty when not asked): streamed with the chunk, as OpenAI does
                        lps = list(getattr(chunk, "logprobs", ()))
                        job.put(("chunk", index, chunk.text, list(getattr(chunk, "token_ids", ()))[:len(lps)], lps))
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
        emitted[0] = True  # a finished choice is output (a retry would repeat it)
        job.put(("choice", _outcome(result, len(req.prompt_ids), reused, index, self.client)))

    def _close_conversations(self) -> None:
        while self._conversations:
            _close_quietly(self._conversations.popitem(last=False)[1])

    def submit(self, req: GenRequest) -> Job:
        """Queue ``req`` on the worker thread; its items arrive on the returned job's queue."""
        job = Job(asyncio.get_running_loop())
        self._worker.submit(self._run, job, req)
        return job

    def close(self) -> None:
        """Stop the worker (a generation in progress finishes), close the kept conversations and ``on_close``."""
        self._worker.shutdown(wait=True, cancel_futures=True)
        self._close_conversations()
        if self.on_close is not None:
            self.on_close()


async def next_item(job: Job):
    """The next item of ``job``: ("chunk", index, text, token_ids, logprobs) and ("choice", Outcome) per choice,
    then ("done", None), ("error", exception) or ("cancelled", None)."""
    return await job.queue.get()
