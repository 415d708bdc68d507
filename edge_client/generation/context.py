"""What the generation loop reads of the client that runs it: :class:`GenerationContext`.

:class:`edge_client.client.EdgeClient` is the one implementation. The loop's modules
(:mod:`edge_client.generation.loop`, :mod:`edge_client.generation.speculative`, :mod:`edge_client.generation.routing`,
:mod:`edge_client.generation.fallback`, :mod:`edge_client.generation.route_cost`, :mod:`edge_client.conversation`) type their ``client``
argument with this protocol, so none of them imports the client: the SDK's face stands above its loop.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["GenerationContext"]


class GenerationContext(Protocol):
    """The settings and parts of one client (see :class:`edge_client.client.EdgeClient` for each one's meaning).

    Attributes:
        backend: the verifier (:class:`edge_client.transport.backend.VerifierBackend`).
        drafter: the drafter, or None (target-only decoding: empty blocks).
        tokenizer: the draft's tokenizer; ``fingerprint`` its fingerprint (checked at session open).
        num_speculative_tokens: γ, draft tokens per block (the largest γ when ``adaptive``).
        adaptive, min_confidence, proactive, bonus_drafted: the speculation policy.
        timeout_s, open_timeout_s: deadlines of a verify step and of opening a session, s.
        fallback, reconnect_interval_s: device fallback ("none" | "device") and its cloud probe interval, s.
        device_drafter: the standalone draft that decodes on the device (route=device, the device fallback)
            instead of ``drafter`` (beside a draft head, which cannot decode alone); None: ``drafter``.
        route: the default route; ``route_estimates``: the measured costs of the routes
            (:class:`edge_client.generation.route_cost.RouteEstimates`, kept across generations); ``route_switcher`` what
            decides switches within a session (:class:`edge_client.generation.routing.RouteSwitcher`; None = auto's).
        last_result: the last generation's :class:`edge_client.generation.run.GenerationResult` (set by the loop).
    """

    backend: object
    drafter: object
    tokenizer: object
    fingerprint: str
    num_speculative_tokens: int
    adaptive: bool
    min_confidence: float
    proactive: bool
    bonus_drafted: bool | None
    timeout_s: float
    open_timeout_s: float
    fallback: str
    reconnect_interval_s: float
    device_drafter: object
    route: str
    route_estimates: object
    route_switcher: object
    last_result: object
