"""The edge client SDK: drafts on the device, sends draft blocks to a verifier, streams committed text.

    from edge_client.client import EdgeClient
    client = EdgeClient.connect("verifier.example:50051", draft_dir)      # or EdgeClient(backend, drafter, tok)
    for delta in client.stream("Why is the sky blue?", max_new_tokens=128):
        print(delta, end="", flush=True)
    print(client.last_result.stats.mean_accepted_length)

The loop (docs/architecture.md "The main loop", :meth:`EdgeClient._generate`): open a session (prompt ids,
sampling, limits, tokenizer fingerprint); then repeat: draft num_speculative_tokens (γ) tokens from the committed
prefix, send the block, commit the verdict's tokens (accepted prefix + recovered/bonus token), stream the new
text. The verifier applies the stopping rule, so the edge only ever streams committed tokens, cut at the
earliest stop. The speculation policy (γ per step, drafting ahead while a block is in flight) is
:mod:`edge_client.policy`; the drafters and their contract are :mod:`edge_client.drafter`; the counters of a
generation are :mod:`edge_client.stats`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from common.detok import IncrementalDetokenizer
from common.errors import DeadlineError, InvalidRequestError
from common.stopping import generated_text_for_output
from common.types import DraftBlock, FinishReason, SamplingParams, SessionOpened, StoppingCriteria, Verdict
from common.vocab import tokenizer_fingerprint
from edge_client.backend import VerifierBackend
from edge_client.policy import AdaptiveNumSpeculativeTokens, ProactiveBet
from edge_client.stats import GenerationStats

if TYPE_CHECKING:  # the protocol only; edge_client.drafter loads the ONNX draft runner
    from edge_client.drafter import Drafter


@dataclass
class GenerationResult:
    """Outcome of one generation (the fields of `specdec generate --json`)."""

    text: str
    token_ids: list[int]  # generated tokens only
    finish_reason: FinishReason | None
    stats: GenerationStats
    session_id: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    bytes_sent: int = 0  # wire bytes edge -> verifier (gRPC backend only)
    bytes_received: int = 0

    def to_json(self) -> dict:
        s = self.stats
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason.value if self.finish_reason else None,
            "num_generated_tokens": s.num_generated_tokens,
            "num_drafts": s.num_drafts,
            "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "acceptance_rate": s.acceptance_rate if s.num_draft_tokens else None,  # null: nothing was drafted
            "mean_accepted_length": s.mean_accepted_length,
            "elapsed_s": s.elapsed_s,
        }


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Prompt token ids: through the tokenizer's chat template (one user turn) when it has one and ``chat``.

    Raises:
        InvalidRequestError: empty prompt.
    """
    if not prompt or not prompt.strip():
        raise InvalidRequestError("empty prompt")
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(prompt, add_special_tokens=True)["input_ids"]]


class EdgeClient:
    """Speculative decoding client: a drafter on the device, a verifier behind ``backend``.

    Args:
        backend: how to reach the verifier (GrpcBackend, LocalBackend, DelayedBackend).
        drafter: proposes draft blocks (ModelDrafter, NgramDrafter); None = target-only decoding (empty blocks:
            one target token per step, the cloud-only baseline).
        tokenizer: the draft's tokenizer (must match the target's: checked by fingerprint at session open).
        num_speculative_tokens: γ, draft tokens per block, >= 1 (the largest γ when ``adaptive``). A session
            uses max_num_speculative_tokens = min(this, the verifier's ``max_num_speculative_tokens``), and
            shorter blocks near the end (max_new_tokens, context limit).
        adaptive: choose γ per step from measured acceptance, draft cost, verify time and round trip
            (:class:`edge_client.policy.AdaptiveNumSpeculativeTokens`).
        min_confidence: confidence truncation: stop a block early when the draft's top probability falls below
            it (llama.cpp's draft-p-min; done by the drafter, :meth:`edge_client.drafter.Drafter.propose`);
            0 disables.
        proactive: while a block is in flight, draft the next one assuming full acceptance and the bonus token
            the draft predicts; used at once when the verdict matches, dropped otherwise
            (:class:`edge_client.policy.ProactiveBet`).
        timeout_s: deadline of each verify step, s.
        open_timeout_s: deadline of opening a session (includes the prefill of a long prompt), s.

    Seeded sampling is reproducible for a fixed speculation schedule: a sampled session with a seed runs with
    adaptive γ and proactive drafting off (both depend on timing, and the tokens of speculative sampling depend
    on where blocks end). Greedy output never depends on them.

    Raises:
        InvalidRequestError: num_speculative_tokens < 1, or min_confidence outside [0, 1).
    """

    def __init__(
        self,
        backend: VerifierBackend,
        drafter: Drafter | None,
        tokenizer,
        *,
        num_speculative_tokens: int = 4,
        adaptive: bool = False,
        min_confidence: float = 0.0,
        proactive: bool = False,
        timeout_s: float = 60.0,
        open_timeout_s: float = 600.0,
    ):
        if num_speculative_tokens < 1:
            raise InvalidRequestError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not 0.0 <= min_confidence < 1.0:
            raise InvalidRequestError(f"min_confidence must be in [0, 1), got {min_confidence}")
        self.backend = backend
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.num_speculative_tokens = num_speculative_tokens
        self.adaptive = adaptive
        self.min_confidence = min_confidence
        self.proactive = proactive
        self.timeout_s = timeout_s
        self.open_timeout_s = open_timeout_s
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.last_result: GenerationResult | None = None

    @classmethod
    def connect(
        cls, address: str, draft_dir: str | Path | None = None, *, draft_top_k: int = 8, connect_timeout_s: float = 10.0,
        **kwargs,
    ) -> "EdgeClient":
        """Client for a verifier at ``address`` ("host:port") with the ONNX draft at ``draft_dir`` (default draft).

        Raises:
            ModelNotFoundError: no draft at ``draft_dir``. VerifierUnavailableError: the verifier is unreachable.
        """
        from common.paths import default_model_paths, resolve_draft_dir
        from edge_client.drafter import ModelDrafter
        from edge_client.grpc_backend import GrpcBackend
        from edge_client.onnx_draft import OnnxDraftModel

        model = OnnxDraftModel(resolve_draft_dir(draft_dir or default_model_paths().draft_dir))
        backend = GrpcBackend(address, connect_timeout_s=connect_timeout_s)
        return cls(backend, ModelDrafter(model, draft_top_k=draft_top_k), model.tokenizer, **kwargs)

    # ------------------------------------------------------------------ generation
    def stream(
        self,
        prompt: str | list[int],
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: list[str] | tuple[str, ...] = (),
        stop_token_ids: list[int] | tuple[int, ...] = (),
        ignore_eos: bool = False,
        chat: bool = True,
    ) -> Iterator[str]:
        """Generate; yield text deltas as tokens are committed. The result is in ``self.last_result`` after.

        Raises:
            InvalidRequestError, PreconditionError, CapacityError, SessionNotFoundError,
            VerifierUnavailableError, DeadlineError (common.errors).
        """
        sampling = SamplingParams(temperature, top_k, top_p, seed)
        stopping = StoppingCriteria(max_new_tokens, tuple(stop_token_ids), tuple(stop), ignore_eos)
        try:
            sampling.validate()
            stopping.validate()
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        prompt_ids = encode_prompt(self.tokenizer, prompt, chat) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise InvalidRequestError("empty prompt")
        yield from self._generate(prompt_ids, sampling, stopping)

    def generate(self, prompt: str | list[int], **kwargs) -> GenerationResult:
        """Generate to the end; return text, token ids, finish reason and stats."""
        for _ in self.stream(prompt, **kwargs):
            pass
        assert self.last_result is not None
        return self.last_result

    def _draft(self, committed: list[int], num_speculative_tokens: int, sampling: SamplingParams,
               should_stop: Callable[[], bool] | None = None) -> DraftBlock:
        """A block of at most ``num_speculative_tokens`` after ``committed`` (empty without a drafter)."""
        if self.drafter is None or num_speculative_tokens <= 0:
            return DraftBlock([])
        kwargs = {"should_stop": should_stop} if should_stop is not None else {}
        return self.drafter.propose(committed, num_speculative_tokens, sampling, sampling.seed,
                                    min_confidence=self.min_confidence, **kwargs)

    def _next_block(self, committed: list[int], num_speculative_tokens: int, sampling: SamplingParams,
                    bet: ProactiveBet | None) -> tuple[DraftBlock, bool, float]:
        """The block to send: the one drafted ahead when the bet won, else a fresh draft.

        Returns:
            (block, proactive hit, edge time spent drafting it now in s: 0 for a hit).
        """
        block = bet.take(committed, num_speculative_tokens) if bet is not None else None
        if block is not None:
            return block, True, 0.0
        t0 = time.perf_counter()
        block = self._draft(committed, num_speculative_tokens, sampling)
        return block, False, time.perf_counter() - t0

    def _send(self, session_id: str, seq: int, committed: list[int], block: DraftBlock) -> tuple[Future, tuple]:
        """Submit ``block``; return its future and its send record (send time, arrival time filled by a callback
        registered right after sending) for :meth:`_wait`."""
        t_sent = time.perf_counter()
        future = self.backend.submit(session_id, seq, len(committed), block)
        done_at: list[float] = []
        future.add_done_callback(lambda _f: done_at.append(time.perf_counter()))
        return future, (t_sent, done_at)

    def _wait(self, future: Future, sent: tuple) -> tuple[Verdict, float]:
        """The verdict and its round trip, ms (sent → answer available, not → when we looked).

        Raises:
            DeadlineError: no verdict within ``timeout_s``; any SpecdecError the backend set on the future.
        """
        t_sent, done_at = sent
        try:
            verdict = future.result(timeout=self.timeout_s)
        except FutureTimeoutError:
            raise DeadlineError(f"verify step took longer than {self.timeout_s} s") from None
        return verdict, ((done_at[0] if done_at else time.perf_counter()) - t_sent) * 1000

    def _policy(self, sampling: SamplingParams, requested_seed: int | None, max_num_speculative_tokens: int
                ) -> tuple[AdaptiveNumSpeculativeTokens | None, ProactiveBet | None]:
        """The session's adaptive controller and proactive bet (None when off). A seeded sampled session turns
        both off: it keeps a timing-independent schedule (see the class docstring)."""
        timing_free = not sampling.greedy and requested_seed is not None
        adaptive = None
        if self.adaptive and not timing_free:
            adaptive = AdaptiveNumSpeculativeTokens(max_num_speculative_tokens)
        bet = None
        if self.proactive and self.drafter is not None and not timing_free:
            bet = ProactiveBet(lambda ids, n, should_stop: self._draft(ids, n, sampling, should_stop))
        return adaptive, bet

    def _generate(self, prompt_ids: list[int], sampling: SamplingParams, stopping: StoppingCriteria) -> Iterator[str]:
        """One session: the loop of the module docstring; sets ``self.last_result`` when it ends."""
        t0 = time.perf_counter()
        opened: SessionOpened = self.backend.open_session(
            prompt_ids, sampling, stopping, self.fingerprint, timeout_s=self.open_timeout_s
        )
        requested_seed, sampling = sampling.seed, dataclasses.replace(sampling, seed=opened.seed)
        committed, stats = list(prompt_ids), GenerationStats()
        detok = IncrementalDetokenizer(self.tokenizer, stopping.stop_strings)
        capacity = min(opened.max_context_tokens, len(prompt_ids) + stopping.max_new_tokens)
        max_num_speculative_tokens = min(self.num_speculative_tokens, opened.max_num_speculative_tokens)
        adaptive, bet = self._policy(sampling, requested_seed, max_num_speculative_tokens)
        finish_reason = None
        try:
            for seq in itertools.count(1):
                room = capacity - len(committed) - 1  # the verdict always adds one token of its own
                wanted = adaptive.next_num_speculative_tokens() if adaptive else max_num_speculative_tokens
                block, hit, draft_s = self._next_block(committed, max(0, min(wanted, room)), sampling, bet)
                future, sent = self._send(opened.session_id, seq, committed, block)
                if bet is not None and len(block) and not future.done():
                    # bet on full acceptance: draft the bonus guess + the next block while the verdict travels
                    draft_s += bet.place(committed, block, max_num_speculative_tokens, capacity, future.done)
                verdict, round_trip_ms = self._wait(future, sent)
                committed.extend(verdict.committed_token_ids)
                if adaptive is not None:
                    # a proactive hit was drafted while an earlier block travelled: its time is hidden, not a cost;
                    # the first block's time includes the draft's prefill of the whole prompt, not a per-token cost
                    # (counting it made γ collapse for long prompts: the estimate decays over ~20 steps)
                    hidden = hit or stats.num_drafts == 0
                    adaptive.observe(len(block), verdict.num_accepted, None if hidden else block.draft_ms,
                                     round_trip_ms, verdict.forward_ms)
                stats.observe(len(block), verdict, draft_s=draft_s, proactive_hit=hit)
                delta = detok.push(verdict.committed_token_ids)
                if delta:
                    yield delta
                if verdict.finished:
                    finish_reason = verdict.finish_reason
                    break
            tail = detok.finish(finish_reason)
            if tail:
                yield tail
        finally:
            try:
                self.backend.close_session(opened.session_id)
            except Exception:
                pass
        self.last_result = self._result(opened, prompt_ids, committed, finish_reason, stopping, stats, t0)

    def _result(self, opened: SessionOpened, prompt_ids: list[int], committed: list[int],
                finish_reason: FinishReason | None, stopping: StoppingCriteria,
                stats: GenerationStats, t0: float) -> GenerationResult:
        """The GenerationResult of a finished session (text cut at the earliest stop, wire bytes if counted);
        sets the counters known only at the end (``t0``: ``time.perf_counter()`` when the generation began)."""
        generated = committed[len(prompt_ids):]
        wire = getattr(self.backend, "wire_stats", None)
        wire = wire(opened.session_id) if wire else None
        stats.num_generated_tokens = len(generated)
        stats.elapsed_s = time.perf_counter() - t0
        return GenerationResult(
            text=generated_text_for_output(self.tokenizer, generated, finish_reason, stopping.stop_strings),
            token_ids=generated,
            finish_reason=finish_reason,
            stats=stats,
            session_id=opened.session_id,
            prompt_token_ids=list(prompt_ids),
            bytes_sent=wire.bytes_sent if wire else 0,
            bytes_received=wire.bytes_received if wire else 0,
        )

    def close(self) -> None:
        self.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
