"""The generation loop: one generation of a client, over one verifier session or several.

The loop (docs/architecture.md "The main loop"): open a session (prompt ids, sampling, limits, tokenizer
fingerprint), run it on its route (:func:`edge_client.generation.routing.run_session`: speculative blocks,
:mod:`edge_client.generation.speculative`, or cloud decode, or both in turn with ``route="auto"``), stream committed text.
Around it, what keeps a generation going: a session whose record vanished (NOT_FOUND) is re-opened with
everything committed as its prompt and the same seed; with ``fallback="device"`` an unreachable cloud is
bridged by decoding on the device (:func:`edge_client.generation.fallback.decode_on_device`); a conversation's turn extends
the session it kept (:class:`KeptSession`) instead of opening one.

Callers: :class:`edge_client.client.EdgeClient` (``stream_chunks``) and
:class:`edge_client.conversation.Conversation`. The client's settings are read through
:class:`edge_client.generation.context.GenerationContext`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Iterator

from specdec_runtime.common.errors import (ConflictError, DeadlineError, PreconditionError, SessionNotFoundError,
                           VerifierUnavailableError)
from specdec_runtime.common.types import ExtendRequest, OpenRequest, SamplingParams, SessionOpened, StoppingCriteria
from specdec_runtime.edge_client.drafting.contract import Resettable, TurnAware, UsesFeatures, check_request
from specdec_runtime.edge_client.generation.context import GenerationContext
from specdec_runtime.edge_client.generation.fallback import decode_on_device
from specdec_runtime.edge_client.generation.run import Run, with_seed
from specdec_runtime.edge_client.output import Chunk, TextOutput
from specdec_runtime.edge_client.transport.backend import CountsWire, failovers_of
from specdec_runtime.edge_client.generation.plan import plan_generation
from specdec_runtime.edge_client.generation.routing import decode_device, run_session, start_route

__all__ = ["KeptSession", "close_session", "generate"]

log = logging.getLogger(__name__)

MAX_SESSIONS = 64  # sessions one generation may open (re-opens after failures, returns from device fallback)


@dataclass
class KeptSession:
    """The verifier session a conversation keeps between turns (``opened`` None when there is none to extend)."""

    opened: SessionOpened | None = None
    committed_length: int = 0  # the session's committed length at the end of the last turn, tokens
    last_seq: int = 0  # seq of its last verified block (the next turn's blocks go on from it)


def close_session(client: GenerationContext, session_id: str) -> None:
    """Close a verifier session, best effort: an abandoned session expires by its TTL."""
    try:
        client.backend.close_session(session_id)
    except Exception:  # noqa: BLE001 - best effort
        pass


def _start(client: GenerationContext, prompt_ids: list[int], sampling: SamplingParams, stopping: StoppingCriteria,
           route: str | None, fallback: str = "") -> Run:
    """The generation's Run, with the drafter readied for it.

    Raises:
        InvalidRequestError: an unknown route. UnsupportedByDrafterError: the drafter lacks a capability the
            request needs (:func:`edge_client.drafting.contract.check_request`), before anything is sent."""
    run = Run(list(prompt_ids), stopping, TextOutput(client.tokenizer, stopping.stop_strings),
              committed=list(prompt_ids), route=start_route(client, route, fallback))
    check_request(client.drafter, sampling, run.route.requested, client.fallback, client.device_drafter)
    if isinstance(client.drafter, TurnAware):  # the history-dependent processors count the output from here
        client.drafter.begin_turn(len(prompt_ids), stopping)
    if not sampling.greedy and sampling.seed is not None and isinstance(client.drafter, Resettable):
        # a seeded sampled generation starts from a fresh draft KV cache: an int8 draft's logits depend on
        # how many tokens one forward pass feeds (a 53-token prompt fed whole vs 52 + 1: logits up to 1.1
        # apart), so KV reused from another generation would change q and the seeded draws. Within one
        # generation the draft feeds the prompt in chunks at fixed positions (ModelDrafter.PREFILL_CHUNK_TOKENS),
        # then one token per forward, whatever the schedule; the draft's prefix cache restores only whole chunks
        # fed from position 0 (edge_client.drafting.prefix_cache), the KV a fresh prefill computes.
        client.drafter.reset()
    return run


def generate(client: GenerationContext, prompt_ids: list[int], sampling: SamplingParams,
             stopping: StoppingCriteria, keep: KeptSession | None = None,
             route: str | None = None, fallback: str = "") -> Iterator[Chunk]:
    """One generation (the module docstring); yields the committed text as :class:`Chunk`, sets
    ``client.last_result`` when it ends.

    Args:
        prompt_ids: the prompt's token ids (non-empty). sampling, stopping: checked parameters.
        keep: a conversation's kept session: the first session extends ``keep.opened`` (ExtendSession with
            ``prompt_ids[keep.committed_length:]``), and the last one is kept in ``keep`` instead of closed.
        route: "speculative" | "cloud" | "device" | "auto" | "cloud-first"; None = the client's.

    Raises:
        InvalidRequestError, PreconditionError, CapacityError, VerifierUnavailableError (no verifier and no
        device fallback, or more than MAX_SESSIONS sessions), DeadlineError (common.errors).
    """
    t0 = time.perf_counter()
    failovers_before = failovers_of(client.backend)
    run = _start(client, prompt_ids, sampling, stopping, route, fallback)
    sampling, plan = plan_generation(client, sampling, run.route.requested)  # before the verifier picks a seed
    yield from decode_device(client, run, sampling)  # route=device only: the draft alone, to the end
    while run.finish_reason is None:
        if len(run.session_ids) >= MAX_SESSIONS:
            raise VerifierUnavailableError(f"gave up after {MAX_SESSIONS} sessions for one generation")
        try:
            opened = _open_session(client, run, sampling, keep)
        except (VerifierUnavailableError, DeadlineError) as e:
            sampling = with_seed(sampling)  # device decoding and the sessions after it draw with one seed
            yield from decode_on_device(client, run, sampling, e)
            continue
        if sampling.seed is None:  # the first session picks it; a re-opened one keeps it (same draws)
            sampling = dataclasses.replace(sampling, seed=opened.seed)
        try:
            yield from run_session(client, run, opened, sampling, plan)
        except SessionNotFoundError as e:  # the record vanished (store restarted empty, expired): re-open
            log.info("session %s: %s; re-opening it from the %d committed tokens", opened.session_id, e,
                     len(run.committed))
            run.num_reopens += 1
            run.span_sessions(client.tokenizer)
            continue
        except (VerifierUnavailableError, DeadlineError) as e:  # no verifier within the retry budget
            yield from decode_on_device(client, run, sampling, e)
            continue
        except BaseException:
            close_session(client, opened.session_id)
            raise
        if keep is not None and run.session_committed == len(run.committed):  # both sides agree: keep it
            keep.opened, keep.committed_length, keep.last_seq = opened, len(run.committed), run.last_seq
        else:
            close_session(client, opened.session_id)
    yield from run.out.finish(run.finish_reason)
    wire_stats = client.backend.wire_stats if isinstance(client.backend, CountsWire) else None
    client.last_result = run.result(client.tokenizer, wire_stats, t0, failovers_of(client.backend) - failovers_before)


def feature_request(client: GenerationContext):
    """The features a draft head (``UsesFeatures``) asks for at open and with each turn; None for any other
    drafter (nothing asked: the wire stays as it was)."""
    return client.drafter.feature_request if isinstance(client.drafter, UsesFeatures) else None


def _extend_kept(client: GenerationContext, run: Run, sampling: SamplingParams, keep: KeptSession,
                 rest: StoppingCriteria) -> tuple[SessionOpened | None, SamplingParams]:
    """Extend the kept session with the turn's new tokens; (None, sampling) when the verifier lost it
    (NOT_FOUND) or cannot extend it (ABORTED, FAILED_PRECONDITION): the caller opens a new one, with the lost
    session's seed (same output), counted in ``run.num_reopens``."""
    prev, keep.opened = keep.opened, None  # consumed: whatever happens now, a later turn does not reuse it
    lacks = None  # the turn before ended with a verdict read back from the store: a resumed replica has them
    if feature_request(client) is not None:
        lacks = client.drafter.features_missing_from(run.committed[: keep.committed_length])
    try:
        request = ExtendRequest(prev.session_id, keep.committed_length, run.committed[keep.committed_length:],
                                sampling, rest, feature_request(client), lacks)
        opened = client.backend.extend_session(request, timeout_s=client.open_timeout_s)
    except (SessionNotFoundError, ConflictError, PreconditionError) as e:
        log.info("session %s cannot be extended (%s); re-opening it over the %d committed tokens",
                 prev.session_id, e, len(run.committed))
        if not isinstance(e, SessionNotFoundError):
            close_session(client, prev.session_id)
        run.num_reopens += 1
        if sampling.seed is None:  # same draws as the lost session would have made
            sampling = dataclasses.replace(sampling, seed=prev.seed)
        return None, sampling
    run.first_seq = keep.last_seq + 1
    return opened, sampling


def _open_session(client: GenerationContext, run: Run, sampling: SamplingParams,
                  keep: KeptSession | None = None) -> SessionOpened:
    """Open a session whose prompt is everything committed so far (the prompt, at first) — or, for the first
    session of a conversation's turn, extend the kept one (:func:`_extend_kept`)."""
    rest = dataclasses.replace(run.stopping, max_new_tokens=run.stopping.max_new_tokens - run.num_generated)
    opened = None
    if keep is not None and keep.opened is not None and not run.session_ids:
        opened, sampling = _extend_kept(client, run, sampling, keep, rest)
    if opened is None:
        # the delivered draft's (name, version) labels the verifier's per-version acceptance; a draft head asks
        # for the prompt's features (nothing else does: the wire stays as it was)
        name, version = getattr(client, "draft_version", None) or ("", "")
        labels = dict(draft_name=name, draft_version=version, features=feature_request(client))
        if run.num_generated:  # a re-open mid-turn: the verifier counts the output so far as generated
            # (penalties, min_tokens and the turn's max_new_tokens), as the lost session did
            request = OpenRequest(list(run.committed), sampling, run.stopping, client.fingerprint,
                                  num_output_tokens=run.num_generated, **labels)
        else:
            request = OpenRequest(list(run.committed), sampling, rest, client.fingerprint, **labels)
        opened = client.backend.open_session(request, timeout_s=client.open_timeout_s)
        run.first_seq = 1
    if feature_request(client) is not None:  # the prefill's features, whichever route the session starts on
        client.drafter.observe_features(run.committed, opened.features)
    run.session_ids.append(opened.session_id)
    run.max_context_tokens = opened.max_context_tokens
    return opened
