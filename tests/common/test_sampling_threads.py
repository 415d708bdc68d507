"""common.sampling from several threads: the top-p fast path keeps per-thread scratch buffers (a key buffer and
a ramp of negative ids, threading.local), and the verifier's target thread, the edge's drafting thread and
test threads all call it. Each thread starts with empty scratch and with vocabularies of different sizes one
after another; the result must equal the full-sort reference (specdec.logits_reference.logits_to_probs_reference)
every time.
"""

from __future__ import annotations

import threading

import numpy as np

from specdec_runtime.common.sampling import logits_to_probs
from specdec_runtime.common.types import SamplingParams
from specdec.logits_reference import logits_to_probs_reference


def _rows(vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=3.0, size=(3, vocab))
    logits[:, ::7] = -np.inf  # zero-probability tokens: the ramp keys them apart
    return logits


def _check(vocab: int, seed: int) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9)
    logits = _rows(vocab, seed)
    np.testing.assert_array_equal(logits_to_probs(logits, params), logits_to_probs_reference(logits, params))


def test_top_p_in_fresh_threads_and_changing_vocabularies():
    errors: list[BaseException] = []

    def work(sizes):
        try:
            for i, vocab in enumerate(sizes):
                _check(vocab, seed=vocab + i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    for sizes in ([300, 300], [500, 300, 500], [1000]):
        t = threading.Thread(target=work, args=(sizes,))
        t.start()
        t.join(60)
        assert not t.is_alive()
    assert errors == []
    for vocab in (700, 300, 700):  # and in this thread, whatever it did before
        _check(vocab, seed=vocab)
