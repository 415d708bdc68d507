"""exp64 without torch (an edge install): numpy's exp, element for element, within an ulp of torch's kernel, so
the edge's logits processing gives the verifier's probabilities up to rounding."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_runtime.common import logits as common_logits
from specdec_runtime.common.logits import exp64, logits_to_probs
from specdec_runtime.common.types import SamplingParams


@pytest.fixture
def no_torch(monkeypatch):
    monkeypatch.setattr(common_logits, "_torch", lambda: None)


def test_numpy_exp_is_element_for_element(no_torch):
    x = np.random.default_rng(8).normal(-20.0, 15.0, size=(5, 4099))
    x[0, :7] = [0.0, -745.2, -746.0, 709.0, -np.inf, 1e-300, -1e-300]
    full = exp64(x)
    np.testing.assert_allclose(full, np.exp(x), rtol=0, atol=0)
    flat = x.ravel()
    for offset, size in ((0, 1), (3, 5), (7, 17), (1, 4099), (4098, 4100), (13, 9000)):
        np.testing.assert_array_equal(exp64(flat[offset:offset + size].copy()).view(np.uint64),
                                      full.ravel()[offset:offset + size].view(np.uint64))
    out = x.copy()
    assert exp64(out, out=out) is out
    np.testing.assert_array_equal(out.view(np.uint64), full.view(np.uint64))


def test_probabilities_match_the_torch_path_up_to_rounding(monkeypatch):
    pytest.importorskip("torch")
    logits = np.random.default_rng(3).normal(0.0, 3.0, size=(4, 49152)).astype(np.float32)
    for params in (SamplingParams(0.7, 0, 1.0, 1), SamplingParams(1.0, 50, 0.9, 1), SamplingParams(0.5, 0, 0.95, 1)):
        with_torch = logits_to_probs(logits, params)
        monkeypatch.setattr(common_logits, "_torch", lambda: None)
        without = logits_to_probs(logits, params)
        monkeypatch.undo()
        np.testing.assert_allclose(without, with_torch, rtol=1e-14, atol=1e-300)
