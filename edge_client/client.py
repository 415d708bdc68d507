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
generation are :mod:`edge_client.stats`; its state across sessions and its result are
:mod:`edge_client.generation`; the streamed chunks are :mod:`edge_client.output`; the prompt and the generation
options are :mod:`edge_client.request`; device fallback is :mod:`edge_client.fallback`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from common.errors import (ConflictError, DeadlineError, InvalidRequestError, PreconditionError, SessionNotFoundError,
                           VerifierUnavailableError)
from common.types import DEFAULT_DRAFT_TOP_K, DraftBlock, SamplingParams, SessionOpened, StoppingCriteria
from common.vocab import tokenizer_fingerprint
from edge_client.backend import SentBlock, VerifierBackend
from edge_client.generation import GenerationResult, Run, with_seed
from edge_client.output import Chunk, TextOutput
from edge_client.policy import AdaptiveNumSpeculativeTokens, ProactiveBet
from edge_client.routing import RouteEstimates, check_route, decode_device, run_session, start_route
from edge_client.request import check_generation_options, encode_prompt, generation_params

if TYPE_CHECKING:  # the protocol only; edge_client.drafter loads the ONNX draft runner
    from edge_client.conversation import Conversation, KeptSession
    from edge_client.drafter import Drafter

__all__ = ["EdgeClient", "GenerationResult", "Chunk", "encode_prompt"]

_Output = TextOutput  # the former name of the output splitter, still importable from here

log = logging.getLogger(__name__)

_MAX_SESSIONS = 64  # sessions one generation may open (re-opens after failures, returns from device fallback)


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
        bonus_drafted: whether sampled sessions send bonus_drafted blocks (``DraftBlock.bonus_drafted``; the
            rule and why it exists: :mod:`common.rejection`; cost: one more draft forward pass per block).
            None (default, "auto"): only where block ends depend on timing, i.e. a seeded sampled session with
            adaptive γ or proactive drafting on; other sessions use the classic bonus token. True: every
            sampled session. False: never; a seeded sampled session then turns adaptive γ and proactive
            drafting off. Greedy sessions always use the classic bonus token.
        timeout_s: deadline of each verify step, s (at least the backend's ``max_call_s``: its retries).
        open_timeout_s: deadline of opening a session (includes the prefill of a long prompt), s.
        fallback: "none" (an unreachable cloud ends the generation with VerifierUnavailableError) or "device":
            decode with the draft model alone meanwhile, unverified (:mod:`edge_client.fallback`), needs a draft
            model.
        reconnect_interval_s: during a device fallback, probe the cloud this often, s; once it answers, a new
            session (prompt: everything committed so far) goes on verified.
        route: "speculative" (default), "cloud", "device" or "auto" (edge_client.routing); a request's route= wins.

    Resilience (:mod:`edge_client.failover` does the retries of a call on other replicas): a session whose
    record vanished (NOT_FOUND: the store restarted empty, or it expired) is re-opened with everything
    committed as its prompt and the same seed, so the output does not change.

    What a seed guarantees: the same seed, the same draft and target models, the same sampling parameters and
    the same drafting settings (γ, adaptive, proactive, min_confidence, bonus_drafted) give the same tokens
    whatever the timing, the batching or the replica (docs/architecture.md, "What a seed guarantees"); with
    ``bonus_drafted=True`` they do not depend on the drafting settings either. Statistics count a block's
    ``num_speculative_tokens``: the acceptance rate is over those positions and τ is the tokens committed
    per verify step. Greedy output never depends on any of them.

    Raises:
        InvalidRequestError: num_speculative_tokens < 1, min_confidence outside [0, 1), an unknown fallback, or
            reconnect_interval_s <= 0.
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
        bonus_drafted: bool | None = None,
        timeout_s: float = 60.0,
        open_timeout_s: float = 600.0,
        fallback: str = "none",
        reconnect_interval_s: float = 5.0,
        route: str = "speculative",
    ):
        from edge_client.fallback import FALLBACK_MODES

        if fallback not in FALLBACK_MODES:
            raise InvalidRequestError(f"fallback must be one of {', '.join(FALLBACK_MODES)}, got {fallback!r}")
        if not reconnect_interval_s > 0:
            raise InvalidRequestError(f"reconnect_interval_s must be > 0, got {reconnect_interval_s}")
        self.fallback = fallback
        self.reconnect_interval_s = reconnect_interval_s
        self.route, self.route_estimates = check_route(route), RouteEstimates()  # estimates outlive a generation
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
        self.bonus_drafted = bonus_drafted
        self.timeout_s = timeout_s
        self.open_timeout_s = open_timeout_s
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.last_result: GenerationResult | None = None

    @classmethod
    def connect(
        cls, address: str | Sequence[str], draft_dir: str | Path | None = None, *,
        draft_top_k: int = DEFAULT_DRAFT_TOP_K, connect_timeout_s: float = 10.0, retry_policy=None,
        fallback: str = "none", tls: bool = False, root_certificates=None, api_key: str | None = None,
        certificate_chain=None, private_key=None, **kwargs,
    ) -> "EdgeClient":
        """Client for the verifiers at ``address`` with the ONNX draft at ``draft_dir`` (default draft).

        Args:
            address: "host:port", several ("host:port,host:port" or a list: tried in order, the first preferred)
                or one load balancer; calls that fail are retried on the next one
                (:class:`edge_client.failover.FailoverBackend`).
            connect_timeout_s: connecting to one address, s (when ``retry_policy`` is None).
            retry_policy: :class:`edge_client.failover.RetryPolicy` (default: its defaults).
            fallback: "none" or "device" (decode on the device alone while no verifier answers; then the
                client starts even when none answers now).
            tls: TLS channels (implied by ``root_certificates`` or a client certificate).
            root_certificates: PEM (bytes, text or file path) of the CA that signs the verifiers' certificates;
                None = the system's roots.
            api_key: sent as ``authorization: Bearer <key>`` on every call; None = ``$SPECDEC_API_KEY`` if set.
            certificate_chain, private_key: PEM client certificate and key (mutual TLS).
            **kwargs: :class:`EdgeClient` options.

        Raises:
            ModelNotFoundError: no draft at ``draft_dir``. VerifierUnavailableError: no verifier is reachable
            (with ``fallback="none"``). InvalidRequestError: a malformed address. ValueError: a certificate
            file unreadable or not PEM.
        """
        from common.paths import default_model_paths, resolve_draft_dir
        from edge_client.credentials import ChannelSecurity
        from edge_client.drafter import ModelDrafter
        from edge_client.failover import FailoverBackend, RetryPolicy
        from edge_client.onnx_draft import OnnxDraftModel

        model = OnnxDraftModel(resolve_draft_dir(draft_dir or default_model_paths().draft_dir))
        policy = retry_policy or RetryPolicy(connect_timeout_s=connect_timeout_s)

        security = ChannelSecurity.of(tls=tls, root_certificates=root_certificates, api_key=api_key,
                                      certificate_chain=certificate_chain, private_key=private_key)
        backend = FailoverBackend(address, policy=policy, connect=fallback == "none", security=security)
        return cls(backend, ModelDrafter(model, draft_top_k=draft_top_k), model.tokenizer, fallback=fallback,
                   **kwargs)

    # ------------------------------------------------------------------ generation
    def stream(self, prompt: str | list[int], **kwargs) -> Iterator[str]:
        """Generate; yield text deltas as tokens are committed. The result is in ``self.last_result`` after.
        Keyword arguments as :meth:`stream_chunks` (max_new_tokens, temperature, top_k, top_p, seed, stop,
        stop_token_ids, ignore_eos, chat). With device fallback, text of unverified tokens comes out too:
        :meth:`stream_chunks` flags it.

        Raises:
            InvalidRequestError, PreconditionError, CapacityError, SessionNotFoundError,
            VerifierUnavailableError, DeadlineError (common.errors).
        """
        for chunk in self.stream_chunks(prompt, **kwargs):
            yield chunk.text

    def stream_chunks(
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
        route: str | None = None,
        **processing,
    ) -> Iterator[Chunk]:
        """Generate; yield :class:`Chunk` (text, verified) as tokens are committed: ``verified`` is False for
        text decoded by the draft alone during a device fallback. Arguments and errors as :meth:`stream`;
        ``processing``: the other options of :func:`edge_client.request.generation_params` (repetition_penalty,
        presence_penalty, frequency_penalty, logit_bias, min_tokens, min_p, logprobs, top_logprobs; logprobs
        end up in ``self.last_result.logprobs``)."""
        check_generation_options(processing)
        sampling, stopping = generation_params(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, **processing)
        prompt_ids = encode_prompt(self.tokenizer, prompt, chat) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise InvalidRequestError("empty prompt")
        yield from self._generate(prompt_ids, sampling, stopping, route=route)

    def chat(self, system: str | None = None, **defaults) -> "Conversation":
        """A multi-turn conversation that keeps its verifier session and both KV caches between turns
        (:class:`edge_client.conversation.Conversation`: ``send(message)`` streams a reply). ``system``: system
        message; ``defaults``: generation options of every turn (as :meth:`stream_chunks`)."""
        from edge_client.conversation import Conversation

        return Conversation(self, system, **defaults)

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
        if block is not None:  # a hit (completed now if the verdict cut drafting ahead short)
            return block, True, bet.last_extend_s
        t0 = time.perf_counter()
        block = self._draft(committed, num_speculative_tokens, sampling)
        return block, False, time.perf_counter() - t0

    def _policy(self, sampling: SamplingParams, requested_seed: int | None, max_num_speculative_tokens: int
                ) -> tuple[AdaptiveNumSpeculativeTokens | None, ProactiveBet | None]:
        """The session's adaptive controller and proactive bet (None when off). With bonus_drafted blocks
        (:meth:`_bonus_drafted`) both stay on: the output does not depend on the schedule. Without them, a
        seeded sampled session turns both off: it keeps a timing-independent schedule (class docstring)."""
        bonus_drafted = self._bonus_drafted(sampling, requested_seed)
        timing_free = not sampling.greedy and requested_seed is not None and not bonus_drafted
        adaptive = None
        if self.adaptive and not timing_free:
            adaptive = AdaptiveNumSpeculativeTokens(max_num_speculative_tokens, bonus_drafted=bonus_drafted)
        bet = None
        if self.proactive and self.drafter is not None and not timing_free:
            bet = ProactiveBet(lambda ids, n, should_stop: self._draft(ids, n, sampling, should_stop))
        return adaptive, bet

    def _bonus_drafted(self, sampling: SamplingParams, requested_seed: int | None) -> bool:
        """Blocks of this session are bonus_drafted blocks: a sampled session with a drafter, when
        ``bonus_drafted`` is True, or when it is None (auto) and the user fixed the seed and the schedule
        depends on timing (adaptive γ or proactive drafting): elsewhere the classic bonus token is as
        reproducible and saves a draft forward pass per block."""
        if sampling.greedy or self.drafter is None or self.bonus_drafted is False:
            return False
        if self.bonus_drafted is None:
            return requested_seed is not None and (self.adaptive or self.proactive)
        return True

    def _generate(self, prompt_ids: list[int], sampling: SamplingParams, stopping: StoppingCriteria,
                  keep: KeptSession | None = None, route: str | None = None) -> Iterator[Chunk]:
        """One generation: the loop of the module docstring over one session — or over several after failures:
        a session whose record vanished (NOT_FOUND) is re-opened with everything committed as its prompt, and
        with ``fallback="device"`` an unreachable cloud is bridged by decoding on the device (unverified,
        :func:`edge_client.fallback.decode_on_device`) until a verifier answers again. Sets
        ``self.last_result`` when it ends.

        ``keep`` (a conversation's turn, :mod:`edge_client.conversation`): the first session extends
        ``keep.opened`` (ExtendSession with ``prompt_ids[keep.committed_length:]``) instead of opening one, and
        the last session is kept open in ``keep`` for the next turn instead of being closed."""
        t0 = time.perf_counter()
        from edge_client.fallback import decode_on_device

        failovers_before = getattr(self.backend, "num_failovers", 0)
        requested_seed = sampling.seed
        run = Run(list(prompt_ids), stopping, TextOutput(self.tokenizer, stopping.stop_strings),
                  committed=list(prompt_ids), route=start_route(self, route))
        if hasattr(self.drafter, "begin_turn"):  # the history-dependent processors count the output from here
            self.drafter.begin_turn(len(prompt_ids), stopping)
        if not sampling.greedy and requested_seed is not None and hasattr(self.drafter, "reset"):
            # a seeded sampled generation starts from a fresh draft KV cache: an int8 draft's logits depend on
            # how many tokens one forward pass feeds (a 53-token prompt fed whole vs 52 + 1: logits up to 1.1
            # apart), so KV reused from another generation would change q and the seeded draws. Within one
            # generation the draft feeds the prompt whole, then one token per forward, whatever the schedule.
            self.drafter.reset()
        yield from decode_device(self, run, sampling)  # route=device only: the draft alone, to the end
        while run.finish_reason is None:
            if len(run.session_ids) >= _MAX_SESSIONS:
                raise VerifierUnavailableError(f"gave up after {_MAX_SESSIONS} sessions for one generation")
            try:
                opened = self._open(run, sampling, keep)
            except (VerifierUnavailableError, DeadlineError) as e:
                sampling = with_seed(sampling)  # device decoding and the sessions after it draw with one seed
                yield from decode_on_device(self, run, sampling, e)
                continue
            if sampling.seed is None:  # the first session picks it; a re-opened one keeps it (same draws)
                sampling = dataclasses.replace(sampling, seed=opened.seed)
            try:
                yield from run_session(self, run, opened, sampling, requested_seed)
            except SessionNotFoundError as e:  # the record vanished (store restarted empty, expired): re-open
                log.info("session %s: %s; re-opening it from the %d committed tokens", opened.session_id, e,
                         len(run.committed))
                run.num_reopens += 1
                run.span_sessions(self.tokenizer)
                continue
            except (VerifierUnavailableError, DeadlineError) as e:  # no verifier within the retry budget
                yield from decode_on_device(self, run, sampling, e)
                continue
            except BaseException:
                self._close_session(opened.session_id)
                raise
            if keep is not None and run.session_committed == len(run.committed):  # both sides agree: keep it
                keep.opened, keep.committed_length, keep.last_seq = opened, len(run.committed), run.last_seq
            else:
                self._close_session(opened.session_id)
        yield from run.out.finish(run.finish_reason)
        self.last_result = run.result(self.tokenizer, getattr(self.backend, "wire_stats", None), t0,
                                      getattr(self.backend, "num_failovers", 0) - failovers_before)

    def _open(self, run: Run, sampling: SamplingParams, keep: KeptSession | None = None) -> SessionOpened:
        """Open a session whose prompt is everything committed so far (the prompt, at first) — or, for the first
        session of a conversation's turn, extend the kept one with the turn's new tokens. A kept session the
        verifier lost (NOT_FOUND), or cannot extend (ABORTED, FAILED_PRECONDITION), is replaced by a session
        over all committed ids with the same seed (same output), counted in ``run.num_reopens``."""
        rest = dataclasses.replace(run.stopping, max_new_tokens=run.stopping.max_new_tokens - run.num_generated)
        prev = keep.opened if keep is not None and not run.session_ids else None
        if prev is not None:
            keep.opened = None  # consumed: whatever happens now, a later turn does not reuse it
            try:
                opened = self.backend.extend_session(prev.session_id, keep.committed_length,
                                                     run.committed[keep.committed_length:], sampling, rest,
                                                     timeout_s=self.open_timeout_s)
            except (SessionNotFoundError, ConflictError, PreconditionError) as e:
                log.info("session %s cannot be extended (%s); re-opening it over the %d committed tokens",
                         prev.session_id, e, len(run.committed))
                if not isinstance(e, SessionNotFoundError):
                    self._close_session(prev.session_id)
                run.num_reopens += 1
                if sampling.seed is None:  # same draws as the lost session would have made
                    sampling = dataclasses.replace(sampling, seed=prev.seed)
            else:
                run.session_ids.append(opened.session_id)
                run.max_context_tokens = opened.max_context_tokens
                run.first_seq = keep.last_seq + 1
                return opened
        if run.num_generated:  # a re-open mid-turn: the verifier counts the output so far as generated
            # (penalties, min_tokens and the turn's max_new_tokens), as the lost session did
            opened = self.backend.open_session(run.committed, sampling, run.stopping, self.fingerprint,
                                               timeout_s=self.open_timeout_s, num_output_tokens=run.num_generated)
        else:
            opened = self.backend.open_session(run.committed, sampling, rest, self.fingerprint,
                                               timeout_s=self.open_timeout_s)
        run.session_ids.append(opened.session_id)
        run.max_context_tokens = opened.max_context_tokens
        run.first_seq = 1
        return opened

    def _verify_session(self, run: Run, opened: SessionOpened, sampling: SamplingParams,
                        requested_seed: int | None) -> Iterator[Chunk]:
        """Draft, verify, commit and stream in one session until the generation finishes (``run.finish_reason``
        set) or a call fails (raised)."""
        committed, stats = run.committed, run.stats
        capacity = min(opened.max_context_tokens, len(run.prompt_ids) + run.stopping.max_new_tokens)
        max_num_speculative_tokens = min(self.num_speculative_tokens, opened.max_num_speculative_tokens)
        adaptive, bet = self._policy(sampling, requested_seed, max_num_speculative_tokens)
        # bonus_drafted: γ speculative tokens + one for the bonus position (common.rejection)
        bonus_drafted = self._bonus_drafted(sampling, requested_seed)
        for seq in itertools.count(run.first_seq):
            room = capacity - len(committed) - 1  # the verdict always adds one token of its own
            wanted = adaptive.next_num_speculative_tokens() if adaptive else max_num_speculative_tokens
            block, hit, draft_s = self._next_block(committed, max(0, min(wanted, room)) + bonus_drafted, sampling, bet)
            block.bonus_drafted = bool(bonus_drafted and len(block))  # an empty block is plain decoding
            sent = SentBlock(self.backend, opened.session_id, seq, len(committed), block)
            if bet is not None and len(block) and not sent.future.done():
                # bet on full acceptance: draft the bonus guess (none after a bonus_drafted block) + the next
                # while the verdict travels
                draft_s += bet.place(committed, block, max_num_speculative_tokens, capacity, sent.future.done)
            verdict, round_trip_ms = sent.wait(self.timeout_s)
            tokens, reason = run.cut(verdict.committed_token_ids, verdict.finish_reason if verdict.finished else None)
            committed.extend(tokens)
            run.logprobs.extend((verdict.logprobs or [])[: len(tokens)])  # when asked for
            run.last_seq, run.session_committed = seq, verdict.committed_length
            spec = block.num_speculative_tokens
            spec_verdict = dataclasses.replace(verdict, num_accepted=min(verdict.num_accepted, spec))
            if adaptive is not None:
                # a proactive hit was drafted while an earlier block travelled: its time is hidden, not a cost;
                # the first block's time includes the draft's prefill of the whole prompt, not a per-token cost
                # (counting it made γ collapse for long prompts: the estimate decays over ~20 steps)
                hidden = hit or stats.num_drafts == 0
                adaptive.observe(spec, spec_verdict.num_accepted, None if hidden else block.draft_ms,
                                 round_trip_ms, verdict.forward_ms)
            stats.observe(spec, spec_verdict, draft_s=draft_s, proactive_hit=hit, num_forced=block.num_forced_tokens)
            yield from run.out.push(tokens, verified=True)
            if reason is not None or run.switch_check(verdict, round_trip_ms, block, draft_s):  # or a route switch
                run.finish_reason = reason  # (edge_client.routing) at this block boundary
                return

    def _close_session(self, session_id: str) -> None:
        try:
            self.backend.close_session(session_id)
        except Exception:  # noqa: BLE001 - best effort: an abandoned session expires by TTL
            pass

    def close(self) -> None:
        self.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
