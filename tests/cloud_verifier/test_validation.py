"""cloud_verifier.session.validation called directly, check by check, at each check's boundary.

The wire-level tests (test_contract.py) show each refusal over gRPC with its status code; these call the
functions in-process on real objects (a real ``Session``: its store record, a ``SessionKV`` whose limit is
``capacity`` tokens, a ``StopChecker``) so that every comparison is pinned at its edge — one past the limit
refused, the limit itself accepted — and each check's message names what failed. They run in well under a
second, which keeps ``scripts/mutation.sh`` (mutation testing of the core) within its time budget.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from specdec_runtime.cloud_verifier.session import validation as val
from specdec_runtime.cloud_verifier.session.table import Session
from specdec_runtime.cloud_verifier.store import SessionRecord
from specdec_runtime.cloud_verifier.kv.pool import SessionKV
from specdec_runtime.common.errors import InvalidRequestError, PreconditionError
from specdec_runtime.common.stopping import StopChecker
from specdec_runtime.common.types import (DraftBlock, FinishReason, SamplingParams, ServedInfo, SparseDraftProbs,
                          StoppingCriteria)

VOCAB = 100  # valid vocabulary (ids 0..99)
PADDED = 128  # width of the target's logits (ids 100..127 are padding, not tokens)
INFO = ServedInfo(model_id="m", tokenizer_fingerprint="abcd", max_context_tokens=64,
                  max_num_speculative_tokens=4, vocab_size=PADDED, verifier_id="v", ttl_s=60)
PROMPT = [1, 2, 3]


def make_session(*, committed=(1, 2, 3, 7), last_seq=2, capacity=16, finished=False, busy=False) -> Session:
    record = SessionRecord(session_id="s1", verifier_id="v", model_id="m", prompt_length=3,
                           committed_token_ids=list(committed), sampling=SamplingParams(temperature=0.8, top_k=4),
                           stopping=StoppingCriteria(max_new_tokens=12, ignore_eos=True), seed=5, created_at=0.0,
                           last_seen_at=0.0, finished=finished, last_seq=last_seq,
                           finish_reason=FinishReason.LENGTH if finished else None)
    stop = StopChecker(None, record.stopping, eos_token_ids=(), prompt_length=3, max_context_tokens=64)
    kv = SessionKV(capacity)  # a limit only: validation reads no KV
    return Session(record=record, kv=kv, stop=stop, busy=busy)


def sparse(rows) -> SparseDraftProbs:
    return SparseDraftProbs(np.asarray([r[0] for r in rows], dtype=np.int64),
                            np.asarray([r[1] for r in rows], dtype=np.float32))


def refused(fn, *args, error=InvalidRequestError, match: str):
    with pytest.raises(error, match=match):
        fn(*args)


# ---------------------------------------------------------------------------------------------- token ids


def test_check_token_ids_boundaries():
    val.check_token_ids([], "draft", VOCAB)
    val.check_token_ids([0, VOCAB - 1], "draft", VOCAB)
    with pytest.raises(InvalidRequestError) as e:
        val.check_token_ids([5, VOCAB, 6], "draft", VOCAB)
    assert str(e.value) == f"draft token id {VOCAB} is outside the vocabulary [0, {VOCAB})"
    with pytest.raises(InvalidRequestError) as e:
        val.check_token_ids([3, -1], "prompt", VOCAB)
    assert str(e.value) == f"prompt token id -1 is outside the vocabulary [0, {VOCAB})"
    # the first offending id is named, whichever side it is on
    with pytest.raises(InvalidRequestError, match="token id 200 "):
        val.check_token_ids([200, -7], "draft", VOCAB)


# ---------------------------------------------------------------------------------------------- OpenSession


def check_open(prompt=PROMPT, sampling=SamplingParams(), stopping=StoppingCriteria(), fingerprint="abcd"):
    val.check_open_request(list(prompt), sampling, stopping, fingerprint, INFO, VOCAB)


def test_check_open_request_accepts_the_boundaries():
    check_open()
    check_open(prompt=[0] * (INFO.max_context_tokens - 1))  # one token of room
    check_open(sampling=SamplingParams(temperature=val.MIN_TEMPERATURE))
    check_open(sampling=SamplingParams(temperature=0.0))
    check_open(fingerprint="")  # "" = not checked
    val.check_open_request(PROMPT, SamplingParams(), StoppingCriteria(), "ffff",
                           ServedInfo(**{**INFO.__dict__, "tokenizer_fingerprint": ""}), VOCAB)


@pytest.mark.parametrize("kw, error, message", [
    ({"prompt": []}, InvalidRequestError, "empty prompt: at least one token id is needed"),
    ({"prompt": [1, VOCAB]}, InvalidRequestError, f"prompt token id {VOCAB} is outside the vocabulary"),
    ({"prompt": [0] * 64}, InvalidRequestError, "prompt of 64 tokens leaves no room in the context of 64 tokens"),
    ({"sampling": SamplingParams(temperature=-1.0)}, InvalidRequestError, "temperature must be >= 0"),
    ({"sampling": SamplingParams(temperature=1e-31)}, InvalidRequestError, "temperature 1e-31 is below 1e-30"),
    ({"stopping": StoppingCriteria(max_new_tokens=0)}, InvalidRequestError, "max_new_tokens must be >= 1"),
    ({"fingerprint": "0000"}, PreconditionError, "tokenizer fingerprint 0000 does not match the target's abcd"),
])
def test_check_open_request_refuses(kw, error, message):
    with pytest.raises(error) as e:
        check_open(**kw)
    assert str(e.value).startswith(message), str(e.value)
    assert type(e.value) is error


# ---------------------------------------------------------------------------------------------- block position


def test_session_ready():
    val.check_session_ready(make_session())
    refused(val.check_session_ready, make_session(finished=True), error=PreconditionError,
            match=r"^session s1 already finished \(length\)$")
    finished_by_stop = make_session()
    finished_by_stop.stop.finished, finished_by_stop.stop.finish_reason = True, FinishReason.EOS
    refused(val.check_session_ready, finished_by_stop, error=PreconditionError,
            match=r"^session s1 already finished \(eos\)$")
    refused(val.check_session_ready, make_session(busy=True), match="^session s1 already has a block in flight$")


def test_block_position_seq_is_last_plus_one():
    session = make_session(last_seq=2)
    val.check_block_position(session, 3, 4)
    for seq in (0, 1, 2, 4, 5, 1000):
        refused(val.check_block_position, session, seq, 4,
                match=rf"^block seq {seq} is not the last seq 2 \+ 1 \(seq increases by one per block\)$")
    val.check_block_position(make_session(last_seq=0), 1, 4)  # a new session's first block


def test_block_position_committed_length():
    session = make_session()
    for length in (3, 5):
        refused(val.check_block_position, session, 3, length,
                match=f"^block extends committed length {length}, but session s1 has 4$")


def test_block_length_boundaries():
    val.check_block_length(4, 12, 16, 4)  # the longest block, ending exactly at the capacity
    val.check_block_length(0, 16, 16, 4)
    refused(val.check_block_length, 5, 0, 16, 4, match="^block of 5 tokens is longer than the maximum 4$")
    refused(val.check_block_length, 4, 13, 16, 4,
            match=r"^block of 4 tokens at committed length 13 passes the session's limit of 16 tokens "
                  r"\(max_new_tokens / context\)$")


# ---------------------------------------------------------------------------------------------- draft_probs


def block_with(ids, rows) -> DraftBlock:
    return DraftBlock(list(ids), sparse(rows))


def test_draft_probs_accepted_at_the_boundaries():
    tol = val.PROB_SUM_TOLERANCE
    val.check_draft_probs(block_with([5, 9], [([5, 6], [0.5, 0.5]), ([PADDED - 1, 9], [0.0, 1.0])]), PADDED)
    val.check_draft_probs(block_with([0], [([0, 1], [1.0 - 0.9 * tol, 0.0])]), PADDED)  # sum within tolerance
    val.check_draft_probs(block_with([0], [([0, 1], [0.5, 0.5 + 0.9 * tol])]), PADDED)
    empty = SparseDraftProbs(np.zeros((0, 2), np.int64), np.zeros((0, 2), np.float32))
    val.check_draft_probs(DraftBlock([], empty), PADDED)


@pytest.mark.parametrize("ids, rows, message", [
    ([5, 6], [([5, 6], [0.5, 0.5])], r"^draft_probs must have one sparse distribution per draft token \(2\), "
                                     r"got shape \(1, 2\) \(need one per token"),
    ([5], [([5, 6], [0.5, 0.5])] * 2, r"per draft token \(1\), got shape \(2, 2\)"),
    ([5], [([5, PADDED], [0.5, 0.5])], "^draft_probs token id outside the vocabulary$"),
    ([5], [([5, -1], [0.5, 0.5])], "^draft_probs token id outside the vocabulary$"),
    ([5], [([5, 6], [1.5, -0.5])], "^draft_probs are not a distribution: negative or non-finite values$"),
    ([5], [([5, 6], [math.nan, 1.0])], "^draft_probs are not a distribution: negative or non-finite values$"),
    ([5], [([5, 6], [math.inf, 0.0])], "^draft_probs are not a distribution: negative or non-finite values$"),
    ([5], [([5, 6], [0.5, 0.5 + 1.2 * val.PROB_SUM_TOLERANCE])], r"^draft_probs are not a distribution: rows sum "
                                                                 r"to \[1\.0012\]$"),
    ([5], [([5, 6], [0.5, 0.5 - 1.2 * val.PROB_SUM_TOLERANCE])], r"rows sum to \[0\.9988\]$"),
    ([5, 6], [([5, 6], [0.5, 0.5]), ([5, 5], [0.5, 0.5])], "^draft_probs row 1 repeats a token id$"),
    ([5, 7], [([5, 6], [0.5, 0.5]), ([5, 6], [0.5, 0.5])], "^draft token 7 at block position 1 has draft "
                                                          "probability 0$"),
    ([6], [([5, 6], [1.0, 0.0])], "^draft token 6 at block position 0 has draft probability 0$"),
])
def test_draft_probs_refused(ids, rows, message):
    with pytest.raises(InvalidRequestError, match=message):
        val.check_draft_probs(block_with(ids, rows), PADDED)


def test_draft_probs_ndim():
    """Rows of one dimension (a flat list) are not [γ, k]."""
    block = DraftBlock([5], SparseDraftProbs(np.asarray([5], dtype=np.int64), np.asarray([1.0], np.float32)))
    refused(val.check_draft_probs, block, PADDED, match=r"got shape \(1,\) ")


# ---------------------------------------------------------------------------------------------- validate_block


def test_validate_block_runs_every_check_in_order():
    info = INFO
    ok = block_with([5, 6], [([5, 6], [0.5, 0.5]), ([6, 7], [0.5, 0.5])])
    val.validate_block(make_session(), 3, 4, ok, info, VOCAB)
    val.validate_block(make_session(), 3, 4, DraftBlock([5, 6]), info, VOCAB)  # greedy: no draft_probs
    cases = [
        (make_session(finished=True), 9, 0, DraftBlock([VOCAB] * 9), PreconditionError, "already finished"),
        (make_session(busy=True), 9, 0, DraftBlock([VOCAB] * 9), InvalidRequestError, "in flight"),
        (make_session(), 9, 0, DraftBlock([VOCAB] * 9), InvalidRequestError, "committed length"),
        (make_session(), 9, 4, DraftBlock([VOCAB] * 9), InvalidRequestError, "seq 9"),
        (make_session(), 3, 4, DraftBlock([VOCAB] * 9), InvalidRequestError, "longer than the maximum"),
        (make_session(capacity=5), 3, 4, DraftBlock([VOCAB] * 2), InvalidRequestError, "session's limit"),
        (make_session(), 3, 4, DraftBlock([5, VOCAB]), InvalidRequestError, "draft token id 100"),
        (make_session(), 3, 4, block_with([5], [([5, 6], [0.0, 1.0])]), InvalidRequestError,
         "draft probability 0"),
    ]
    for session, seq, length, block, error, needle in cases:
        with pytest.raises(error, match=needle):
            val.validate_block(session, seq, length, block, info, VOCAB)
    # draft ids are checked against the valid vocabulary, draft_probs ids against the logits' width
    refused(val.validate_block, make_session(), 3, 4, DraftBlock([VOCAB - 1]), info, VOCAB - 1,
            match="draft token id 99")
    refused(val.validate_block, make_session(), 3, 4, block_with([5], [([5, PADDED], [0.5, 0.5])]), info, VOCAB,
            match="draft_probs token id outside")
    val.validate_block(make_session(), 3, 4, block_with([5], [([5, PADDED - 1], [0.5, 0.5])]), info, VOCAB)


def test_token_ids_names_the_first_bad_id_after_a_zero():
    with pytest.raises(InvalidRequestError, match=f"^draft token id {VOCAB} is outside"):
        val.check_token_ids([0, 3, VOCAB], "draft", VOCAB)


def test_draft_probs_sum_message_rounds_to_four_decimals():
    with pytest.raises(InvalidRequestError, match=r"rows sum to \[1\.0017\]$"):
        val.check_draft_probs(block_with([5], [([5, 6], [0.5, 0.50173])]), PADDED)


# ---------------------------------------------------------------------------------------------- bonus_drafted


def test_block_length_of_a_bonus_drafted_block():
    """A bonus_drafted block holds 1 .. max + 1 tokens and scores gamma positions (as a classic block of
    gamma - 1): that is the length checked against the capacity."""
    val.check_block_length(5, 12, 16, 4, bonus_drafted=True)  # max + 1 tokens, reaching exactly the capacity
    val.check_block_length(1, 16, 16, 4, bonus_drafted=True)
    refused(val.check_block_length, 0, 4, 16, 4, True, match="^a bonus_drafted block needs at least one draft token$")
    refused(val.check_block_length, 6, 4, 16, 4, True,
            match=r"^bonus_drafted block of 6 tokens is longer than the maximum 4 \+ 1$")
    refused(val.check_block_length, 5, 13, 16, 4, True,
            match="^block of 5 tokens at committed length 13 passes the session's limit of 16 tokens")
    refused(val.check_block_length, 5, 4, 16, 4, False, match="^block of 5 tokens is longer than the maximum 4$")
    val.check_block_length(0, 4, 16, 4, False)  # an empty classic block: plain decoding


def test_validate_block_passes_bonus_drafted_on():
    val.validate_block(make_session(capacity=8), 3, 4, DraftBlock([5] * 5, bonus_drafted=True), INFO, VOCAB)
    refused(val.validate_block, make_session(capacity=8), 3, 4, DraftBlock([5] * 5), INFO, VOCAB,
            match="longer than the maximum 4$")
    refused(val.validate_block, make_session(capacity=7), 3, 4, DraftBlock([5] * 5, bonus_drafted=True), INFO, VOCAB,
            match="passes the session's limit of 7 tokens")
    val.validate_block(make_session(capacity=7), 3, 4, DraftBlock([5] * 4, bonus_drafted=True), INFO, VOCAB)
    refused(val.validate_block, make_session(capacity=7), 3, 4, DraftBlock([5] * 4), INFO, VOCAB,
            match="passes the session's limit of 7 tokens")
    refused(val.validate_block, make_session(), 3, 4, DraftBlock([], bonus_drafted=True), INFO, VOCAB,
            match="at least one draft token")


# ---------------------------------------------------------------------------------------------- ExtendSession


def check_extend(committed=10, appended=(5, 6), sampling=SamplingParams(), stopping=StoppingCriteria()):
    val.check_extend_request(committed, list(appended), sampling, stopping, INFO, VOCAB)


def test_check_extend_request_accepts_the_boundaries():
    check_extend()
    check_extend(committed=INFO.max_context_tokens - 2, appended=[0])  # one token of room left
    check_extend(appended=[VOCAB - 1], sampling=SamplingParams(temperature=val.MIN_TEMPERATURE))


@pytest.mark.parametrize("kw, error, message", [
    ({"appended": []}, InvalidRequestError, "appended_token_ids is empty: at least one token id is needed"),
    ({"appended": [5, VOCAB]}, InvalidRequestError, f"appended token id {VOCAB} is outside the vocabulary"),
    ({"appended": [-1]}, InvalidRequestError, "appended token id -1 is outside the vocabulary"),
    ({"sampling": SamplingParams(top_p=1.5)}, InvalidRequestError, "top_p must be in [0, 1]"),
    ({"stopping": StoppingCriteria(stop_strings=("",))}, InvalidRequestError, "stop strings must be non-empty"),
    ({"sampling": SamplingParams(temperature=1e-31)}, InvalidRequestError,
     "temperature 1e-31 is below 1e-30: use 0 for greedy"),
    ({"committed": 62, "appended": [1, 2]}, val.ContextLengthError,
     "conversation of 64 tokens (62 committed + 2 appended) leaves no room in the context of 64 tokens"),
    ({"committed": 70, "appended": [1]}, val.ContextLengthError, "conversation of 71 tokens"),
])
def test_check_extend_request_refuses(kw, error, message):
    with pytest.raises(error) as e:
        check_extend(**kw)
    assert str(e.value).startswith(message), str(e.value)
    assert type(e.value) is error
