"""Route per request: ``speculative | cloud | device | auto`` (docs/routing.md).

- ``speculative``: the draft proposes blocks, the verifier verifies them (the default; edge_client.generation.speculative).
- ``cloud``: the verifier generates the tokens itself and streams them (specdec.v1 ``Decode``,
  :mod:`edge_client.transport.cloud_decode`); the device does not draft.
- ``device``: the draft alone, unverified (as the device fallback: :class:`edge_client.generation.fallback.DeviceDecoder`);
  every chunk is flagged ``verified=False`` and counted in ``num_unverified_tokens``. No verifier is called.
- ``cloud-first``: cloud decode streams the first tokens while the draft prefills the context in a thread of its
  own (:mod:`edge_client.drafting.prefill`: the prompt, then what the cloud commits meanwhile, chunked); the moment
  the draft is ready the Decode call is stopped at a token boundary (StopDecode: the tokens committed until it
  lands still stream in) and the session goes on speculatively — unless few tokens are left.
  Time to first token is the cloud's, throughput speculation's.
- ``auto``: speculative or cloud, whichever the cost model (:mod:`edge_client.generation.route_cost`) expects to finish the
  tokens left sooner, start-up included (the draft's catch-up over the context it has not seen and a first block
  without overlap; a Decode call's first token), chosen at the start from what the client measured in earlier
  generations (the RTT from verdicts, the draft's cost per token and per token of catch-up on this device, the
  measured rate of speculative blocks and of cloud tokens) and the verifier's load hint in OpenSessionResponse —
  no probe, nothing paid per request — and re-chosen at block and chunk boundaries from running estimates
  (acceptance, verify time, RTT), a switch paying the new mode's start-up. Both routes are lossless and
  extend the same verifier session (the seq goes on, the committed length is the fence), so a switch neither
  loses nor repeats a token. When the draft has a prompt to prefill whose catch-up is expected to outlast a Decode
  call's first token, ``auto`` starts as ``cloud-first`` and the cost model decides the hand-over (the catch-up
  left included). ``auto`` never picks ``device`` (it is not the target's output).

The choice and each switch are reported in :attr:`GenerationResult.route <edge_client.generation.run.GenerationResult>`
(``--json``: ``"route"``).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Protocol, runtime_checkable

from specdec_runtime.common.errors import InvalidRequestError
from specdec_runtime.common.types import SamplingParams, SessionOpened
from specdec_runtime.edge_client.transport.cloud_decode import can_stop, cloud_verdicts
from specdec_runtime.edge_client.generation.context import GenerationContext
from specdec_runtime.edge_client.drafting.contract import UsesFeatures
from specdec_runtime.edge_client.drafting.prefill import DraftPrefill, can_prefill
from specdec_runtime.edge_client.generation.fallback import DeviceDecoder, decode_unverified, device_drafter
from specdec_runtime.edge_client.generation.observation import BlockObservation
from specdec_runtime.edge_client.generation.plan import SessionPlan
from specdec_runtime.edge_client.generation.run import with_seed
from specdec_runtime.edge_client.generation.route_cost import RouteEstimates, draft_unseen, route_reason
from specdec_runtime.edge_client.generation.speculative import verify_session

if TYPE_CHECKING:
    from specdec_runtime.edge_client.generation.run import Run
    from specdec_runtime.edge_client.output import Chunk

__all__ = ["ROUTES", "CostModelSwitcher", "RouteEstimates", "RouteRun", "RouteSwitcher", "check_route", "decode_device",
           "run_session", "start_route", "stop_prefill"]

ROUTES = ("speculative", "cloud", "device", "auto", "cloud-first")
MIN_BLOCKS_BEFORE_SWITCH = 3  # blocks (or cloud chunks) in a mode before auto may leave it: no flapping
SWITCH_MARGIN = 1.15  # auto switches when the other mode is expected to finish this much sooner
# no switch with fewer tokens left: the gain shrinks with the tokens left, the switch's cost (a round trip to
# start a Decode stream, or the draft catching up on a cloud chunk) and the estimates' noise do not
MIN_TOKENS_LEFT_TO_SWITCH = 16
# tokens per Decode call under auto: each chunk costs a round trip before its first token (the committed length
# must be known to start the next), so chunks are long and double (64, 128, ...); auto re-chooses between them
FIRST_CLOUD_CHUNK = 64
MAX_CLOUD_CHUNK = 1024
# cloud-first: each Decode call asks for about the tokens the cloud makes until the draft is expected ready (its
# prefill left / the cloud's step time), at least MIN_CLOUD_FIRST_CHUNK; CLOUD_FIRST_CHUNK before either is known
MIN_CLOUD_FIRST_CHUNK = 4
CLOUD_FIRST_CHUNK = 16
# cloud-first needs a catch-up of at least this many tokens (fewer: the first block feeds them at once)
MIN_UNSEEN_FOR_CLOUD_FIRST = 8


def check_route(route: str | None, default: str = "speculative") -> str:
    """``route`` (None: ``default``). Raises: InvalidRequestError: not one of :data:`ROUTES`."""
    route = default if route is None else route
    if route not in ROUTES:
        raise InvalidRequestError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")
    return route


@dataclass
class RouteRun:
    """The route of one generation: requested, the mode in use, each switch, tokens per mode; ``switcher``
    decides the switches (:class:`RouteSwitcher`)."""

    requested: str
    mode: str = "speculative"
    initial: str = ""
    switches: list[dict] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=lambda: {"speculative": 0, "cloud": 0, "device": 0})
    switcher: "RouteSwitcher" = field(default_factory=lambda: CostModelSwitcher())
    steps_in_mode: int = 0
    cloud_chunk: int = FIRST_CLOUD_CHUNK
    why: str = ""
    estimates: RouteEstimates | None = None  # the client's (reported under auto)
    last_verdict_t: float | None = None  # perf_counter() at the segment's last speculative verdict
    prefill: DraftPrefill | None = None  # cloud-first: the draft's prefill while the cloud streams
    can_stop: bool = False  # a Decode stream can be ended at a token boundary (StopDecode, or per-token calls)
    hand_over: dict | None = None  # a hand-over asked mid-chunk (why, when), applied when the stream has ended
    # asked by the loop at a cloud token and by the prefill thread the moment it is ready: one decision at a time
    hand_over_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    draft_ready_s: float | None = None  # cloud-first: seconds from the start until the draft was caught up
    explore: str | None = None  # auto speculates against its cost model's pick, and why (RouteEstimates.explore_reason)
    # why the generation left the route it would have taken (its draft quarantined by the verifier: the cloud
    # route; no verifier answering: the device fallback); "" = it did not
    fallback: str = ""
    t0: float = field(default_factory=time.perf_counter)  # the generation's start (switch times are from it)

    def report(self) -> dict:
        """The ``"route"`` object of ``--json``: requested, initial, final mode, switches, tokens per mode."""
        out = {"requested": self.requested, "initial": self.initial or self.mode, "final": self.mode,
               "why": self.why, "switches": list(self.switches), "tokens": dict(self.tokens)}
        if self.draft_ready_s is not None:
            out["draft_ready_s"] = round(self.draft_ready_s, 4)
        if self.explore is not None:
            out["explore"] = self.explore
        if self.fallback:
            out["fallback"] = self.fallback
        if self.estimates is not None and self.requested == "auto":
            out["estimates"] = self.estimates.to_json()
        return out

    def switch(self, to: str, at_tokens: int, why: str, **asked) -> None:
        """Record a switch now, at ``at_tokens`` generated tokens; ``asked``: when a mid-chunk hand-over was
        asked (``asked_at_token``, ``asked_s``), before its stream ended."""
        self.switches.append({"at_token": at_tokens, "at_s": round(time.perf_counter() - self.t0, 4),
                              "from": self.mode, "to": to, "why": why, **asked})
        self.mode, self.steps_in_mode, self.why = to, 0, why


class RouteSwitcher(Protocol):
    """Decides, at the block and chunk boundaries of a session, whether to switch between speculative and
    cloud decode (both lossless in one session: a switch loses and repeats no token). :class:`CostModelSwitcher`
    is auto's; an app or a test may pass its own (``EdgeClient(route_switcher=...)``), consulted on every route
    but device. Each method returns the reason of a switch now, or None."""

    def to_cloud(self, client: GenerationContext, run: "Run") -> str | None:
        """After a speculative block (the route's estimates already hold it)."""

    def to_speculative(self, client: GenerationContext, run: "Run") -> str | None:
        """After a cloud chunk."""

    def cloud_chunk_tokens(self, run: "Run") -> int:
        """Tokens of the next cloud decode chunk (a switch back is considered after it); 0 = the whole rest."""


@runtime_checkable
class HandsOver(Protocol):
    """A :class:`RouteSwitcher` that may hand a cloud-first start over mid-chunk: asked the moment the draft's
    prefill is ready (from its thread) and at each later cloud token; a reason ends the Decode stream there. A
    switcher without it hands over at chunk ends only."""

    def hand_over(self, client: GenerationContext, run: "Run") -> str | None:
        """The reason to hand over now, or None to stay on the cloud for this token."""


class CostModelSwitcher:
    """``route="auto"``'s rule: switch when the other route is expected to finish the tokens left sooner by
    more than SWITCH_MARGIN (:mod:`edge_client.generation.route_cost`, start-up and the draft's catch-up included); never
    within MIN_BLOCKS_BEFORE_SWITCH blocks of the last switch or with fewer than MIN_TOKENS_LEFT_TO_SWITCH left.
    Other routes do not switch: their cloud decode is one stream to the end. Auto's chunks double from
    FIRST_CLOUD_CHUNK to MAX_CLOUD_CHUNK tokens."""

    def cloud_chunk_tokens(self, run: "Run") -> int:
        rr: RouteRun = run.route
        if rr.prefill is not None and not rr.prefill.ready and not rr.can_stop:
            return _chunk_until_ready(rr)  # cloud-first on a verifier without StopDecode: a chunk until ready
        return rr.cloud_chunk if rr.requested == "auto" else 0

    def hand_over(self, client: GenerationContext, run: "Run") -> str | None:
        """Mid-chunk, the draft is ready: hand over at this token? The rule of :meth:`to_speculative` (staying
        on the cloud costs the rest of this chunk with no new call, about what the stop's trip costs
        speculation, while the cloud goes on making tokens)."""
        return self.to_speculative(client, run)

    def to_cloud(self, client: GenerationContext, run: "Run") -> str | None:
        rr: RouteRun = run.route
        if rr.requested != "auto" or rr.steps_in_mode < MIN_BLOCKS_BEFORE_SWITCH or _few_left(run):
            return None
        est, left = client.route_estimates, _tokens_left(run)
        spec = est.speculative_finish_ms(client, left, None)  # running: the draft is caught up
        cloud = est.cloud_finish_ms(left, rr.cloud_chunk, MAX_CLOUD_CHUNK)
        if cloud is not None and spec is not None and SWITCH_MARGIN * cloud < spec:
            return route_reason("cloud", cloud, "speculative", spec, left)
        return None

    def to_speculative(self, client: GenerationContext, run: "Run") -> str | None:
        rr: RouteRun = run.route
        if rr.requested not in ("auto", "cloud-first") or _few_left(run):
            return None
        if rr.prefill is not None and not rr.prefill.ready:
            return None  # cloud-first: another chunk while the draft prefills
        if rr.prefill is not None and rr.explore is not None:
            return rr.explore  # the hand-over an exploring start planned: fresh blocks measure the draft
        if rr.requested == "cloud-first":
            return "the draft is ready" if rr.prefill is not None else None
        est, left = client.route_estimates, _tokens_left(run)
        # the hand-over planned by a cloud-first start needs no margin against flapping: it is the first switch
        unseen, margin = ((rr.prefill.num_unseen(), 1.0) if rr.prefill is not None
                          else (draft_unseen(client.drafter, run.committed), SWITCH_MARGIN))
        spec = est.speculative_finish_ms(client, left, unseen)  # + the catch-up left
        cloud = est.cloud_finish_ms(left, rr.cloud_chunk, MAX_CLOUD_CHUNK)  # the next chunk's first token too
        if spec is None and rr.prefill is not None:  # as a first generation starts: blocks measure the draft
            return "the draft is ready and not measured yet: speculative blocks measure it"
        if spec is not None and cloud is not None and margin * spec < cloud:
            return route_reason("speculative", spec, "cloud", cloud, left)
        return None


def _chunk_until_ready(rr: RouteRun) -> int:
    """Tokens of the next cloud-first chunk: about those the cloud makes while the draft finishes its prefill."""
    est = rr.estimates
    per_token = est.catchup_ms_per_token if est is not None else None
    left_s = rr.prefill.remaining_s(None if per_token is None else per_token / 1000)
    step_ms = est.cloud_step_expected_ms() if est is not None else None
    if left_s is None or not step_ms:
        return CLOUD_FIRST_CHUNK
    return int(min(FIRST_CLOUD_CHUNK, max(MIN_CLOUD_FIRST_CHUNK, math.ceil(1000 * left_s / step_ms) + 1)))


def start_route(client: GenerationContext, route: str | None, fallback: str = "") -> RouteRun:
    """The RouteRun of a generation (``route`` None: the client's ``route``; its switches decided by the
    client's ``route_switcher``, None = :class:`CostModelSwitcher`); ``fallback``: why ``route`` is not the one
    asked for ("" = it is).

    Raises:
        InvalidRequestError: an unknown route."""
    requested = check_route(route, client.route)
    rr = RouteRun(requested, switcher=client.route_switcher or CostModelSwitcher(),
                  estimates=client.route_estimates, fallback=fallback)
    rr.mode = requested if requested in ("cloud", "device") else "speculative"  # auto, cloud-first: run_session
    return rr


def run_session(client: GenerationContext, run: "Run", opened: SessionOpened, sampling: SamplingParams,
                plan: SessionPlan) -> Iterator["Chunk"]:
    """One verifier session of a generation, on its route: speculative blocks, cloud decode, or (auto,
    cloud-first) both in turn, until the generation finishes or a call fails (raised, as
    :func:`edge_client.generation.speculative.verify_session`). Each segment starts at the session's next seq and its
    committed length, so a switch loses and repeats nothing. A cloud-first prefill is stopped before the drafter
    is used here and when the session ends, however it ends."""
    rr: RouteRun = run.route
    if rr.requested in ("auto", "cloud-first"):
        client.route_estimates.begin(client, opened)
        if not rr.initial:
            _choose_start(client, run, plan.timing_free)
    if client.drafter is None and rr.mode == "speculative" and rr.requested == "auto":
        rr.mode, rr.why = "cloud", "no drafter"
    rr.initial = rr.initial or rr.mode
    rr.can_stop = rr.prefill is not None and can_stop(client.backend)
    run.last_seq = run.first_seq - 1  # this session's verdicts so far: none
    try:
        while run.finish_reason is None:
            run.first_seq = run.last_seq + 1
            if rr.mode == "cloud":
                yield from _cloud_segment(client, run, opened)
                if run.finish_reason is None:
                    after_chunk(client, run)
            else:
                stop_prefill(client, rr)  # the drafter is this thread's again
                before, rr.last_verdict_t = len(run.committed), None
                client.route_estimates.begin_segment(draft_unseen(client.drafter, run.committed))
                try:
                    yield from verify_session(client, run, opened, sampling, plan, SpeculativeRoute(client, run))
                finally:
                    rr.tokens["speculative"] += len(run.committed) - before
    finally:
        stop_prefill(client, rr)
    run.first_seq = run.last_seq + 1


def _choose_start(client: GenerationContext, run: "Run", timing_free: bool) -> None:
    """The first mode of an auto or cloud-first generation. cloud-first starts on the cloud with the draft's
    prefill running whenever the draft has at least MIN_UNSEEN_FOR_CLOUD_FIRST tokens to catch up on (else it
    speculates at once); auto does so when the cost model picks speculative but its first verdict (the catch-up
    and a first block) is expected after a Decode call's first token (or either is unknown), else it takes the
    cost model's pick — unless that pick is the cloud by a small margin while the speculative estimates are thin
    or stale (:meth:`RouteEstimates.explore_reason`): then it speculates anyway (cloud-first when it can, handing
    over once the draft is ready) so that fresh blocks correct them.
    ``timing_free``: the plan's timing-free schedule (:class:`edge_client.generation.plan.SessionPlan`): the
    prefill feeds whole chunks only."""
    rr: RouteRun = run.route
    est, unseen = client.route_estimates, draft_unseen(client.drafter, run.committed)
    prefill = can_prefill(client.drafter) and unseen >= MIN_UNSEEN_FOR_CLOUD_FIRST and not _few_left(run)
    if rr.requested == "auto":
        left = _tokens_left(run)
        rr.mode, rr.why = est.choose(client, left, unseen, rr.cloud_chunk, MAX_CLOUD_CHUNK)
        if rr.mode == "cloud" and not _few_left(run):
            rr.explore = est.explore_reason(est.speculative_finish_ms(client, left, unseen),
                                            est.cloud_finish_ms(left, rr.cloud_chunk, MAX_CLOUD_CHUNK))
            if rr.explore is not None:
                rr.mode, rr.why = "speculative", rr.explore
        # the first block's verdict (catch-up, drafting, round trip, verify) against the cloud's first token
        spec_first, cloud_first = est.speculative_finish_ms(client, 1, unseen), est.cloud_first_expected_ms()
        prefill = prefill and rr.mode == "speculative" and (
            rr.explore is not None or spec_first is None or cloud_first is None or spec_first > cloud_first)
    else:
        rr.mode, rr.why = "speculative", f"the draft has {unseen} tokens to catch up on: no prefill to overlap"
    if prefill:
        rr.mode, rr.why = "cloud", (f"cloud-first: the draft prefills {unseen} tokens while the cloud streams"
                                    + (f"; {rr.explore}" if rr.explore else ""))
        # started by the Decode call (_cloud_segment), once its request is on its way
        rr.prefill = DraftPrefill(client.drafter, run.committed, whole_chunks=timing_free, start=False)


def stop_prefill(client: GenerationContext, rr: RouteRun) -> None:
    """End a cloud-first prefill (its thread joined: the drafter is the caller's) and learn its cost per token.

    Raises:
        what the prefill raised."""
    prefill, rr.prefill = rr.prefill, None
    if prefill is None:
        return
    try:
        prefill.stop()
    finally:
        # from the generation's start, as the switches' at_s (the prefill's clock starts after the session opened)
        rr.draft_ready_s = None if prefill.ready_s is None else prefill.t0 - rr.t0 + prefill.ready_s
        client.route_estimates.observe_prefill(prefill.num_fed, prefill.fed_s)


def _cloud_segment(client: GenerationContext, run: "Run", opened: SessionOpened) -> Iterator["Chunk"]:
    """Cloud decode from the committed length: one chunk of the switcher's length, or the whole rest (0); with
    a cloud-first prefill, ended early (:meth:`edge_client.transport.cloud_decode.CloudStream.stop`) at the token the draft
    is ready and the switcher hands over (:func:`_ask_hand_over`): the verdicts committed until the stop lands
    are read to the stream's end."""
    rr: RouteRun = run.route
    max_tokens = rr.switcher.cloud_chunk_tokens(run)
    seq, t0 = run.first_seq, time.perf_counter()
    prefill, rr.hand_over = rr.prefill, None
    heads = client.drafter if isinstance(client.drafter, UsesFeatures) else None  # a draft head reads them
    stream = cloud_verdicts(client.backend, opened.session_id, seq, len(run.committed), max_tokens,
                            client.timeout_s, on_call=prefill.start if prefill is not None else None,
                            features=None if heads is None else heads.feature_request)
    if prefill is not None and not prefill.ready:  # ready while this stream runs: ask at once, from its thread
        prefill.on_ready = lambda: _ask_hand_over(client, run, stream)
    try:
        for i, verdict in enumerate(stream):
            now = time.perf_counter()
            tokens, reason = run.cut(verdict.committed_token_ids, verdict.finish_reason if verdict.finished else None)
            run.committed.extend(tokens)
            if heads is not None:  # the features of the cloud's tokens: the head drafts on after a hand-over
                heads.observe_features(run.committed, verdict.features)
            if verdict.logprobs is not None:  # asked for
                run.logprobs.extend(verdict.logprobs[: len(tokens)])
            run.last_seq, run.session_committed = seq + i, verdict.committed_length
            run.stats.observe(0, verdict)
            rr.tokens["cloud"] += len(tokens)
            client.route_estimates.observe_cloud(i == 0, (now - t0) * 1000, verdict)
            t0 = now
            yield from run.out.push(tokens, verified=True)
            if reason is not None:
                run.finish_reason = reason
                return
            if not stream.stopping:
                _ask_hand_over(client, run, stream)
    finally:
        if prefill is not None:
            prefill.on_ready = None
        stream.close()  # an edge-side stop (a stop string across sessions) cancels the rest
    rr.steps_in_mode += 1
    if prefill is None:  # auto's chunks double; cloud-first's follow the prefill
        rr.cloud_chunk = min(MAX_CLOUD_CHUNK, rr.cloud_chunk * 2)


def _ask_hand_over(client: GenerationContext, run: "Run", stream) -> None:
    """With a cloud-first prefill that is ready (called at each cloud token, and by the prefill thread the moment
    it gets ready): when the switcher's ``hand_over`` says go, stop ``stream`` at the verifier's next token
    boundary and remember why (``rr.hand_over``, applied by :func:`after_chunk` once the stream has ended); when it
    says stay, it is asked again at the next token, and the chunk's end decides as without a stop."""
    rr: RouteRun = run.route
    ask = rr.switcher.hand_over if isinstance(rr.switcher, HandsOver) else None
    with rr.hand_over_lock:
        prefill = rr.prefill
        if not rr.can_stop or ask is None or prefill is None or not prefill.ready or rr.hand_over is not None:
            return
        why = ask(client, run)
        if why is None:
            return
        rr.hand_over = {"why": why, "asked_at_token": run.num_generated,
                        "asked_s": round(time.perf_counter() - rr.t0, 4)}
        stream.stop()


@dataclass
class SpeculativeRoute:
    """The route's side of a speculative segment (a :class:`edge_client.generation.observation.BlockObserver`):
    after each block, count it, learn from it, and tell whether to switch to cloud decode now."""

    client: GenerationContext
    run: "Run"

    def after_block(self, obs: BlockObservation) -> bool:
        """True ends the speculative segment at this block boundary (a switch to cloud decode)."""
        rr: RouteRun = self.run.route
        rr.steps_in_mode += 1
        now = time.perf_counter()
        wall_ms = None if rr.last_verdict_t is None else (now - rr.last_verdict_t) * 1000
        rr.last_verdict_t = now
        self.client.route_estimates.observe_block(obs, wall_ms)
        why = rr.switcher.to_cloud(self.client, self.run)
        if why is not None:
            rr.switch("cloud", self.run.num_generated, why)
            return True
        return False


def _tokens_left(run: "Run") -> int:
    left = run.stopping.max_new_tokens - run.num_generated
    if run.max_context_tokens:  # the verifier ends the generation at its context limit
        left = min(left, run.max_context_tokens - len(run.committed))
    return max(0, left)


def _few_left(run: "Run") -> bool:
    return run.stopping.max_new_tokens - run.num_generated < MIN_TOKENS_LEFT_TO_SWITCH


def after_chunk(client: GenerationContext, run: "Run") -> None:
    """Between two cloud chunks: switch (back) to speculative when the route's switcher says so; a cloud-first
    prefill that is ready when the switcher says stay ends there (a later switch back pays the catch-up)."""
    rr: RouteRun = run.route
    asked, rr.hand_over = rr.hand_over, None
    if asked is not None:  # asked mid-chunk: the stream ended at the stop
        rr.switch("speculative", run.num_generated, asked.pop("why"), **asked)
        return
    why = rr.switcher.to_speculative(client, run)
    if why is not None:
        rr.switch("speculative", run.num_generated, why)
    elif rr.prefill is not None and rr.prefill.ready:  # ready, and staying on the cloud: no prefill to follow
        stop_prefill(client, rr)


def decode_device(client: GenerationContext, run: "Run", sampling: SamplingParams) -> Iterator["Chunk"]:
    """route=device: decode with the draft alone to the end (:func:`edge_client.generation.fallback.decode_unverified`:
    unverified, flagged; no verifier is called); any other route: nothing.

    Raises:
        InvalidRequestError: the client has no draft model that can decode alone (n-gram, target-only)."""
    if run.route.mode != "device":
        return
    if not DeviceDecoder.supports(device_drafter(client)):
        raise InvalidRequestError("route=device needs a draft model that decodes alone (not n-gram or none)")
    yield from decode_unverified(client, run, with_seed(sampling))
