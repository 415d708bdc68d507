"""Device fallback (hybrid): keep generating with the draft model alone while no verifier can be reached.

With ``fallback="device"`` (:class:`edge_client.client.EdgeClient`, ``specdec generate --fallback device``),
when no verifier answers within the retry budget, the edge decodes with its draft model alone:

- the draft's own distribution under the session's grammar when it has one (structured output: the mask the
  verifier applies, forced tokens without a forward pass, so the output still matches the schema), processed
  with the session's sampling parameters (temperature, top-k, top-p:
  :func:`common.sampling.logits_to_probs`; argmax when greedy), sampled with the counter-based stream
  ``uniform(seed, position, Stream.DRAFT_SAMPLE)`` (reproducible with a seed);
- the same stopping rule (:class:`common.stopping.StopChecker`: the draft's EOS ids, stop strings,
  max_new_tokens, the context limit), over the whole output;
- meanwhile a background thread probes the cloud every ``reconnect_interval_s`` (:class:`CloudProbe`); once it
  answers, the client opens a new session whose prompt is everything committed so far and goes on verified.

Tokens decoded here are not the target's: the client counts them (``num_unverified_tokens``) and flags their
text (:class:`edge_client.output.Chunk` ``verified=False``); the CLI prints a notice. They fall outside what a
seed guarantees (same tokens whatever the timing, batching or replica; docs/architecture.md "What a seed
guarantees"): which positions the draft fills alone depends on when the cloud was unreachable. Each of them is
still a function of the prefix and the draws at its position, and the verified session after a fallback goes
on with the same seed and the same kind of blocks. The draft's KV cache is shared
with drafting (:meth:`edge_client.drafting.drafter.ModelDrafter.next_token_logits` rolls it back to the committed
prefix, dropping the tokens of a bonus_drafted block that was never verified).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from specdec_runtime.common.errors import InvalidRequestError, UnsupportedByDrafterError
from specdec_runtime.common.grammar import apply_mask
from specdec_runtime.common.sampling import Stream, logits_to_probs, sample_from, uniform
from specdec_runtime.common.stopping import StopChecker
from specdec_runtime.common.types import FinishReason, SamplingParams
from specdec_runtime.edge_client.drafting.contract import ConstrainsGrammar, DecodesAlone, HistoryProcessing
from specdec_runtime.edge_client.generation.context import GenerationContext
from specdec_runtime.edge_client.transport.backend import Probes, answers

if TYPE_CHECKING:
    from specdec_runtime.edge_client.generation.run import Run
    from specdec_runtime.edge_client.output import Chunk

log = logging.getLogger(__name__)

__all__ = ["FALLBACK_MODES", "DeviceDecoder", "CloudProbe", "decode_on_device", "decode_unverified", "cloud_probe_fn",
           "device_drafter"]

FALLBACK_MODES = ("none", "device")
DEFAULT_CONTEXT_TOKENS = 2048  # context assumed for the draft when neither the verifier nor its config tells


class DeviceDecoder:
    """Plain decoding with the draft model of a :class:`edge_client.drafting.drafter.ModelDrafter` (no verification).

    Args:
        drafter: the client's drafter; it must decode alone
            (:class:`edge_client.drafting.contract.DecodesAlone`: the ONNX draft model) — :meth:`supports` tells.
            A grammar needs it :class:`~edge_client.drafting.contract.ConstrainsGrammar`, penalties
            :class:`~edge_client.drafting.contract.HistoryProcessing` (checked per request before anything is
            sent: :func:`edge_client.drafting.contract.check_request`).

    Raises:
        UnsupportedByDrafterError: the drafter cannot decode alone (n-gram drafting, target-only decoding).
    """

    def __init__(self, drafter: DecodesAlone) -> None:
        if not self.supports(drafter):
            raise UnsupportedByDrafterError("device decoding needs a draft model (not n-gram drafting or "
                                            "target-only decoding)", DecodesAlone.__name__)
        self.drafter = drafter
        self.model = drafter.model
        self.valid_vocab_size = int(drafter.valid_vocab_size)

    @staticmethod
    def supports(drafter) -> bool:
        """True when ``drafter`` can decode alone (:class:`edge_client.drafting.contract.DecodesAlone`)."""
        return isinstance(drafter, DecodesAlone)

    def eos_token_ids(self) -> set[int]:
        """The draft's end-of-sequence ids: its config.json / generation_config.json and its tokenizer's."""
        ids: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            path = self.model.model_dir / name
            try:
                eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
            except ValueError:
                eos = None
            if eos is not None:
                ids.update(int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos]))
        tok_eos = getattr(self.model.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.add(int(tok_eos))
        return ids

    @property
    def max_context_tokens(self) -> int:
        """The draft's context length, tokens (config.json; DEFAULT_CONTEXT_TOKENS when unknown)."""
        return int(self.model.max_position_embeddings or DEFAULT_CONTEXT_TOKENS)

    def next_token(self, committed_token_ids: list[int], sampling: SamplingParams) -> int:
        """The draft's next token after ``committed_token_ids``: argmax when greedy, else a draw from the draft's
        processed distribution with ``uniform(sampling.seed, position, Stream.DRAFT_SAMPLE)``; the session's
        grammar mask (``sampling.grammar``: the ids it forbids get −inf, the same mask as drafting and the
        verifier) and history-dependent processors (common.logits_processors) first, as everywhere. A token the
        grammar forces (the mask leaves one id) is returned without a draft forward pass.

        Raises:
            ValueError: empty ``committed_token_ids``; a sampled session without a seed.
            InvalidRequestError: the grammar refuses the output so far, or allows nothing the draft can produce.
        """
        matcher = self._matcher(committed_token_ids, sampling) if sampling.grammar else None
        if matcher is not None:
            forced = matcher.single_allowed()
            if forced is not None and forced < self.valid_vocab_size:
                return forced  # the grammar leaves one id: no forward pass (its KV is fed with the next one)
        logits = np.array(self.drafter.next_token_logits(committed_token_ids), dtype=np.float32)
        allowed = None
        if matcher is not None:
            allowed = matcher.mask(len(logits))  # [vocab_size] bool, first in the pipeline as on the verifier
            allowed[self.valid_vocab_size:] = False
            if not allowed.any():
                raise InvalidRequestError("the grammar allows no token the draft can produce here")
        history = None  # penalties, bias, min_tokens: as the verifier does (check_request refused them without)
        if isinstance(self.drafter, HistoryProcessing):
            history = self.drafter.processor(sampling, committed_token_ids, len(logits))
        if history is not None:
            logits = history.apply(logits, allowed)
        elif allowed is not None:
            apply_mask(logits, allowed)
        logits = logits[: self.valid_vocab_size]
        if sampling.greedy:
            return int(np.argmax(logits))
        if sampling.seed is None:
            raise ValueError("sampled device decoding needs a seed")
        probs = logits_to_probs(logits[None, :], sampling, self.valid_vocab_size)[0]
        return int(sample_from(probs, uniform(sampling.seed, len(committed_token_ids), Stream.DRAFT_SAMPLE)))


    def _matcher(self, committed_token_ids: list[int], sampling: SamplingParams):
        """The generation's grammar matcher (the drafter's, shared with drafting) brought to the turn's output in
        ``committed_token_ids``.

        Raises:
            InvalidRequestError: a spec the engine refuses, or an output the grammar does not match.
            UnsupportedByDrafterError: the drafter cannot constrain to a grammar."""
        if not isinstance(self.drafter, ConstrainsGrammar):
            raise UnsupportedByDrafterError("device decoding with a grammar needs a drafter that constrains to it",
                                            ConstrainsGrammar.__name__)
        grammar = self.drafter.draft_grammar(sampling)
        try:
            grammar.matcher.sync(committed_token_ids[grammar.start:])
        except ValueError as e:
            raise InvalidRequestError(f"the output does not match the grammar: {e}") from None
        return grammar.matcher


class CloudProbe:
    """Probes the cloud in a background thread every ``interval_s`` seconds until it answers.

    Args:
        probe: returns True when a verifier answers (e.g. :meth:`edge_client.transport.failover.FailoverBackend.probe`);
            exceptions count as False.
        interval_s: time between probes, s (> 0).

    Raises:
        ValueError: ``interval_s`` <= 0.
    """

    def __init__(self, probe: Callable[[], bool], interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"reconnect_interval_s must be > 0, got {interval_s}")
        self._probe = probe
        self.interval_s = float(interval_s)
        self._ready = threading.Event()
        self._stop = threading.Event()
        self.num_probes = 0
        self._thread = threading.Thread(target=self._run, name="specdec-cloud-probe", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        """True once a probe succeeded."""
        return self._ready.is_set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.num_probes += 1
            try:
                ok = bool(self._probe())
            except Exception:  # noqa: BLE001 - a failing probe is an unreachable cloud
                log.debug("cloud probe failed", exc_info=True)
                ok = False
            if ok:
                self._ready.set()
                return

    def stop(self) -> None:
        """Stop probing (returns at once; the thread ends after its current probe)."""
        self._stop.set()


def device_drafter(client: GenerationContext) -> object:
    """The drafter that decodes on the device: the client's standalone ``device_drafter`` when it has one (beside
    a draft head), else its drafter."""
    return client.drafter if client.device_drafter is None else client.device_drafter


def decode_unverified(client: GenerationContext, run: Run, sampling: SamplingParams,
                      until: Callable[[], bool] | None = None) -> Iterator[Chunk]:
    """The device-only decode loop, the one both device decoding and the device fallback run: the draft alone,
    one token at a time (its own distribution, the generation's sampling parameters and stopping rule), each
    token committed unverified (``run.num_unverified``, the route's ``"device"`` tokens) and streamed flagged
    ``verified=False``; until the generation finishes (``run.finish_reason`` set) or ``until()`` turns True
    after a token (at least one token per call: progress).

    Raises:
        InvalidRequestError: a grammar spec the draft's grammar engine refuses (structured output)."""
    decoder = DeviceDecoder(device_drafter(client))
    max_context = run.max_context_tokens or decoder.max_context_tokens
    if len(run.committed) >= max_context:
        run.finish_reason = FinishReason.CONTEXT
        return
    remaining = run.stopping.max_new_tokens - run.num_generated
    stop = StopChecker(client.tokenizer, dataclasses.replace(run.stopping, max_new_tokens=remaining),
                       decoder.eos_token_ids(), len(run.committed), max_context)
    while run.finish_reason is None:
        token = decoder.next_token(run.committed, sampling)
        _, reason = stop.append([token])
        tokens, reason = run.cut([token], reason)
        run.committed.extend(tokens)
        run.num_unverified += len(tokens)
        run.route.tokens["device"] += len(tokens)
        yield from run.out.push(tokens, verified=False)
        run.finish_reason = reason
        if reason is None and until is not None and until():
            return


def decode_on_device(client: GenerationContext, run: Run, sampling: SamplingParams,
                     error: BaseException) -> Iterator[Chunk]:
    """No verifier answers: with ``client.fallback == "device"`` decode with the draft alone
    (:func:`decode_unverified`) until a probe of the cloud succeeds or the generation finishes; yields the
    chunks of the tokens committed meanwhile (all unverified).

    Raises:
        ``error``: no device fallback (``client.fallback`` is "none", or the drafter cannot decode alone).
    """
    if client.fallback != "device" or not DeviceDecoder.supports(device_drafter(client)):
        raise error
    run.span_sessions(client.tokenizer)
    if not run.route.fallback:
        run.route.fallback = f"no verifier answers: {error}"
    log.info("no verifier answers (%s): decoding on the device with the draft model alone (unverified)",
             error)
    probe = CloudProbe(cloud_probe_fn(client.backend, client.reconnect_interval_s), client.reconnect_interval_s)
    try:
        yield from decode_unverified(client, run, sampling, until=lambda: probe.ready)
        if run.finish_reason is None:
            log.info("a verifier answers again: continuing verified (%d tokens were decoded on the device)",
                     run.num_unverified)
    finally:
        probe.stop()


def cloud_probe_fn(backend, reconnect_interval_s: float) -> Callable[[], bool]:
    """A probe for :class:`CloudProbe`: True when the cloud behind ``backend`` answers (the backend's ``probe``
    within min(2, ``reconnect_interval_s``) s, or its 2 s health check; always True for a backend that has
    neither: :func:`edge_client.transport.backend.answers`)."""
    timeout_s = min(2.0, reconnect_interval_s) if isinstance(backend, Probes) else 2.0
    return lambda: answers(backend, timeout_s)
