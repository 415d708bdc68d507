"""The edge client SDK: drafts on the device, sends draft blocks to a verifier, streams committed text.

    from specdec_runtime.edge_client.client import EdgeClient
    client = EdgeClient.connect("verifier.example:50051", draft_dir)      # or EdgeClient(backend, drafter, tok)
    for delta in client.stream("Why is the sky blue?", max_new_tokens=128):
        print(delta, end="", flush=True)
    print(client.last_result.stats.mean_accepted_length)

The client holds the settings and the parts (backend, drafter, tokenizer); the generation loop is
:mod:`edge_client.generation.loop` (sessions, re-opens, device fallback), a session's route
:mod:`edge_client.generation.routing`, the speculative step :mod:`edge_client.generation.speculative` (draft num_speculative_tokens (γ)
tokens from the committed prefix, send the block, commit the verdict's tokens: accepted prefix + recovered/bonus
token, stream the new text). The verifier applies the stopping rule, so the edge only ever streams committed
tokens, cut at the earliest stop. The speculation policy (γ per step, drafting ahead while a block is in flight) is
:mod:`edge_client.generation.policy`; the drafters and their contract are :mod:`edge_client.drafting.drafter`; the counters of a
generation are :mod:`edge_client.stats`; its state across sessions and its result are
:mod:`edge_client.generation.run`; the streamed chunks are :mod:`edge_client.output`; the prompt and the generation
options are :mod:`edge_client.request`; device fallback is :mod:`edge_client.generation.fallback`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

from specdec_runtime.common.errors import (InvalidRequestError)
from specdec_runtime.common.types import DEFAULT_DRAFT_TOP_K
from specdec_runtime.common.vocab import tokenizer_fingerprint
from specdec_runtime.edge_client.drafting.contract import Drafter
from specdec_runtime.edge_client.transport.backend import VerifierBackend
from specdec_runtime.edge_client.generation.run import GenerationResult
from specdec_runtime.edge_client.output import Chunk
from specdec_runtime.edge_client.generation.loop import generate
from specdec_runtime.edge_client.generation.route_cost import RouteEstimates
from specdec_runtime.edge_client.generation.routing import RouteSwitcher, check_route
from specdec_runtime.edge_client.request import check_generation_options, encode_prompt, generation_params

if TYPE_CHECKING:
    from specdec_runtime.edge_client.conversation import Conversation
    from specdec_runtime.edge_client.delivery.updater import DeliveredDraft

__all__ = ["EdgeClient", "GenerationResult", "Chunk", "encode_prompt"]


def _check_device_drafter(device_drafter):
    """``device_drafter`` when it decodes alone (or None). Raises TypeError otherwise."""
    from specdec_runtime.edge_client.drafting.contract import DecodesAlone

    if device_drafter is not None and not isinstance(device_drafter, DecodesAlone):
        raise TypeError(f"device_drafter must decode alone (a draft model: ModelDrafter), got "
                        f"{type(device_drafter).__name__}")
    return device_drafter


def _default_draft_prepared() -> bool:
    """Whether the default draft (``specdec models prepare``) is here."""
    from specdec_runtime.common.paths import ModelNotFoundError, resolve_draft_dir

    try:
        resolve_draft_dir(None)
    except ModelNotFoundError:
        return False
    return True


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
            (:class:`edge_client.generation.policy.AdaptiveNumSpeculativeTokens`).
        min_confidence: confidence truncation: stop a block early when the draft's top probability falls below
            it (llama.cpp's draft-p-min; done by the drafter, :meth:`edge_client.drafting.drafter.Drafter.propose`);
            0 disables.
        proactive: while a block is in flight, draft the next one assuming full acceptance and the bonus token
            the draft predicts; used at once when the verdict matches, dropped otherwise
            (:class:`edge_client.generation.policy.ProactiveBet`).
        bonus_drafted: whether sampled sessions send bonus_drafted blocks (``DraftBlock.bonus_drafted``; the
            rule and why it exists: :mod:`common.rejection`; cost: one more draft forward pass per block).
            None (default, "auto"): only where block ends depend on timing, i.e. a seeded sampled session with
            adaptive γ or proactive drafting on; other sessions use the classic bonus token. True: every
            sampled session. False: never; a seeded sampled session then turns adaptive γ and proactive
            drafting off. Greedy and drafter-invariant sessions always use the classic bonus token (their
            tokens depend on no schedule). Decided once per generation:
            :class:`edge_client.generation.plan.SessionPlan`.
        timeout_s: deadline of each verify step, s (at least the backend's ``max_call_s``: its retries).
        open_timeout_s: deadline of opening a session (includes the prefill of a long prompt), s.
        fallback: "none" (an unreachable cloud ends the generation with VerifierUnavailableError) or "device":
            decode with the draft model alone meanwhile, unverified (:mod:`edge_client.generation.fallback`), needs a draft
            model.
        reconnect_interval_s: during a device fallback, probe the cloud this often, s; once it answers, a new
            session (prompt: everything committed so far) goes on verified.
        route: "speculative" (default), "cloud", "device", "cloud-first" or "auto" (edge_client.generation.routing); a
            request's route= wins.
        route_switcher: decides switches between speculative and cloud decode within a session
            (:class:`edge_client.generation.routing.RouteSwitcher`); None = auto's cost model (:class:`CostModelSwitcher`).
        device_drafter: a standalone draft (a ModelDrafter) that decodes on the device (route="device", the
            device fallback) beside a ``drafter`` that cannot decode alone (a draft head,
            :class:`edge_client.drafting.head.HeadDrafter`); None = ``drafter`` decodes there.

    Resilience (:mod:`edge_client.transport.failover` does the retries of a call on other replicas): a session whose
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
            reconnect_interval_s <= 0. TypeError: ``drafter`` is not a :class:`Drafter` (no ``propose``), or
            ``device_drafter`` cannot decode alone.
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
        route_switcher: RouteSwitcher | None = None,
        device_drafter: Drafter | None = None,
    ):
        from specdec_runtime.edge_client.generation.fallback import FALLBACK_MODES

        if fallback not in FALLBACK_MODES:
            raise InvalidRequestError(f"fallback must be one of {', '.join(FALLBACK_MODES)}, got {fallback!r}")
        if not reconnect_interval_s > 0:
            raise InvalidRequestError(f"reconnect_interval_s must be > 0, got {reconnect_interval_s}")
        self.fallback = fallback
        self.reconnect_interval_s = reconnect_interval_s
        self.route, self.route_estimates = check_route(route), RouteEstimates()  # estimates outlive a generation
        self.route_switcher = route_switcher
        self.device_drafter = _check_device_drafter(device_drafter)
        if drafter is not None and not isinstance(drafter, Drafter):
            # A draft model handed over bare would fail deep in the loop (no propose) on the first generation.
            raise TypeError(f"drafter must be a Drafter (a propose() method), got {type(drafter).__name__}; "
                            "wrap a draft model in edge_client.drafting.drafter.ModelDrafter")
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
        # the verifier's delivered draft (edge_client.delivery.updater), set by connect; None = a local draft
        self.delivered: DeliveredDraft | None = None

    @property
    def draft_version(self) -> tuple[str, str]:
        """(name, version) of the delivered draft in use; ("", "") for a local one (sent with OpenSession)."""
        manifest = self.delivered.manifest if self.delivered is not None else None
        return (manifest.name, manifest.version) if manifest is not None else ("", "")

    def _take_new_draft(self) -> None:
        """Between generations: the verifier's newer draft version, when there is one (never mid-generation)."""
        if self.delivered is None:
            return
        parts = self.delivered.refresh()
        if parts is not None:
            if parts.drafter is not None:
                self.drafter = parts.drafter
            self.tokenizer, self.fingerprint = parts.tokenizer, tokenizer_fingerprint(parts.tokenizer)

    @classmethod
    def connect(
        cls, address: str | Sequence[str], draft_dir: str | Path | None = None, *,
        draft_top_k: int = DEFAULT_DRAFT_TOP_K, connect_timeout_s: float = 10.0, retry_policy=None,
        fallback: str = "none", tls: bool = False, root_certificates=None, api_key: str | None = None,
        certificate_chain=None, private_key=None, draft_prefix_cache_mb: float | None = None,
        delivery: bool | None = None, draft_name: str = "", draft_cache_dir: str | Path | None = None,
        draft_check_interval_s: float = 60.0, draft_progress=None, **kwargs,
    ) -> "EdgeClient":
        """Client for the verifiers at ``address`` with the ONNX draft at ``draft_dir`` (default draft), or the
        draft the verifier delivers.

        Args:
            address: "host:port", several ("host:port,host:port" or a list: tried in order, the first preferred)
                or one load balancer; calls that fail are retried on the next one
                (:class:`edge_client.transport.failover.FailoverBackend`).
            connect_timeout_s: connecting to one address, s (when ``retry_policy`` is None).
            retry_policy: :class:`edge_client.transport.failover.RetryPolicy` (default: its defaults).
            fallback: "none" or "device" (decode on the device alone while no verifier answers; then the
                client starts even when none answers now).
            tls: TLS channels (implied by ``root_certificates`` or a client certificate).
            root_certificates: PEM (bytes, text or file path) of the CA that signs the verifiers' certificates;
                None = the system's roots.
            api_key: sent as ``authorization: Bearer <key>`` on every call; None = ``$SPECDEC_API_KEY`` if set.
            certificate_chain, private_key: PEM client certificate and key (mutual TLS).
            draft_prefix_cache_mb: bound of the draft's prefix cache, MiB (KV of prompt prefixes reused by new
                sessions: :mod:`edge_client.drafting.prefix_cache`); None = DEFAULT_DRAFT_PREFIX_CACHE_MB, 0 = off.
            delivery: take the draft from the verifier (ResolveDraft / FetchDraft, :mod:`edge_client.delivery`):
                None (default) = when no ``draft_dir`` is given and no default draft is prepared here; True =
                always; False = never. Fetched once into ``draft_cache_dir`` (None: ``<specdec cache>/
                delivered-drafts``), every file checked against its SHA-256 (a wrong one is refused and fetched
                again); a newer version is taken at the start of a later generation, never in the middle of one
                (checked at most every ``draft_check_interval_s`` s). With ``route="cloud"`` only the tokenizer
                files are fetched and no draft runs. ``draft_name``: which draft ("" = the verifier's default);
                ``draft_progress(path, bytes_held, size)``: called per chunk written.
            **kwargs: :class:`EdgeClient` options.

        Raises:
            ModelNotFoundError: no draft at ``draft_dir``. VerifierUnavailableError: no verifier is reachable
            (with ``fallback="none"``). DraftNotFoundError: delivery, and the verifier offers no draft.
            DraftIntegrityError: a delivered file still wrong after its retries. InvalidRequestError: a malformed address. ValueError: a certificate
            file unreadable or not PEM.
        """
        from specdec_runtime.common.paths import default_model_paths, resolve_draft_dir
        from specdec_runtime.edge_client.transport.credentials import ChannelSecurity
        from specdec_runtime.edge_client.drafting.prefix_cache import DEFAULT_DRAFT_PREFIX_CACHE_MB
        from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
        from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
        from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

        policy = retry_policy or RetryPolicy(connect_timeout_s=connect_timeout_s)
        security = ChannelSecurity.of(tls=tls, root_certificates=root_certificates, api_key=api_key,
                                      certificate_chain=certificate_chain, private_key=private_key)
        mb = DEFAULT_DRAFT_PREFIX_CACHE_MB if draft_prefix_cache_mb is None else draft_prefix_cache_mb
        if delivery is None:
            delivery = draft_dir is None and not _default_draft_prepared()
        delivered = None
        if delivery:
            from specdec_runtime.edge_client.delivery import connect_delivery

            delivered, parts = connect_delivery(
                address, security, name=draft_name, cache_dir=draft_cache_dir,
                tokenizer_only=kwargs.get("route") == "cloud", draft_top_k=draft_top_k, prefix_cache_mb=mb,
                check_interval_s=draft_check_interval_s, progress=draft_progress)
            drafter, tokenizer = parts.drafter, parts.tokenizer
        else:
            model = OnnxDraftModel(resolve_draft_dir(draft_dir or default_model_paths().draft_dir))
            drafter, tokenizer = ModelDrafter(model, draft_top_k=draft_top_k, prefix_cache_mb=mb), model.tokenizer
        backend = FailoverBackend(address, policy=policy, connect=fallback == "none", security=security)
        client = cls(backend, drafter, tokenizer, fallback=fallback, **kwargs)
        client.delivered = delivered
        return client

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

    def stream_chunks(self, prompt: str | list[int], *, chat: bool = True, route: str | None = None,
                      **options) -> Iterator[Chunk]:
        """Generate; yield :class:`Chunk` (text, verified) as tokens are committed: ``verified`` is False for
        text decoded by the draft alone during a device fallback. Arguments and errors as :meth:`stream`:
        ``prompt`` text (with ``chat``: through the tokenizer's chat template) or token ids; ``route`` as the
        client's ``route`` (None: the client's); ``options``: the generation options of
        :func:`edge_client.request.generation_params`, with its defaults (max_new_tokens, temperature, top_k,
        top_p, seed, stop, stop_token_ids, ignore_eos, repetition_penalty, presence_penalty, frequency_penalty,
        logit_bias, min_tokens, min_p, logprobs, top_logprobs, grammar; logprobs end up in
        ``self.last_result.logprobs``)."""
        check_generation_options(options)
        self._take_new_draft()
        fallback = ""
        if self.delivered is not None and self.delivered.quarantine_reason and (route or self.route) != "device":
            route = "cloud"  # the verifier quarantined the draft: its acceptance fell below its baseline
            name, version = self.draft_version
            fallback = f"draft {name}@{version} quarantined by the verifier: {self.delivered.quarantine_reason}"
        sampling, stopping = generation_params(**options)
        prompt_ids = encode_prompt(self.tokenizer, prompt, chat) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise InvalidRequestError("empty prompt")
        yield from generate(self, prompt_ids, sampling, stopping, route=route, fallback=fallback)

    def chat(self, system: str | None = None, **defaults) -> "Conversation":
        """A multi-turn conversation that keeps its verifier session and both KV caches between turns
        (:class:`edge_client.conversation.Conversation`: ``send(message)`` streams a reply). ``system``: system
        message; ``defaults``: generation options of every turn (as :meth:`stream_chunks`)."""
        from specdec_runtime.edge_client.conversation import Conversation

        return Conversation(self, system, **defaults)

    def generate(self, prompt: str | list[int], **kwargs) -> GenerationResult:
        """Generate to the end; return text, token ids, finish reason and stats."""
        for _ in self.stream(prompt, **kwargs):
            pass
        assert self.last_result is not None
        return self.last_result

    def close(self) -> None:
        self.backend.close()
        if self.delivered is not None:
            self.delivered.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
