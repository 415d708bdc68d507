"""How one generation's sessions run, decided once: :class:`SessionPlan` (made by :func:`plan_generation` at the
generation's start and passed down to the route, the speculative segment and the draft's prefill).

Which regime a sampled generation is in decides what the edge may do with timing (docs/architecture.md, "What a
seed guarantees"):

- **drafter-invariant** (``SamplingParams.drafter_invariant``; Daliri, Musco & Suresh 2024): every committed token
  is the target's own draw at its position, whatever was drafted, so nothing the edge schedules changes the
  output. Decided here when the request leaves it None: on for a seeded sampled ``auto``, ``cloud-first`` or
  ``cloud`` generation (their switch points depend on timing), off otherwise (Algorithm 1 accepts more).
- **bonus_drafted blocks** (``DraftBlock.bonus_drafted``; :mod:`common.rejection`): an Algorithm-1 session whose
  tokens must not depend on where its blocks end (a seeded one with adaptive γ or proactive drafting) drafts one
  token more per block, at the bonus position. A drafter-invariant session never needs them: the extra draft
  step per block would buy nothing.
- **timing-free schedule**: a seeded Algorithm-1 session without bonus_drafted blocks keeps a schedule that no
  timing decides: a fixed γ, no proactive drafting, and a draft prefill fed in whole chunks only. The verifier
  keeps the matching rule (it never cuts such a session's classic blocks: cloud_verifier/verify_policy).

Greedy generations are in none of these regimes: their tokens are the target's argmax whatever the schedule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specdec_runtime.common.types import SamplingParams
from specdec_runtime.edge_client.generation.context import GenerationContext

__all__ = ["SessionPlan", "plan_generation"]

# routes whose switch points between cloud decode and speculation depend on timing (and the cloud route, so that
# its tokens are those of the others): a seeded sampled generation on them is drafter-invariant unless asked not
INVARIANT_ROUTES = ("auto", "cloud-first", "cloud")


@dataclass(frozen=True)
class SessionPlan:
    """The regime of one generation's sessions (module docstring); every field is decided by
    :func:`plan_generation` and read, never re-derived, by the code below it.

    Attributes:
        seeded: the request fixed the seed (``SamplingParams.seed`` was given, not picked by the verifier).
        drafter_invariant: the drafter-invariant rule (the value sent in ``SamplingParams.drafter_invariant``).
        bonus_drafted: blocks carry a draft token at the bonus position (γ + 1 draft tokens per block).
        timing_free: the session's tokens would depend on its schedule: fixed γ, no proactive drafting, a draft
            prefill in whole chunks.
        adaptive: adaptive γ runs (the client's setting, unless ``timing_free``).
        proactive: drafting ahead while a block is in flight runs (the client's setting and a drafter, unless
            ``timing_free``).
    """

    seeded: bool = False
    drafter_invariant: bool = False
    bonus_drafted: bool = False
    timing_free: bool = False
    adaptive: bool = False
    proactive: bool = False


def plan_generation(client: GenerationContext, sampling: SamplingParams,
                    route: str) -> tuple[SamplingParams, SessionPlan]:
    """The generation's plan, and ``sampling`` with ``drafter_invariant`` decided (the module docstring).

    Args:
        client: the client's drafting settings (``drafter``, ``adaptive``, ``proactive``, ``bonus_drafted``).
        sampling: the request's checked parameters; ``seed`` is the request's (None: not fixed).
        route: the route requested ("speculative" | "cloud" | "cloud-first" | "device" | "auto").
    """
    seeded = sampling.seed is not None
    sampled_seeded = seeded and not sampling.greedy
    invariant = sampling.drafter_invariant
    if invariant is None:
        invariant = sampled_seeded and route in INVARIANT_ROUTES
    sampling = dataclasses.replace(sampling, drafter_invariant=bool(invariant))
    invariant = bool(invariant) and not sampling.greedy  # greedy verification reads no draws
    bonus_drafted = _uses_bonus_drafted(client, sampling, sampled_seeded, invariant)
    timing_free = sampled_seeded and not invariant and not bonus_drafted
    return sampling, SessionPlan(
        seeded=seeded, drafter_invariant=invariant, bonus_drafted=bonus_drafted, timing_free=timing_free,
        adaptive=bool(client.adaptive) and not timing_free,
        proactive=bool(client.proactive) and client.drafter is not None and not timing_free)


def _uses_bonus_drafted(client: GenerationContext, sampling: SamplingParams, sampled_seeded: bool,
                        invariant: bool) -> bool:
    """bonus_drafted blocks: a sampled Algorithm-1 session with a drafter, when the client asks for them
    (``bonus_drafted=True``), or when it leaves it to us (None) and the seed is fixed and the schedule depends on
    timing (adaptive γ or proactive drafting): elsewhere the classic bonus token is as reproducible and saves a
    draft step per block."""
    if sampling.greedy or invariant or client.drafter is None or client.bonus_drafted is False:
        return False
    if client.bonus_drafted is None:
        return sampled_seeded and bool(client.adaptive or client.proactive)
    return True
