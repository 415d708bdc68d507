"""The one expected-tokens formula (common/acceptance.py), against Leviathan et al.'s closed form and a direct
simulation of blocks with per-position acceptance."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_runtime.common.acceptance import expected_tokens, survival


@pytest.mark.parametrize("alpha, gamma", [(0.0, 4), (0.3, 1), (0.7, 5), (0.99, 8), (1.0, 6)])
def test_iid_acceptance_is_leviathan_eq_1(alpha, gamma):
    closed = gamma + 1.0 if alpha == 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    assert expected_tokens([alpha] * gamma) == pytest.approx(closed, rel=1e-12)


def test_per_position_acceptance_matches_a_simulation():
    alphas = [0.9, 0.6, 0.8, 0.3]
    rng = np.random.default_rng(0)
    accepted = np.cumprod(rng.random((200_000, len(alphas))) < alphas, axis=1)  # a rejection ends the block
    simulated = 1 + accepted.sum(axis=1).mean()
    assert expected_tokens(alphas) == pytest.approx(simulated, abs=0.01)
    assert survival(alphas) == pytest.approx(accepted.mean(axis=0), abs=0.01)
    # negative control: position-independent acceptance at the mean α is another number
    assert abs(expected_tokens([np.mean(alphas)] * 4) - simulated) > 0.05


def test_empty_block_and_clipping():
    assert expected_tokens([]) == 1.0
    assert survival([1.5, -0.2, 0.5]) == [1.0, 0.0, 0.0]
