"""What a drafter must do, what it may do, and what each request needs of it.

:class:`Drafter` is the one required method, ``propose``: enough for the speculative route (and ``auto``,
``cloud-first``, cloud decode, which need no more). Everything else is an optional capability, one small
``runtime_checkable`` protocol each, asked with ``isinstance(drafter, X)`` where it is used; each says what it
enables and what the edge does without it. :class:`edge_client.drafting.drafter.ModelDrafter` has them all;
:class:`edge_client.drafting.ngram.NgramDrafter` is :class:`Resettable` only.

What a request needs (:func:`check_request`, called once per generation before anything is sent):

- decoding on the device (``route="device"``, or the client's ``fallback="device"``): :class:`DecodesAlone` (a
  draft head is not: a standalone draft beside it, the client's ``device_drafter``, decodes instead); with
  ``grammar``, :class:`ConstrainsGrammar`; with penalties, logit_bias or min_tokens, :class:`HistoryProcessing` —
  else :class:`common.errors.UnsupportedByDrafterError`: without them the device would emit tokens the request
  forbids, unverified. The fallback is checked up front even when the cloud answers: a fallback that cannot
  happen would otherwise surface only as an outage's error, long after the setup that caused it.
- a seeded sampled generation that drafts: :class:`Resettable` — else UnsupportedByDrafterError: state kept from
  another generation would change the draws, and the seed would not reproduce the output.
- a grammar while drafting for the verifier, with a drafter that is not :class:`ConstrainsGrammar`: logged once,
  not refused. Its drafts ignore the grammar, the verifier masks them and accepts fewer: slower, still correct.
- ``cloud-first`` with a drafter that is not :class:`PrefillsConcurrently` (or none): logged once; the generation
  speculates from the start (there is no prefill to overlap with the cloud's first tokens), still correct.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

import numpy as np

from specdec_runtime.common.errors import UnsupportedByDrafterError
from specdec_runtime.common.types import DraftBlock, SamplingParams, StoppingCriteria

if TYPE_CHECKING:
    from specdec_runtime.common.logits_processors import TokenHistory
    from specdec_runtime.edge_client.drafting.grammar import DraftGrammar

__all__ = ["Drafter", "DraftModelInfo", "Resettable", "TurnAware", "HistoryProcessing", "ConstrainsGrammar",
           "DecodesAlone", "PrefillsConcurrently", "TracksContext", "UsesFeatures", "check_request"]

log = logging.getLogger(__name__)


@runtime_checkable
class Drafter(Protocol):
    """Anything that proposes draft blocks for :class:`edge_client.client.EdgeClient` (:class:`ModelDrafter
    <edge_client.drafting.drafter.ModelDrafter>`, :class:`NgramDrafter <edge_client.drafting.ngram.NgramDrafter>`).
    One drafter serves one session at a time.

    The losslessness contract: the verifier accepts draft token x_i with probability min(1, p(x_i) / q(x_i))
    and resamples from norm(max(0, p − q)) at the first rejection (Leviathan et al. 2023, Algorithm 1). Its
    output has exactly the target's distribution only when q is EXACTLY the distribution x_i was drawn from.
    So ``draft_probs`` row i must be the very distribution the drafter sampled token i from (after any
    truncation to k tokens and renormalisation), not an approximation of the draft model's distribution; and
    ``draft_probs = None`` declares greedy drafting: q_i is one-hot on x_i (a deterministic choice of token,
    e.g. argmax or prompt lookup). Greedy sessions are exact with any draft tokens; sampled sessions rely on
    this contract.
    """

    def propose(
        self, committed_token_ids: list[int], num_speculative_tokens: int, sampling: SamplingParams,
        min_confidence: float = 0.0, should_stop: Callable[[], bool] | None = None,
    ) -> DraftBlock:
        """Draft up to ``num_speculative_tokens`` (γ) tokens after the committed prefix.

        Args:
            committed_token_ids: prompt + committed output ids (non-empty); the block continues them. Proactive
                drafting passes committed ids + a block still in flight (+ a bonus guess after a classic
                block; none after a bonus_drafted block, whose last token is that guess).
            num_speculative_tokens: γ >= 0, the most draft tokens to return (0: an empty block); for a
                bonus_drafted block the client asks for its γ + 1 tokens.
            sampling: the session's SamplingParams (a sampling drafter applies the same logits processing
                the verifier applies to p: ``common.sampling.logits_to_probs``, and draws with
                ``common.sampling.uniform(sampling.seed, position, Stream.DRAFT_SAMPLE)``, ``position`` the
                absolute index of the drafted token; a sampled session's seed is always set by then).
            min_confidence: confidence truncation (llama.cpp's ``--draft-p-min``): stop the block, after at least
                one token, when the draft's most likely next token has probability below it; 0 disables it.
                A drafter without probabilities ignores it.
            should_stop: checked before each token after the first; True ends the block there (proactive
                drafting stops drafting ahead once the verdict it bets on has arrived). None: never.

        Returns:
            DraftBlock: ``draft_token_ids`` [n] with 0 <= n <= γ (fewer than γ after truncation, or when the
            drafter has nothing to propose); ``draft_probs`` None for greedy drafting (q one-hot), else
            SparseDraftProbs with ids int64 [n, k] and probs float32 [n, k], row i the exact q token i was
            sampled from (zero-probability padding ids allowed, the draft token in its row's support);
            ``draft_ms`` the wall time of the call, ms.

        Raises:
            ValueError: empty ``committed_token_ids`` or γ < 0 (drafters that check).
        """
        ...


@runtime_checkable
class Resettable(Protocol):
    """A drafter that can forget what it kept from earlier generations (a KV cache). Needed by a seeded sampled
    generation, which starts from a fresh state so that its draws depend on the seed alone. A drafter that keeps
    nothing implements it as a no-op."""

    def reset(self) -> None:
        """Forget the per-generation state (caches of prompt prefixes may stay: they hold what a fresh
        prefill computes)."""


@runtime_checkable
class TurnAware(Protocol):
    """A drafter told where each generation (or conversation turn) starts: its history-dependent processors and
    its grammar count the output from there. Without it nothing is told (the drafter has neither)."""

    def begin_turn(self, prompt_length: int, stopping: StoppingCriteria) -> None:
        """The generation about to be drafted: its prompt length, tokens, and stopping criteria."""


@runtime_checkable
class HistoryProcessing(TurnAware, Protocol):
    """A drafter that applies the session's history-dependent processors (logit_bias, repetition/presence/
    frequency penalties, min_tokens: :mod:`common.logits_processors`) as the verifier does. Needed to decode
    alone a request that has them; without it drafts ignore them (the verifier applies them: still correct)."""

    def processor(self, sampling: SamplingParams, token_ids: list[int], vocab_size: int) -> TokenHistory | None:
        """The processors' state brought to ``token_ids`` (logits width ``vocab_size``); None when the session
        has none."""


@runtime_checkable
class ConstrainsGrammar(TurnAware, Protocol):
    """A drafter that drafts under the session's grammar (structured output: the verifier's mask, forced tokens
    for free). Needed to decode alone a request with a grammar; while drafting for the verifier, one without it
    drafts unconstrained (the verifier masks: fewer tokens accepted, still correct)."""

    def draft_grammar(self, sampling: SamplingParams) -> DraftGrammar:
        """The generation's grammar state for ``sampling.grammar``. Raises InvalidRequestError (a bad spec)."""


class DraftModelInfo(Protocol):
    """What device decoding reads of a draft model (:class:`edge_client.drafting.onnx_draft.OnnxDraftModel`)."""

    model_dir: Path  # its config.json / generation_config.json name the EOS ids
    tokenizer: object  # its ``eos_token_id`` is one more EOS id
    max_position_embeddings: int | None  # the draft's context, tokens (None: unknown)


@runtime_checkable
class DecodesAlone(Protocol):
    """A drafter that can generate on its own: the draft model's logits for the next token. Enables
    ``route="device"`` and the device fallback (:mod:`edge_client.generation.fallback`); a request for either
    without it is refused (:func:`check_request`)."""

    model: DraftModelInfo
    valid_vocab_size: int  # ids at or past it (padded logit columns) are never produced

    def next_token_logits(self, committed_token_ids: list[int]) -> np.ndarray:
        """Raw logits float32 [vocab_size] for the token after ``committed_token_ids`` (non-empty).
        Raises ValueError on an empty list."""


@runtime_checkable
class PrefillsConcurrently(Protocol):
    """A drafter with a context to ingest that can do it in chunks from another thread
    (:class:`edge_client.drafting.prefill.DraftPrefill`): enables ``cloud-first`` (and ``auto`` starting as it),
    the draft catching up while the cloud streams the first tokens. Without it those start speculating at once."""

    def prefill_step(self, token_ids: list[int], whole_chunks: bool = False) -> int:
        """Feed the next chunk of ``token_ids[:-1]`` not yet ingested; the tokens fed (0: caught up)."""


@runtime_checkable
class TracksContext(Protocol):
    """A drafter that knows how much of a context it has not ingested yet: ``auto``'s cost model charges that
    catch-up to the speculative route (:func:`edge_client.generation.route_cost.draft_unseen`). Without it all of
    the context but its last token counts as unseen (a drafter with no such state is measured at ~0 ms a token)."""

    def uncached(self, committed_token_ids: list[int]) -> int:
        """Tokens of ``committed_token_ids[:-1]`` the next block must feed first; 0 when caught up."""


@runtime_checkable
class UsesFeatures(Protocol):
    """A drafter that reads the target's features (a draft head: :class:`edge_client.drafting.head.HeadDrafter`).
    The generation asks for ``feature_request`` at open (the prompt's features) and hands it every answer's
    features; its blocks ask for them too (``DraftBlock.features``). Without it nothing is asked: the wire is
    unchanged."""

    feature_request: object  # common.features.FeatureRequest

    def observe_features(self, committed_token_ids: list[int], block) -> None:
        """The features ``block`` (common.features.FeatureBlock or None) of an answer after which the committed
        ids are ``committed_token_ids``."""

    def features_missing_from(self, committed_token_ids: list[int]) -> int | None:
        """The first position before the last of ``committed_token_ids`` it has no target feature for, or None:
        what a block says in ``DraftBlock.features_from`` (a replica that resumed the session sends them)."""


_logged: set[tuple[str, str]] = set()
_logged_lock = threading.Lock()


def _log_once(drafter: object, capability: str, message: str) -> None:
    """Log ``message`` the first time a drafter type lacks ``capability`` for a request (not per generation)."""
    key = (type(drafter).__name__, capability)
    with _logged_lock:
        if key in _logged:
            return
        _logged.add(key)
    log.warning(message)


def _name(drafter: object) -> str:
    return "no drafter (target-only decoding)" if drafter is None else f"the drafter {type(drafter).__name__}"


def check_request(drafter: object, sampling: SamplingParams, route: str, fallback: str,
                  device_drafter: object = None) -> None:
    """Check that ``drafter`` (None: target-only decoding) can serve a generation on ``route`` ("speculative",
    "cloud", "device", "auto", "cloud-first") with the client's ``fallback`` ("none" | "device"); the rules are
    the module docstring's. ``device_drafter``: the standalone draft that decodes on the device instead of
    ``drafter`` (beside a draft head, which cannot decode alone); None: ``drafter`` itself. Call it before
    anything is sent.

    Raises:
        UnsupportedByDrafterError: a capability the request needs is missing (``capability``: its name)."""
    on_device = route == "device" or fallback == "device"
    where = "route=device" if route == "device" else "fallback='device'"
    if on_device and device_drafter is None and isinstance(drafter, UsesFeatures) \
            and not isinstance(drafter, DecodesAlone):
        raise UnsupportedByDrafterError(
            f"{where} needs a draft that decodes alone; {_name(drafter)} is a draft head (it drafts from the "
            "verifier's features): configure a standalone draft beside it (EdgeClient(device_drafter=...))",
            DecodesAlone.__name__, head_on_device="route" if route == "device" else "fallback")
    if on_device:
        drafter = drafter if device_drafter is None else device_drafter
        needs = [(DecodesAlone, True, "decodes alone (a draft model; not n-gram drafting or none)"),
                 (ConstrainsGrammar, bool(sampling.grammar), "constrains its output to a grammar"),
                 (HistoryProcessing, sampling.has_history_processors,
                  "applies penalties, logit_bias and min_tokens")]
        for capability, needed, what in needs:
            if needed and not isinstance(drafter, capability):
                raise UnsupportedByDrafterError(
                    f"{where} needs a drafter that {what}; {_name(drafter)} does not "
                    f"(edge_client.drafting.contract.{capability.__name__})", capability.__name__)
    drafts = drafter is not None and (route != "cloud" or on_device)
    if drafts and not sampling.greedy and sampling.seed is not None and not isinstance(drafter, Resettable):
        raise UnsupportedByDrafterError(
            f"a seeded sampled generation needs a drafter that can reset its state; {_name(drafter)} has no "
            "reset() (edge_client.drafting.contract.Resettable: a no-op for a drafter that keeps nothing)",
            Resettable.__name__)
    if drafts and route != "cloud" and sampling.grammar and not isinstance(drafter, ConstrainsGrammar):
        _log_once(drafter, ConstrainsGrammar.__name__,
                  f"{_name(drafter)} drafts without the grammar: the verifier masks its tokens (correct output, "
                  "fewer accepted)")
    if route == "cloud-first" and not isinstance(drafter, PrefillsConcurrently):
        _log_once(drafter, PrefillsConcurrently.__name__,
                  f"cloud-first: {_name(drafter)} has no prefill to overlap with the cloud; speculating from the "
                  "start")
