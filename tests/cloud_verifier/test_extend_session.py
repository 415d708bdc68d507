"""ExtendSession (multi-turn sessions): a finished session continued with the next turn keeps its KV cache and
prefills only the appended tokens; turn 2 is token-identical to a fresh session over the whole history
(in-process and over gRPC); a conversation resumes on another replica from Redis; every error status leaves
the session unchanged. Tiny models from conftest; the reference is plain HF greedy decoding."""

from __future__ import annotations

import uuid

import grpc
import pytest
from prometheus_client import REGISTRY

from _reference import hf_greedy
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.chat import continuation_ids, render_chat_ids
from specdec_runtime.common.errors import (
    ConflictError,
    ContextLengthError,
    InvalidRequestError,
    PreconditionError,
    SessionNotFoundError,
)
from specdec_runtime.common.types import DraftBlock, ExtendRequest, OpenRequest, SamplingParams, StoppingCriteria
from specdec_runtime.edge_client.client import EdgeClient
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import EmbeddedServer, LocalBackend

WAIT_S = 60.0
N1, N2 = 10, 12  # tokens generated in turn 1 and turn 2


@pytest.fixture(scope="module")
def runner(tiny_pair):
    return TargetRunner(tiny_pair.target_dir)


@pytest.fixture(scope="module")
def local(runner):
    backend = LocalBackend(Verifier(runner, max_num_speculative_tokens=8, prefill_chunk_tokens=16))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    return OnnxDraftModel(tiny_pair.draft_dir).tokenizer


@pytest.fixture(scope="module")
def turns(tiny_pair, tokenizer):
    """(prompt ids, turn-1 reply ids, appended ids of turn 2, turn-2 reply ids) of plain HF greedy decoding."""
    prompt = render_chat_ids(tokenizer, [{"role": "user", "content": "Tell me a story."}])
    reply1 = hf_greedy(tiny_pair.target_dir, prompt, N1)
    appended = continuation_ids(tokenizer, prompt + reply1, [{"role": "user", "content": "And then? " * 6}])
    assert len(appended) > 16  # more than one prefill chunk of the ``local`` verifier
    reply2 = hf_greedy(tiny_pair.target_dir, prompt + reply1 + appended, N2)
    return prompt, reply1, appended, reply2


def _batch_tokens() -> float:
    return REGISTRY.get_sample_value("specdec_batch_tokens_sum") or 0.0


def _client(backend, draft_dir, gamma=4):
    model = OnnxDraftModel(draft_dir)
    return EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=gamma)


def _greedy(n):
    return SamplingParams(), StoppingCriteria(max_new_tokens=n, ignore_eos=True)


def _verify_to_end(backend, session_id, committed_length, first_seq, draft_tokens=()):
    """Plain decoding (empty blocks, or ``draft_tokens`` in the first block) to the session's end; returns
    (output ids, last seq)."""
    out, seq, length, first = [], first_seq, committed_length, list(draft_tokens)
    while True:
        v = backend.submit(session_id, seq, length, DraftBlock(first)).result(WAIT_S)
        first = []
        out += v.committed_token_ids
        length = v.committed_length
        if v.finished:
            return out, seq
        seq += 1


def test_extend_prefills_only_the_appended_tokens_and_matches_target_only(local, turns):
    prompt, reply1, appended, reply2 = turns
    opened = local.open_session(OpenRequest(prompt, *_greedy(N1)))
    out1, last_seq = _verify_to_end(local, opened.session_id, len(prompt), 1)
    assert out1 == reply1
    history = prompt + reply1
    before, passes = _batch_tokens(), REGISTRY.get_sample_value("specdec_target_forward_passes_total")
    ext = local.extend_session(ExtendRequest(opened.session_id, len(history), appended, *_greedy(N2)))
    # the last committed token + the appended ones but the last (fed with the first block): nothing else,
    # in chunks of prefill_chunk_tokens (16)
    assert _batch_tokens() - before == len(appended)
    assert REGISTRY.get_sample_value("specdec_target_forward_passes_total") - passes == -(-len(appended) // 16)
    assert ext.session_id == opened.session_id
    assert ext.committed_length == len(history) + len(appended)
    assert ext.seed == opened.seed  # has_seed unset: the session's seed is kept
    out2, _ = _verify_to_end(local, opened.session_id, ext.committed_length, last_seq + 1)
    assert out2 == reply2  # max_new_tokens counted from the new turn, the target's greedy tokens
    record = local.verifier.get_session(opened.session_id)
    assert record.committed_token_ids == history + appended + reply2
    assert record.prompt_length == len(history) + len(appended)
    local.close_session(opened.session_id)


def test_extend_grows_the_kv_cache_past_the_first_turns_capacity(local, turns):
    """Turn 1 reserved prompt + N1 tokens; turn 2 needs more: the cache is moved to a larger buffer, the
    conversation's keys/values copied (the output would differ if they were not)."""
    prompt, reply1, appended, reply2 = turns
    opened = local.open_session(OpenRequest(prompt, *_greedy(N1)))
    session = local.verifier.sessions.held(opened.session_id)
    assert session.kv.capacity == len(prompt) + N1
    _, last_seq = _verify_to_end(local, opened.session_id, len(prompt), 1)
    ext = local.extend_session(ExtendRequest(opened.session_id, len(prompt) + N1, appended, *_greedy(N2)))
    assert session.kv.capacity == ext.committed_length + N2
    out2, _ = _verify_to_end(local, opened.session_id, ext.committed_length, last_seq + 1)
    assert out2 == reply2
    local.close_session(opened.session_id)


def test_errors_leave_the_session_unchanged(local, runner, turns):
    prompt, reply1, appended, _ = turns
    v = local.verifier
    opened = local.open_session(OpenRequest(prompt, *_greedy(N1)))
    sid = opened.session_id
    # mid-generation (output committed, not finished): FAILED_PRECONDITION
    v1 = local.submit(sid, 1, len(prompt), DraftBlock([])).result(WAIT_S)
    with pytest.raises(PreconditionError, match="generating"):
        local.extend_session(ExtendRequest(sid, v1.committed_length, appended, *_greedy(N2)))
    _verify_to_end(local, sid, v1.committed_length, 2)
    history = prompt + reply1
    snapshot = v.get_session(sid)
    cases = [
        (SessionNotFoundError, dict(session_id="no-such-session")),
        (ConflictError, dict(committed_length=len(history) - 1)),
        (ConflictError, dict(committed_length=len(history) + len(appended))),  # a retry after it was applied
        (InvalidRequestError, dict(appended_token_ids=[])),
        (InvalidRequestError, dict(appended_token_ids=[v.valid_vocab_size])),
        (InvalidRequestError, dict(sampling=SamplingParams(temperature=-1.0))),
        (ContextLengthError, dict(appended_token_ids=[5] * (runner.max_context_tokens - len(history)))),
    ]
    for error, override in cases:
        args = dict(session_id=sid, committed_length=len(history), appended_token_ids=appended,
                    sampling=SamplingParams(), stopping=StoppingCriteria(max_new_tokens=N2, ignore_eos=True))
        args.update(override)
        with pytest.raises(error):
            local.extend_session(ExtendRequest(**args))
        after = v.get_session(sid)
        assert (after.committed_token_ids, after.prompt_length, after.finished) == \
            (snapshot.committed_token_ids, snapshot.prompt_length, snapshot.finished), (error, override)
    # another tenant's session: NOT_FOUND, as OpenSession/GetSession answer it
    with pytest.raises(SessionNotFoundError):
        local._call(v.extend_session(sid, len(history), appended, tenant_id="other-tenant"), WAIT_S)
    local.close_session(sid)
    with pytest.raises(SessionNotFoundError):  # closed
        local.extend_session(ExtendRequest(sid, len(history), appended, *_greedy(N2)))


def test_grpc_status_codes(runner, turns):
    """The wire answers each error with its documented status code (never INTERNAL)."""
    from specdec_runtime.common.wire import extend_request_to_proto
    from specdec_runtime.common.v1 import verifier_pb2_grpc as pb_grpc
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

    prompt, reply1, appended, reply2 = turns
    history = prompt + reply1
    with EmbeddedServer(verifier=Verifier(runner), grace_s=1.0) as address:
        backend = GrpcBackend(address)
        try:
            opened = backend.open_session(OpenRequest(prompt, *_greedy(N1)))
            _, last_seq = _verify_to_end(backend, opened.session_id, len(prompt), 1)
            with grpc.insecure_channel(address) as ch:
                stub = pb_grpc.VerifierStub(ch)

                def code(**kw):
                    args = dict(session_id=opened.session_id, committed_length=len(history),
                                appended_token_ids=appended)
                    args.update(kw)
                    with pytest.raises(grpc.RpcError) as e:
                        stub.ExtendSession(extend_request_to_proto(**args), timeout=WAIT_S)
                    return e.value.code()

                assert code(session_id="nope") == grpc.StatusCode.NOT_FOUND
                assert code(committed_length=len(history) + 1) == grpc.StatusCode.ABORTED
                assert code(appended_token_ids=[]) == grpc.StatusCode.INVALID_ARGUMENT
                assert code(appended_token_ids=[1] * runner.max_context_tokens) == grpc.StatusCode.OUT_OF_RANGE
            # over gRPC, turn 2 equals target-only decoding of the whole history (unset sampling/stopping would
            # keep the session's: max_new_tokens N1 then)
            ext = backend.extend_session(ExtendRequest(opened.session_id, len(history), appended, None,
                                                       StoppingCriteria(max_new_tokens=N2, ignore_eos=True)))
            out2, _ = _verify_to_end(backend, opened.session_id, ext.committed_length, last_seq + 1)
            assert out2 == reply2
            info = backend.get_session(opened.session_id)
            assert list(info.committed_token_ids) == history + appended + reply2
            assert info.prompt_length == len(history + appended)
        finally:
            backend.close()


@pytest.mark.redis
def test_conversation_resumes_on_another_replica_from_redis(tiny_pair, runner, redis_url, turns):
    """Replica A runs turn 1 and the extension; replica B (same Redis) resumes the conversation from the store
    at the next block: turn 2 equals target-only decoding; then B extends it to turn 3."""
    from specdec_runtime.cloud_verifier.store import RedisSessionStore

    prompt, reply1, appended, reply2 = turns
    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    stores = [RedisSessionStore(redis_url, prefix=prefix, ttl_s=60) for _ in range(2)]
    a = LocalBackend(Verifier(runner, stores[0], verifier_id="replica-a"))
    b = LocalBackend(Verifier(TargetRunner(tiny_pair.target_dir), stores[1], verifier_id="replica-b"))
    try:
        opened = a.open_session(OpenRequest(prompt, *_greedy(N1)))
        _, last_seq = _verify_to_end(a, opened.session_id, len(prompt), 1)
        history = prompt + reply1
        ext = a.extend_session(ExtendRequest(opened.session_id, len(history), appended, *_greedy(N2)))
        rec = stores[1].get(opened.session_id)
        assert rec.committed_token_ids == history + appended and rec.prompt_length == len(history + appended)
        assert not rec.finished and rec.stopping.max_new_tokens == N2
        out2, last_seq = _verify_to_end(b, opened.session_id, ext.committed_length, last_seq + 1)  # resumed on B
        assert out2 == reply2
        assert stores[0].get(opened.session_id).verifier_id == "replica-b"
        # turn 3 on B; A's stale copy cannot extend it any more (the store is the truth)
        history2 = history + appended + reply2
        more = [198, 1]
        ext3 = b.extend_session(ExtendRequest(opened.session_id, len(history2), more, *_greedy(4)))
        assert ext3.committed_length == len(history2) + 2
        with pytest.raises(ConflictError):  # answered from the store: the session stays on B
            a.extend_session(ExtendRequest(opened.session_id, len(history2), more, *_greedy(4)))
        rec = stores[0].get(opened.session_id)
        assert rec.committed_token_ids == history2 + more and rec.verifier_id == "replica-b"
        out3, _ = _verify_to_end(b, opened.session_id, ext3.committed_length, last_seq + 1)
        assert out3 == hf_greedy(tiny_pair.target_dir, history2 + more, 4)
    finally:
        a.close()
        b.close()
        keys = list(stores[0].client.scan_iter(match=f"{prefix}*"))
        if keys:
            stores[0].client.delete(*keys)
        for st in stores:
            st.close()


@pytest.mark.redis
def test_failover_retry_of_an_applied_extension_is_reconciled(tiny_pair, runner, redis_url, turns):
    """Replica A applies the extension and goes away before its answer reaches the client: the SDK's retry on B
    is refused (ABORTED: the committed length moved) and reconciled from the store, not applied twice."""
    from specdec_runtime.cloud_verifier.store import RedisSessionStore
    from specdec_runtime.common.wire import extend_request_to_proto
    from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
    from specdec_runtime.common.v1 import verifier_pb2_grpc as pb_grpc

    prompt, reply1, appended, reply2 = turns
    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    stores = [RedisSessionStore(redis_url, prefix=prefix, ttl_s=60) for _ in range(2)]
    runners = (runner, TargetRunner(tiny_pair.target_dir))
    servers = [EmbeddedServer(verifier=Verifier(r, s, verifier_id=f"replica-{n}"), grace_s=1.0)
               for r, s, n in zip(runners, stores, "ab")]
    addr_a, addr_b = (s.start(timeout_s=WAIT_S) for s in servers)
    backend = FailoverBackend([addr_a, addr_b], policy=RetryPolicy(connect_timeout_s=2.0, budget_s=20.0))
    try:
        opened = backend.open_session(OpenRequest(prompt, *_greedy(N1)))
        _, last_seq = _verify_to_end(backend, opened.session_id, len(prompt), 1)
        history = prompt + reply1
        stopping = StoppingCriteria(max_new_tokens=N2, ignore_eos=True)
        with grpc.insecure_channel(addr_a) as ch:  # A applies it; the answer is "lost"
            pb_grpc.VerifierStub(ch).ExtendSession(
                extend_request_to_proto(opened.session_id, len(history), appended, SamplingParams(), stopping),
                timeout=WAIT_S)
        servers[0].stop(timeout_s=WAIT_S)
        ext = backend.extend_session(ExtendRequest(opened.session_id, len(history), appended, SamplingParams(),
                                                   stopping))
        assert ext.committed_length == len(history + appended) and ext.seed == opened.seed
        assert backend.num_failovers == 1
        assert stores[1].get(opened.session_id).committed_token_ids == history + appended  # appended once
        out2, _ = _verify_to_end(backend, opened.session_id, ext.committed_length, last_seq + 1)
        assert out2 == reply2
    finally:
        backend.close()
        for s in servers:
            s.stop(timeout_s=WAIT_S)
        keys = list(stores[0].client.scan_iter(match=f"{prefix}*"))
        if keys:
            stores[0].client.delete(*keys)
        for st in stores:
            st.close()
