"""cloud_verifier.verdict.numerics called directly: each fault's reason, the guarded verdict equal to the rejection
rule's when the logits are fine, the error's message and the ``specdec_nonfinite_logits_total`` count, and the
``bonus_drafted`` exception to the "next token in the vocabulary" check. Pure numpy (no model): the end-to-end
behaviour of a fault (one row fails alone, INTERNAL over gRPC) is test_numerics.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import REGISTRY

from specdec_runtime.cloud_verifier.verdict.numerics import logits_fault, verify_row
from specdec_runtime.common.errors import TargetOutputError
from specdec_runtime.common.rejection import RejectionResult, verify_block
from specdec_runtime.common.types import DraftBlock, SamplingParams

V = 16


def nonfinite_count() -> float:
    return REGISTRY.get_sample_value("specdec_nonfinite_logits_total") or 0.0


def test_logits_fault_reasons():
    ok = np.zeros((2, V), np.float32)
    assert logits_fault(ok) is None and logits_fault(ok, V) is None and logits_fault(ok, V + 5) is None
    for value, reason in ((np.nan, "NaN logits"), (np.inf, "+inf logits")):
        x = ok.copy()
        x[1, 3] = value
        assert logits_fault(x) == reason
        assert logits_fault(x, valid_vocab_size=4) == reason  # column 3 is a token
        assert logits_fault(x, valid_vocab_size=3) is None  # column 3 is padding: ignored
    both = ok.copy()
    both[0, 1], both[1, 2] = np.inf, np.nan
    assert logits_fault(both) == "NaN logits"  # NaN is named first
    x = ok.copy()
    x[0, :] = -np.inf
    assert logits_fault(x) == "a position with no finite logit"
    x[0, V - 1] = 0.0  # one finite logit, but only in the padding
    assert logits_fault(x) is None
    assert logits_fault(x, valid_vocab_size=V - 1) == "a position with no finite logit"
    some = ok.copy()
    some[:, ::2] = -np.inf  # masked tokens, every row still has finite logits
    assert logits_fault(some) is None and logits_fault(some[0]) is None


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=5)])
def test_fine_logits_give_the_rejection_rules_verdict(sampling):
    rng = np.random.default_rng(3)
    before = nonfinite_count()
    for trial in range(30):
        logits = rng.normal(size=(3, V)).astype(np.float32)
        logits[:, V - 2:] = 50.0  # padding columns with the largest logits: never chosen
        block = DraftBlock([int(rng.integers(V - 2)), int(rng.integers(V - 2))])
        got = verify_row(block, logits, sampling.seeded(100 + trial), 9, V - 2)
        assert got == verify_block(block, logits, sampling.seeded(100 + trial), 9, V - 2)
        assert 0 <= got.next_token_id < V - 2
    assert nonfinite_count() == before


@pytest.mark.parametrize("kind, reason", [("nan", "NaN logits"), ("posinf", r"\+inf logits"),
                                          ("allneginf", "a position with no finite logit")])
def test_fault_raises_and_counts(kind, reason):
    logits = np.zeros((2, V), np.float32)
    logits[1] = {"nan": np.nan, "posinf": np.inf, "allneginf": -np.inf}[kind]
    before = nonfinite_count()
    with pytest.raises(TargetOutputError, match=(
            rf"^the target produced unusable logits for session s-7: {reason}; nothing was committed, and the "
            r"session's KV cache is rebuilt before its next block$")):
        verify_row(DraftBlock([1]), logits, SamplingParams(temperature=0.5).seeded(1), 4, V, session_id="s-7")
    assert nonfinite_count() == before + 1


def test_no_distribution_after_processing_is_a_fault():
    logits = np.random.default_rng(0).normal(size=(2, V)).astype(np.float32) * 1e3
    before = nonfinite_count()
    with pytest.raises(TargetOutputError, match=r"no distribution to sample from after logits processing \("):
        verify_row(DraftBlock([3]), logits, SamplingParams(temperature=1e-310).seeded(11), 7, V)
    assert nonfinite_count() == before + 1


def test_vocabulary_edges_are_tokens():
    """Token 0 and token valid_vocab_size - 1 are tokens (the "token outside the vocabulary" guard lets them
    through); verify_block never returns an id past valid_vocab_size, so that guard's raise is defensive."""
    for winner in (0, 5):
        logits = np.zeros((1, V), np.float32)
        logits[0, winner] = 1.0
        logits[0, 6:] = 9.0  # padding
        assert verify_row(DraftBlock([]), logits, SamplingParams().seeded(0), 0, 6) == RejectionResult(0, winner)
        one_hot = np.full((1, V), -np.inf, np.float32)
        one_hot[0, winner] = 0.0
        assert verify_row(DraftBlock([]), one_hot, SamplingParams(temperature=1.0).seeded(3), 0, 6) == \
            RejectionResult(0, winner)


def test_bonus_drafted_full_block_is_not_a_fault():
    """-1 is the verdict's token only after a bonus_drafted block accepted whole; anywhere else it is a fault."""
    logits = np.full((2, V), -5.0, np.float32)
    logits[0, 3] = logits[1, 4] = 5.0
    assert verify_row(DraftBlock([3, 4], bonus_drafted=True), logits, SamplingParams().seeded(0), 0, V) == \
        RejectionResult(2, -1)
    assert verify_row(DraftBlock([3, 7], bonus_drafted=True), logits, SamplingParams().seeded(0), 0, V) == \
        RejectionResult(1, 4)
    assert verify_row(DraftBlock([3, 4], bonus_drafted=True), logits, SamplingParams(temperature=0.01).seeded(0), 0, V) \
        == RejectionResult(2, -1)


def test_padding_faults_are_not_the_rows_faults():
    """NaN / +inf in the padded columns (ids >= valid_vocab_size) do not make a row unusable."""
    logits = np.zeros((2, V), np.float32)
    logits[0, 3] = 2.0
    logits[:, V - 2] = np.nan
    logits[:, V - 1] = np.inf
    assert verify_row(DraftBlock([3]), logits, SamplingParams().seeded(0), 0, V - 2) == RejectionResult(1, 0)
    with pytest.raises(TargetOutputError, match="NaN logits"):
        verify_row(DraftBlock([3]), logits, SamplingParams().seeded(0), 0, V - 1)


def test_guard_emits_no_numpy_warnings():
    """The overflow of logits / temperature is a fault (raised), not a RuntimeWarning on the way."""
    import warnings

    logits = np.random.default_rng(0).normal(size=(2, V)).astype(np.float32) * 1e3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TargetOutputError, match="no distribution"):
            verify_row(DraftBlock([3]), logits, SamplingParams(temperature=1e-310).seeded(11), 7, V)


def test_fault_message_without_a_session_id():
    logits = np.full((1, V), np.nan, np.float32)
    with pytest.raises(TargetOutputError, match="^the target produced unusable logits for session : NaN logits;"):
        verify_row(DraftBlock([]), logits, SamplingParams().seeded(0), 0, V)
