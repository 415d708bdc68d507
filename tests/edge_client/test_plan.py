"""The session plan (edge_client/generation/plan.py): each regime decided once, from the request and the client's
drafting settings. Every case is checked against the rule it rests on (the module docstring); the invariant case
is the one where the plan used to disagree with the verifier (an extra draft step per block for nothing)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from specdec_runtime.common.types import SamplingParams
from specdec_runtime.edge_client.generation.plan import SessionPlan, plan_generation


@dataclass
class Settings:
    """A client's drafting settings (the fields plan_generation reads of a GenerationContext)."""

    drafter: object = "draft"
    adaptive: bool = True
    proactive: bool = False
    bonus_drafted: bool | None = None


SAMPLED = dict(temperature=1.0, top_k=20)


@pytest.mark.parametrize("route, sampling, settings, expected", [
    # greedy: no regime, whatever the seed and route
    ("auto", SamplingParams(seed=3), Settings(), SessionPlan(seeded=True, adaptive=True)),
    # unseeded sampled: nothing to reproduce
    ("speculative", SamplingParams(**SAMPLED), Settings(proactive=True), SessionPlan(adaptive=True, proactive=True)),
    # seeded sampled Algorithm 1 with adaptive γ: bonus_drafted blocks keep the tokens schedule-free
    ("speculative", SamplingParams(**SAMPLED, seed=3), Settings(),
     SessionPlan(seeded=True, bonus_drafted=True, adaptive=True)),
    # ... and without them (the client refuses them): a timing-free schedule
    ("speculative", SamplingParams(**SAMPLED, seed=3), Settings(proactive=True, bonus_drafted=False),
     SessionPlan(seeded=True, timing_free=True)),
    # ... with neither adaptive γ nor proactive drafting: the classic bonus token is as reproducible
    ("speculative", SamplingParams(**SAMPLED, seed=3), Settings(adaptive=False),
     SessionPlan(seeded=True, timing_free=True)),
    # seeded sampled on a route with timing-dependent switch points: drafter-invariant, no extra draft step
    ("auto", SamplingParams(**SAMPLED, seed=3), Settings(proactive=True),
     SessionPlan(seeded=True, drafter_invariant=True, adaptive=True, proactive=True)),
    ("cloud-first", SamplingParams(**SAMPLED, seed=3), Settings(bonus_drafted=True),
     SessionPlan(seeded=True, drafter_invariant=True, adaptive=True)),
    # asked for on the speculative route
    ("speculative", SamplingParams(**SAMPLED, seed=3, drafter_invariant=True), Settings(),
     SessionPlan(seeded=True, drafter_invariant=True, adaptive=True)),
    # refused on auto: Algorithm 1 with bonus_drafted blocks
    ("auto", SamplingParams(**SAMPLED, seed=3, drafter_invariant=False), Settings(),
     SessionPlan(seeded=True, bonus_drafted=True, adaptive=True)),
    # no drafter: no bonus_drafted blocks, no drafting ahead
    ("speculative", SamplingParams(**SAMPLED, seed=3), Settings(drafter=None, proactive=True),
     SessionPlan(seeded=True, timing_free=True)),
])
def test_each_regime_is_decided_once(route, sampling, settings, expected):
    sent, plan = plan_generation(settings, sampling, route)
    assert plan == expected
    assert sent.drafter_invariant is (expected.drafter_invariant or bool(sampling.drafter_invariant))
    assert sent.seed == sampling.seed  # the plan never picks a seed: the verifier does, for an unseeded request


def test_the_plan_is_frozen():
    _, plan = plan_generation(Settings(), SamplingParams(**SAMPLED, seed=1), "speculative")
    with pytest.raises(AttributeError):
        plan.adaptive = False
