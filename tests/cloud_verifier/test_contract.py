"""The wire contract's checks, one by one, over real gRPC (EmbeddedServer + raw ``specdec.v1`` stub calls).

protos/common/v1/verifier.proto documents which requests the verifier refuses and with which status code;
for every such check this file sends a request that fails exactly that check and asserts

- the exact status code (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED);
- that nothing was committed (GetSession's committed_token_ids, finished flag unchanged; for OpenSession: no
  session held, no KV cache reserved);
- that a correct request afterwards still works (the next block with the next seq is verified and committed).

Block checks run on both transports: the unary ``VerifyBlock`` and the bidi ``Verify`` stream (a failing block
ends the stream with its status). Messages are built by hand with ``common.v1.verifier_pb2`` so that malformed
ones (ragged rows, NaN, ids outside int32 ranges the SDK refuses to build) reach the server as such.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
import pytest

from specdec_runtime.cloud_verifier.store import MemorySessionStore
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec.embedded import EmbeddedServer
from specdec_runtime.common.v1 import verifier_pb2 as pb
from specdec_runtime.common.v1 import verifier_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(180)

MAX_BLOCK = 4
WAIT_S = 30.0
PROMPT = [1, 504, 3458, 28]
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def runner(tiny_pair):
    return TargetRunner(Path(tiny_pair.target_dir), kv_cache_budget_tokens=16384)


@pytest.fixture(scope="module")
def server(runner):
    verifier = Verifier(runner, MemorySessionStore(ttl_s=120), verifier_id="contract",
                        max_num_speculative_tokens=MAX_BLOCK, max_batch_wait_ms=1.0, max_sessions=200)
    embedded = EmbeddedServer(verifier=verifier, grace_s=1.0)
    address = embedded.start(timeout_s=WAIT_S)
    yield address, verifier
    embedded.stop(timeout_s=WAIT_S)


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server[0]) as ch:
        grpc.channel_ready_future(ch).result(timeout=WAIT_S)
        yield pb_grpc.VerifierStub(ch)


def open_request(prompt=PROMPT, *, temperature=0.8, top_k=8, top_p=1.0, seed=5, max_new_tokens=32,
                 stop_strings=(), fingerprint="") -> pb.OpenSessionRequest:
    return pb.OpenSessionRequest(
        prompt_token_ids=list(prompt),
        sampling=pb.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, has_seed=True),
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True, stop_strings=list(stop_strings)),
        tokenizer_fingerprint=fingerprint,
    )


def raw_block(sid: str, seq: int, committed_length: int, ids, rows=None) -> pb.DraftBlock:
    """A DraftBlock exactly as given: ``rows`` = [(token_ids, probs), ...] or None (greedy drafting)."""
    msg = pb.DraftBlock(session_id=sid, seq=seq, committed_length=committed_length, draft_token_ids=list(ids))
    for row_ids, row_probs in rows or ():
        msg.draft_probs.add(token_ids=list(row_ids), probs=list(row_probs))
    return msg


def info(stub, sid) -> pb.SessionInfo:
    return stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=WAIT_S)


def snapshot(stub, sid) -> tuple:
    i = info(stub, sid)
    return tuple(i.committed_token_ids), i.committed_length, i.finished, i.finish_reason


@dataclass
class State:
    """A session as the client knows it: id, committed length, last seq."""

    sid: str
    length: int
    seq: int = 0

    def valid_block(self, ids=(5, 6)) -> pb.DraftBlock:
        """The correct next block: top-k drafting rows with each draft token in its support."""
        rows = [([t, t + 1, t + 2], [0.5, 0.25, 0.25]) for t in ids]
        return raw_block(self.sid, self.seq + 1, self.length, ids, rows)


def send(stub, request: pb.DraftBlock, transport: str) -> pb.Verdict:
    if transport == "unary":
        return stub.VerifyBlock(request, timeout=WAIT_S)
    responses = stub.Verify(iter([request]), timeout=WAIT_S)
    verdict = next(responses)
    assert list(responses) == []
    return verdict


def commit_valid(stub, state: State, transport: str = "unary") -> pb.Verdict:
    """Send the correct next block and check it was committed (this is the "still works" check)."""
    before = list(info(stub, state.sid).committed_token_ids)
    request = state.valid_block()
    verdict = send(stub, request, transport)
    assert verdict.seq == request.seq
    assert verdict.committed_length == state.length + verdict.num_accepted + 1
    after = list(info(stub, state.sid).committed_token_ids)
    assert after[: len(before)] == before and len(after) == verdict.committed_length
    assert after[len(before):] == list(request.draft_token_ids[: verdict.num_accepted]) + [verdict.next_token_id]
    state.length, state.seq = verdict.committed_length, request.seq
    return verdict


def new_state(stub, **kw) -> State:
    opened = stub.OpenSession(open_request(**kw), timeout=WAIT_S)
    return State(opened.session_id, opened.committed_length)


def expect_refused(stub, state: State, request: pb.DraftBlock, code: grpc.StatusCode, needle: str, transport: str):
    before = snapshot(stub, state.sid)
    with pytest.raises(grpc.RpcError) as e:
        send(stub, request, transport)
    assert e.value.code() == code, (e.value.code(), e.value.details())
    assert needle.lower() in e.value.details().lower(), e.value.details()
    assert snapshot(stub, state.sid) == before  # nothing committed


# ---------------------------------------------------------------------------------------------- block checks

V = 49152  # the tiny target's vocabulary (the real SmolLM2 tokenizer)
Case = Callable[[State], pb.DraftBlock]

BLOCK_CASES: dict[str, tuple[Case, grpc.StatusCode, str]] = {
    # position in the session
    "seq repeated": (lambda s: raw_block(s.sid, s.seq, s.length, [5]), INVALID, "seq"),
    "seq older": (lambda s: raw_block(s.sid, s.seq - 1, s.length, [5]), INVALID, "seq"),
    "seq zero": (lambda s: raw_block(s.sid, 0, s.length, [5]), INVALID, "seq"),
    "seq skips one": (lambda s: raw_block(s.sid, s.seq + 2, s.length, [5], [([5, 6], [0.5, 0.5])]), INVALID, "seq"),
    "seq far ahead": (lambda s: raw_block(s.sid, s.seq + 1000, s.length, [5]), INVALID, "seq"),
    "committed_length behind": (lambda s: raw_block(s.sid, s.seq + 1, s.length - 1, [5]), INVALID, "committed length"),
    "committed_length ahead": (lambda s: raw_block(s.sid, s.seq + 1, s.length + 1, [5]), INVALID, "committed length"),
    "committed_length of the prompt": (lambda s: raw_block(s.sid, s.seq + 1, len(PROMPT), [5]), INVALID,
                                       "committed length"),
    # length
    "block longer than max_num_speculative_tokens": (
        lambda s: raw_block(s.sid, s.seq + 1, s.length, [5] * (MAX_BLOCK + 1)), INVALID, "longer than"),
    # token ids
    "draft id = vocab_size": (lambda s: raw_block(s.sid, s.seq + 1, s.length, [5, V]), INVALID, "vocabulary"),
    "draft id negative": (lambda s: raw_block(s.sid, s.seq + 1, s.length, [-1]), INVALID, "vocabulary"),
    "draft id int32 max": (lambda s: raw_block(s.sid, s.seq + 1, s.length, [2**31 - 1]), INVALID, "vocabulary"),
    # draft_probs shape
    "fewer rows than tokens": (
        lambda s: raw_block(s.sid, s.seq + 1, s.length, [5, 6], [([5, 6], [0.5, 0.5])]), INVALID, "per token"),
    "more rows than tokens": (
        lambda s: raw_block(s.sid, s.seq + 1, s.length, [5], [([5, 6], [0.5, 0.5])] * 2), INVALID, "per token"),
    "ragged rows": (
        lambda s: raw_block(s.sid, s.seq + 1, s.length, [5, 6], [([5, 6], [0.5, 0.5]), ([6], [1.0])]), INVALID,
        "share one k"),
    "row ids and probs of different lengths": (
        lambda s: raw_block(s.sid, s.seq + 1, s.length, [5], [([5, 6], [1.0])]), INVALID, "probs"),
    "empty rows": (lambda s: raw_block(s.sid, s.seq + 1, s.length, [5], [([], [])]), INVALID, "k >= 1"),
    "repeated id in a row": (
        lambda s: raw_block(s.sid, s.seq + 1, s.length, [5], [([5, 5, 6], [0.5, 0.25, 0.25])]), INVALID, "repeats"),
    "row id outside the vocabulary": (
        lambda s: raw_block(s.sid, s.seq + 1, s.length, [5], [([5, V], [0.5, 0.5])]), INVALID, "vocabulary"),
    "row id negative": (
        lambda s: raw_block(s.sid, s.seq + 1, s.length, [5], [([5, -3], [0.5, 0.5])]), INVALID, "vocabulary"),
    # draft_probs values
    "probs sum to 0.5": (
        lambda s: raw_block(s.sid, s.seq + 1, s.length, [5], [([5, 6], [0.25, 0.25])]), INVALID, "distribution"),
    "probs sum to 1.5": (
        lambda s: raw_block(s.sid, s.seq + 1, s.length, [5], [([5, 6], [0.75, 0.75])]), INVALID, "distribution"),
    "second row sums to 0.9": (
        lambda s: raw_block(s.sid, s.seq + 1, s.length, [5, 6], [([5, 6], [0.5, 0.5]), ([6, 7], [0.45, 0.45])]),
        INVALID, "distribution"),
    "negative prob": (
        lambda s: raw_block(s.sid, s.seq + 1, s.length, [5], [([5, 6, 7], [1.5, -0.25, -0.25])]), INVALID,
        "distribution"),
    "NaN prob": (
        lambda s: raw_block(s.sid, s.seq + 1, s.length, [5], [([5, 6], [math.nan, 1.0])]), INVALID, "distribution"),
    "infinite prob": (
        lambda s: raw_block(s.sid, s.seq + 1, s.length, [5], [([5, 6], [math.inf, 0.0])]), INVALID, "distribution"),
    # the draft token must be in its q's support
    "q(x) = 0": (
        lambda s: raw_block(s.sid, s.seq + 1, s.length, [5], [([5, 6], [0.0, 1.0])]), INVALID, "probability 0"),
    "x absent from its row": (
        lambda s: raw_block(s.sid, s.seq + 1, s.length, [5], [([6, 7], [0.5, 0.5])]), INVALID, "probability 0"),
    "second token absent from its row": (
        lambda s: raw_block(s.sid, s.seq + 1, s.length, [5, 6], [([5, 6], [0.5, 0.5]), ([5, 7], [0.5, 0.5])]),
        INVALID, "probability 0"),
}


@pytest.fixture()
def session_with_history(stub):
    """A fresh session that has committed two blocks (so seq and committed length have history)."""
    state = new_state(stub, max_new_tokens=64)
    commit_valid(stub, state)
    commit_valid(stub, state)
    yield state
    stub.CloseSession(pb.CloseSessionRequest(session_id=state.sid), timeout=WAIT_S)


@pytest.mark.parametrize("transport", ["unary", "stream"])
@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_block_check(stub, session_with_history, case, transport):
    build, code, needle = BLOCK_CASES[case]
    state = session_with_history
    expect_refused(stub, state, build(state), code, needle, transport)
    commit_valid(stub, state, transport)


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_block_past_the_session_limit(stub, transport):
    """A block may not pass prompt + max_new_tokens (the session's KV capacity: the block's tokens are fed to the
    target; the verdict's own token is cut by the stopping rule)."""
    state = new_state(stub, max_new_tokens=3)
    expect_refused(stub, state, raw_block(state.sid, 1, state.length, [5, 6, 7, 8]), INVALID, "limit", transport)
    v = send(stub, raw_block(state.sid, 1, state.length, [5, 6, 7]), transport)
    assert v.committed_length <= len(PROMPT) + 3


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_block_for_a_finished_session(stub, transport):
    state = new_state(stub, max_new_tokens=1)
    v = send(stub, raw_block(state.sid, 1, state.length, []), transport)
    assert v.finished and v.finish_reason == pb.FINISH_REASON_LENGTH and v.committed_length == len(PROMPT) + 1
    state.length, state.seq = v.committed_length, 1
    before = snapshot(stub, state.sid)
    assert before[2] is True
    for request in (raw_block(state.sid, 2, state.length, []), state.valid_block([5])):
        expect_refused(stub, state, request, PRECONDITION, "finished", transport)
    assert snapshot(stub, state.sid) == before
    commit_valid(stub, new_state(stub), transport)  # the verifier still serves


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_unknown_and_closed_sessions(stub, server, transport):
    _, verifier = server
    with pytest.raises(grpc.RpcError) as e:
        send(stub, raw_block("no-such-session", 1, len(PROMPT), [5]), transport)
    assert e.value.code() == NOT_FOUND
    state = new_state(stub)
    commit_valid(stub, state, transport)
    held = verifier.num_sessions
    assert stub.CloseSession(pb.CloseSessionRequest(session_id=state.sid), timeout=WAIT_S).existed
    assert verifier.num_sessions == held - 1
    with pytest.raises(grpc.RpcError) as e:
        send(stub, state.valid_block(), transport)
    assert e.value.code() == NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        info(stub, state.sid)
    assert e.value.code() == NOT_FOUND  # closing left nothing behind, and the refused block created nothing
    assert verifier.num_sessions == held - 1
    commit_valid(stub, new_state(stub), transport)


def test_duplicate_block_sent_concurrently_commits_once(stub):
    """The same block twice at once (a client retry racing its original): exactly one is committed, the other
    is refused with INVALID_ARGUMENT (in flight, or stale once the first committed)."""
    state = new_state(stub)
    request = state.valid_block([5, 6, 7])
    outcomes: list = [None, None]

    def call(i):
        try:
            outcomes[i] = stub.VerifyBlock(request, timeout=WAIT_S)
        except grpc.RpcError as err:
            outcomes[i] = err

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    verdicts = [o for o in outcomes if isinstance(o, pb.Verdict)]
    errors = [o for o in outcomes if isinstance(o, grpc.RpcError)]
    assert len(verdicts) == 1 and len(errors) == 1, outcomes
    assert errors[0].code() == INVALID
    assert info(stub, state.sid).committed_length == verdicts[0].committed_length
    state.length, state.seq = verdicts[0].committed_length, 1
    commit_valid(stub, state)


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_first_block_seq_is_one(stub, transport):
    """A session's first block has seq 1 (the last seq of a new session is 0): 2 is a gap."""
    state = new_state(stub)
    expect_refused(stub, state, raw_block(state.sid, 2, state.length, [5]), INVALID, "seq", transport)
    commit_valid(stub, state, transport)
    assert state.seq == 1


def test_seq_rule_holds_across_replicas(runner, redis_url):
    """The last seq travels with the session's record in the store: two replicas on one Redis (real gRPC); after
    two blocks on replica A, replica B (resuming the session from Redis) refuses a gap and the retry of a block
    A committed (seq and committed length of the past: what a failover retry of a committed block gets, then
    reconciled from GetSession by the edge) and accepts the next seq; A, whose copy is now stale, accepts the
    seq after B's block."""
    import uuid

    from specdec_runtime.cloud_verifier.store import RedisSessionStore

    prefix = f"specdec-test:seq-{uuid.uuid4().hex}:"
    stores = [RedisSessionStore(redis_url, prefix=prefix, ttl_s=60) for _ in range(2)]
    servers = [EmbeddedServer(verifier=Verifier(runner, st, verifier_id=f"seq-{i}",
                                                max_num_speculative_tokens=MAX_BLOCK, max_batch_wait_ms=1.0),
                              grace_s=1.0) for i, st in enumerate(stores)]
    try:
        addresses = [srv.start(timeout_s=WAIT_S) for srv in servers]
        with grpc.insecure_channel(addresses[0]) as ch_a, grpc.insecure_channel(addresses[1]) as ch_b:
            a, b = pb_grpc.VerifierStub(ch_a), pb_grpc.VerifierStub(ch_b)
            state = new_state(a, max_new_tokens=64)
            commit_valid(a, state)
            retry = state.valid_block()  # seq 2, as a failover would resend it
            commit_valid(a, state)
            assert (state.seq, info(b, state.sid).committed_length) == (2, state.length)
            expect_refused(b, state, raw_block(state.sid, state.seq + 2, state.length, [5]), INVALID, "seq", "unary")
            expect_refused(b, state, retry, INVALID, "committed length", "unary")
            expect_refused(b, state, raw_block(state.sid, state.seq, state.length, [5]), INVALID, "seq", "stream")
            commit_valid(b, state)  # seq 3 on replica B
            assert stores[1].get(state.sid).last_seq == 3
            expect_refused(a, state, raw_block(state.sid, state.seq + 2, state.length, [5]), INVALID, "seq", "unary")
            commit_valid(a, state)  # seq 4 back on replica A (stale copy: resumed from the store)
            assert stores[0].get(state.sid).last_seq == 4
    finally:
        for srv in servers:
            srv.stop(timeout_s=WAIT_S)
        for st in stores:
            for key in st.client.scan_iter(match=f"{prefix}*"):
                st.client.delete(key)
            st.close()


# ---------------------------------------------------------------------------------------------- OpenSession checks

OPEN_CASES: dict[str, tuple[Callable[[], pb.OpenSessionRequest], grpc.StatusCode, str]] = {
    "empty prompt": (lambda: open_request(prompt=[]), INVALID, "empty prompt"),
    "no fields at all": (lambda: pb.OpenSessionRequest(), INVALID, "empty prompt"),
    "prompt id = vocab_size": (lambda: open_request(prompt=[1, V]), INVALID, "vocabulary"),
    "prompt id negative": (lambda: open_request(prompt=[1, -1]), INVALID, "vocabulary"),
    "prompt fills the context": (lambda: open_request(prompt=[7] * 512), INVALID, "no room"),
    "prompt longer than the context": (lambda: open_request(prompt=[7] * 600), INVALID, "no room"),
    "negative temperature": (lambda: open_request(temperature=-0.5), INVALID, "temperature"),
    "NaN temperature": (lambda: open_request(temperature=math.nan), INVALID, "temperature"),
    "infinite temperature": (lambda: open_request(temperature=math.inf), INVALID, "temperature"),
    "negative top_k": (lambda: open_request(top_k=-1), INVALID, "top_k"),
    "top_p above 1": (lambda: open_request(top_p=1.5), INVALID, "top_p"),
    "negative top_p": (lambda: open_request(top_p=-0.1), INVALID, "top_p"),
    "max_new_tokens 0": (lambda: open_request(max_new_tokens=0), INVALID, "max_new_tokens"),
    "max_new_tokens negative": (lambda: open_request(max_new_tokens=-4), INVALID, "max_new_tokens"),
    "empty stop string": (lambda: open_request(stop_strings=["ok", ""]), INVALID, "stop string"),
    "tokenizer fingerprint mismatch": (lambda: open_request(fingerprint="0" * 16), PRECONDITION, "fingerprint"),
}


@pytest.mark.parametrize("case", list(OPEN_CASES))
def test_open_session_check(stub, server, runner, case):
    _, verifier = server
    build, code, needle = OPEN_CASES[case]
    held, reserved = verifier.num_sessions, runner.kv_reserved_tokens
    with pytest.raises(grpc.RpcError) as e:
        stub.OpenSession(build(), timeout=WAIT_S)
    assert e.value.code() == code, (e.value.code(), e.value.details())
    assert needle.lower() in e.value.details().lower(), e.value.details()
    assert verifier.num_sessions == held and runner.kv_reserved_tokens == reserved  # nothing reserved
    state = new_state(stub)  # a correct request still works
    commit_valid(stub, state)
    stub.CloseSession(pb.CloseSessionRequest(session_id=state.sid), timeout=WAIT_S)


def test_open_session_accepts_the_boundaries(stub, server):
    """The limits are where the proto puts them: a prompt of context − 1 tokens, top_p 0 (the most likely token
    only) and 1, temperature 0 (greedy), top_k 0 (off), the right fingerprint."""
    _, verifier = server
    for req in (
        open_request(prompt=[7] * 511, max_new_tokens=1),
        open_request(top_p=0.0), open_request(top_p=1.0), open_request(temperature=0.0), open_request(top_k=0),
        open_request(fingerprint=verifier.info.tokenizer_fingerprint),
    ):
        opened = stub.OpenSession(req, timeout=WAIT_S)
        assert opened.committed_length == len(req.prompt_token_ids)
        stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id), timeout=WAIT_S)


def test_resource_exhausted_session_limit_and_kv_budget(tiny_pair):
    """RESOURCE_EXHAUSTED: the session limit, and a KV budget with no room; nothing held, and room again after
    a close."""
    runner = TargetRunner(Path(tiny_pair.target_dir), kv_cache_budget_tokens=64)
    verifier = Verifier(runner, MemorySessionStore(ttl_s=60), max_num_speculative_tokens=MAX_BLOCK,
                        max_batch_wait_ms=1.0, max_sessions=2)
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address, grpc.insecure_channel(address) as ch:
        stub = pb_grpc.VerifierStub(ch)
        with pytest.raises(grpc.RpcError) as e:  # 4 + 100 tokens > 64 of budget
            stub.OpenSession(open_request(max_new_tokens=100), timeout=WAIT_S)
        assert e.value.code() == EXHAUSTED and runner.kv_reserved_tokens == 0 and verifier.num_sessions == 0
        a, b = new_state(stub, max_new_tokens=8), new_state(stub, max_new_tokens=8)
        commit_valid(stub, a)
        before = (snapshot(stub, a.sid), snapshot(stub, b.sid))
        reserved = runner.kv_reserved_tokens
        with pytest.raises(grpc.RpcError) as e:  # third session: over max_sessions
            stub.OpenSession(open_request(max_new_tokens=8), timeout=WAIT_S)
        assert e.value.code() == EXHAUSTED
        assert (snapshot(stub, a.sid), snapshot(stub, b.sid)) == before and runner.kv_reserved_tokens == reserved
        commit_valid(stub, a)
        stub.CloseSession(pb.CloseSessionRequest(session_id=b.sid), timeout=WAIT_S)
        commit_valid(stub, new_state(stub, max_new_tokens=8))  # room again
