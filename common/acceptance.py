"""Expected tokens of one verify step from per-position acceptance: the one formula that adaptive γ on the edge
(:mod:`edge_client.generation.policy`), the route's cost model (:mod:`edge_client.generation.route_cost`) and the
verifier's verify policy (:mod:`cloud_verifier.verify_policy.policy`) all use.

With α_i the probability that block position i (0-based) is accepted given every position before it was, position
k is accepted with probability Π_{i≤k} α_i (:func:`survival`), and a block of γ positions commits

    E[tokens | γ] = 1 + Σ_{k<γ} Π_{i≤k} α_i        (:func:`expected_tokens`)

tokens: its accepted prefix plus the one token the verifier adds (recovered or bonus). For i.i.d. α this is
Leviathan et al. 2023, eq. 1: (1 − α^(γ+1)) / (1 − α).
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["expected_tokens", "survival"]


def survival(acceptance: Sequence[float]) -> list[float]:
    """[γ] the probability that each position is accepted, Π_{i≤k} α_i (each α clipped to [0, 1])."""
    out, alive = [], 1.0
    for alpha in acceptance:
        alive *= min(max(float(alpha), 0.0), 1.0)
        out.append(alive)
    return out


def expected_tokens(acceptance: Sequence[float]) -> float:
    """E[tokens committed by a verify step] over positions with conditional acceptance ``acceptance`` [γ], tokens
    (1 for an empty block: the verifier's own token)."""
    return 1.0 + sum(survival(acceptance))
