"""Failure semantics of the verifier, each with real components (grpc on 127.0.0.1, the tiny target, real Redis
processes; a forward pass is held at its start by a hook on the real model when a test needs a block "in the
forward pass" or a stuck batch loop):

- the store: a replica that lost a session cannot commit (owner check); graceful shutdown gives sessions up;
- a client cancels its stream while its block is queued, or while it is in the forward pass, and resends at
  once: the block is committed wholly or not at all, and no "busy" state outlives the stream;
- keepalive: the edge's pings and the server's ping policy agree (an idle stream and a long prefill survive
  with short intervals; a disagreeing pair gets GOAWAY too_many_pings: the negative control);
- Redis loses its scripts (SCRIPT FLUSH) or restarts empty: new sessions work without restarting the verifier,
  a session whose record vanished fails with NOT_FOUND and the SDK re-opens it, output unchanged;
- health tells the truth: NOT_SERVING while Redis is unreachable or the batch loop is stuck.
"""

from __future__ import annotations

import queue
import shutil
import threading
import time

import grpc
import pytest

from _cluster import ForwardGate, PrivateRedis, ServerOnPort, free_port, health_status, wait_until
from _reference import hf_greedy
from specdec_runtime.cloud_verifier.store import MemorySessionStore, RedisSessionStore, SessionRecord
from specdec_runtime.common.errors import StaleSessionError
from specdec_runtime.common.types import DraftBlock, OpenRequest, SamplingParams, StoppingCriteria
from specdec_runtime.common.wire import block_to_proto, open_request_to_proto
from specdec_runtime.common.v1 import verifier_pb2 as pb
from specdec_runtime.common.v1 import verifier_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(300)

WAIT_S = 60.0
PROMPT = "Tell me a story about a robot who learns to paint."


def _redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server binary (these tests stop and restart their own Redis)")
    return binary


# ---------------------------------------------------------------------------------------------- store


@pytest.fixture
def store(memory_or_redis_store):
    return memory_or_redis_store


def test_owner_checked_commit_and_disown(store):
    now = time.time()
    store.create(SessionRecord("s1", "v1", "m", 3, [1, 2, 3], SamplingParams(), StoppingCriteria(), 7, now, now))
    assert store.append_committed("s1", 3, [4], 1, False, None, now, verifier_id="v1") == 4
    assert store.claim("s1", "v2", now)  # v2 resumed it: v1's late commit is refused, nothing changes
    with pytest.raises(StaleSessionError, match="no longer held by replica 'v1'"):
        store.append_committed("s1", 4, [5], 2, False, None, now, verifier_id="v1")
    assert store.get("s1").committed_token_ids == [1, 2, 3, 4]
    assert store.append_committed("s1", 4, [5], 2, False, None, now, verifier_id="v2") == 5
    assert not store.disown("s1", "v1")  # only the holder gives a session up
    assert store.disown("s1", "v2")
    record = store.get("s1")
    assert record.verifier_id == "" and record.committed_token_ids == [1, 2, 3, 4, 5]
    assert store.session_ids_of("v2") == []
    with pytest.raises(StaleSessionError):  # given up: v2 cannot commit any more either
        store.append_committed("s1", 5, [6], 3, False, None, now, verifier_id="v2")
    assert store.claim("s1", "v3", now)  # the next replica takes it
    assert store.append_committed("s1", 5, [6], 3, False, None, now, verifier_id="v3") == 6
    assert store.session_ids_of("v3") == ["s1"]


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def runner(tiny_pair):
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner

    return TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=16384)


@pytest.fixture(scope="module")
def prompt_ids(tiny_pair):
    from specdec_runtime.edge_client.client import encode_prompt
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    return encode_prompt(OnnxDraftModel(tiny_pair.draft_dir).tokenizer, PROMPT)


@pytest.fixture(scope="module")
def expected(tiny_pair, prompt_ids):
    return hf_greedy(tiny_pair.target_dir, prompt_ids, 120)


def _verifier(runner, store=None, **kw):
    from specdec_runtime.cloud_verifier.verifier import Verifier

    kw.setdefault("max_batch_wait_ms", 1.0)
    # fixed verification: these cases state what a whole block commits (an adaptive cut, decided by the
    # measured cost of a step, would verify a prefix of it)
    kw.setdefault("verify_policy", "fixed")
    return Verifier(runner, store or MemorySessionStore(ttl_s=60), verifier_id="test-verifier", **kw)


class _Feeder:
    """Request iterator of a bidi call, fed from the test."""

    def __init__(self):
        self.q: queue.SimpleQueue = queue.SimpleQueue()

    def __iter__(self):
        while True:
            item = self.q.get()
            if item is None:
                return
            yield item

    def put(self, msg):
        self.q.put(msg)

    def end(self):
        self.q.put(None)


def _open(stub, prompt_ids, max_new_tokens=64):
    req = open_request_to_proto(list(prompt_ids), SamplingParams(), StoppingCriteria(max_new_tokens, ignore_eos=True),
                                "")
    return stub.OpenSession(req, timeout=WAIT_S)


def _committed(stub, sid):
    return list(stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=WAIT_S).committed_token_ids)


# ---------------------------------------------------------------------------------------------- cancellation


def test_cancel_while_queued_then_resume_at_once(runner, prompt_ids, expected):
    """Session S's block waits in the queue behind a forward pass; the client cancels the stream: nothing is
    committed, S is free at once (the same block resent right away is taken), and its verdict is the right one."""
    from specdec.embedded import EmbeddedServer

    verifier = _verifier(runner)
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address, grpc.insecure_channel(address) as ch:
        stub = pb_grpc.VerifierStub(ch)
        other = _open(stub, prompt_ids).session_id
        sid = _open(stub, prompt_ids).session_id
        length = len(prompt_ids)
        block = block_to_proto(sid, 1, length, DraftBlock(expected[:3]))
        with ForwardGate(runner) as gate:
            busy = stub.VerifyBlock.future(block_to_proto(other, 1, length, DraftBlock(expected[:2])), timeout=WAIT_S)
            assert gate.entered.wait(WAIT_S)  # the other session's block holds the forward pass
            feeder = _Feeder()
            call = stub.Verify(iter(feeder), timeout=WAIT_S)
            feeder.put(block)  # S's block: queued behind it
            time.sleep(0.3)
            call.cancel()
            feeder.end()
            # resent at once, while the forward pass is still held: taken (S is not "busy"), queued again
            resent = stub.VerifyBlock.future(block, timeout=WAIT_S)
            time.sleep(0.3)
            assert not resent.done()  # not refused as "a block in flight"
            assert _committed(stub, sid) == list(prompt_ids)  # the cancelled block committed nothing
        verdict = resent.result(timeout=WAIT_S)
        assert busy.result(timeout=WAIT_S).committed_length == length + 3
        assert verdict.committed_length == length + 4
        assert _committed(stub, sid) == list(prompt_ids) + expected[:4]


def test_cancel_during_the_forward_pass_then_resume_at_once(runner, prompt_ids, expected):
    """The block is in the forward pass when the client cancels its stream: it is committed wholly; the same
    block resent at once waits for it (no "busy" refusal), then is refused as already committed (committed
    length mismatch, INVALID_ARGUMENT), and GetSession shows the block's tokens once."""
    from specdec.embedded import EmbeddedServer

    verifier = _verifier(runner)
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address, grpc.insecure_channel(address) as ch:
        stub = pb_grpc.VerifierStub(ch)
        sid = _open(stub, prompt_ids).session_id
        length = len(prompt_ids)
        block = block_to_proto(sid, 1, length, DraftBlock(expected[:3]))
        with ForwardGate(runner) as gate:
            feeder = _Feeder()
            call = stub.Verify(iter(feeder), timeout=WAIT_S)
            feeder.put(block)
            assert gate.entered.wait(WAIT_S)  # in the forward pass
            call.cancel()
            feeder.end()
            resent = stub.VerifyBlock.future(block, timeout=WAIT_S)
            time.sleep(0.3)
            assert not resent.done()  # waits for the cancelled block's end instead of "already in flight"
        with pytest.raises(grpc.RpcError) as e:
            resent.result(timeout=WAIT_S)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "committed length" in e.value.details()
        assert _committed(stub, sid) == list(prompt_ids) + expected[:4]  # committed wholly, once
        nxt = stub.VerifyBlock(block_to_proto(sid, 2, length + 4, DraftBlock(expected[4:6])), timeout=WAIT_S)
        assert nxt.committed_length == length + 7


# ---------------------------------------------------------------------------------------------- keepalive


def test_keepalive_policies_agree_as_shipped():
    from specdec_runtime.cloud_verifier.serving.server import SERVER_OPTIONS
    from specdec_runtime.common.keepalive import PING_INTERVAL_MARGIN, check_agreement
    from specdec_runtime.edge_client.transport.grpc_backend import CHANNEL_OPTIONS

    server, client = dict(SERVER_OPTIONS), dict(CHANNEL_OPTIONS)
    # the option gRPC core reads (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS)
    min_interval = server["grpc.http2.min_ping_interval_without_data_ms"]
    assert "grpc.http2.min_recv_ping_interval_without_data_ms" not in server  # no such gRPC option
    assert client["grpc.keepalive_time_ms"] >= PING_INTERVAL_MARGIN * min_interval
    assert server["grpc.keepalive_permit_without_calls"] == client["grpc.keepalive_permit_without_calls"] == 1
    check_agreement(client["grpc.keepalive_time_ms"], min_interval)
    with pytest.raises(ValueError, match="too_many_pings"):
        check_agreement(300, 3000)


def _keepalive_run(runner, prompt_ids, expected, client_ms: int, server_min_ms: int, idle_s: float):
    """A Verify stream idle for ``idle_s`` then used, and an OpenSession whose prefill is held ``idle_s``, with a
    client pinging every ``client_ms`` and a strict server (2 strikes) allowing one ping per ``server_min_ms``.
    Returns (the idle stream's outcome, the long prefill's outcome): "ok" or the status's details."""
    from specdec_runtime.cloud_verifier.serving.server import SERVER_OPTIONS
    from specdec_runtime.common.keepalive import client_keepalive_options, server_keepalive_options
    from specdec_runtime.edge_client.transport.grpc_backend import CHANNEL_OPTIONS

    server_options = [o for o in SERVER_OPTIONS if "keepalive" not in o[0] and "ping" not in o[0]]
    server_options += server_keepalive_options(min_ping_interval_ms=server_min_ms, max_ping_strikes=2)
    channel_options = [o for o in CHANNEL_OPTIONS if "keepalive" not in o[0] and "ping" not in o[0]]
    channel_options += client_keepalive_options(keepalive_time_ms=client_ms, keepalive_timeout_ms=5000)
    server = ServerOnPort(_verifier(runner), free_port(), options=server_options)
    outcomes = []
    try:
        for phase in ("idle stream", "long prefill"):
            with grpc.insecure_channel(server.address, options=channel_options) as ch:
                stub = pb_grpc.VerifierStub(ch)
                try:
                    if phase == "idle stream":
                        sid = _open(stub, prompt_ids).session_id
                        feeder = _Feeder()
                        responses = stub.Verify(iter(feeder), timeout=WAIT_S)
                        feeder.put(block_to_proto(sid, 1, len(prompt_ids), DraftBlock(expected[:2])))
                        assert next(responses).committed_length == len(prompt_ids) + 3
                        time.sleep(idle_s)  # the stream is open and silent; the client pings
                        feeder.put(block_to_proto(sid, 2, len(prompt_ids) + 3, DraftBlock(expected[3:5])))
                        assert next(responses).seq == 2  # same stream, still alive
                        feeder.end()
                    else:
                        with ForwardGate(runner) as gate:
                            opening = stub.OpenSession.future(open_request_to_proto(
                                list(prompt_ids), SamplingParams(), StoppingCriteria(8), ""), timeout=WAIT_S)
                            assert gate.entered.wait(WAIT_S)
                            time.sleep(idle_s)  # a long prefill: the call is open, no data flows
                        assert opening.result(timeout=WAIT_S).committed_length == len(prompt_ids)
                    outcomes.append("ok")
                except grpc.RpcError as e:
                    outcomes.append(f"{e.code().name}: {e.details()}")
    finally:
        server.stop()
    return outcomes


@pytest.mark.slow  # 17 s measured
def test_keepalive_idle_stream_and_long_prefill_are_not_closed(runner, prompt_ids, expected):
    """Scaled down 30x: the client pings every 1 s, the server allows one per 0.33 s (2 strikes): nothing is
    closed. Negative control: a client pinging every 0.3 s against a 3 s minimum gets its idle stream closed
    with GOAWAY too_many_pings (gRPC 1.8x does not count pings during an open unary call, the held prefill, as
    strikes: that phase passes either way)."""
    assert _keepalive_run(runner, prompt_ids, expected, client_ms=1000, server_min_ms=333, idle_s=4.0) == ["ok", "ok"]
    control = _keepalive_run(runner, prompt_ids, expected, client_ms=300, server_min_ms=3000, idle_s=4.0)
    assert "many pings" in control[0].lower(), control


# ---------------------------------------------------------------------------------------------- Redis


@pytest.mark.redis
def test_redis_script_flush_and_restart_empty(tiny_pair, runner, prompt_ids, expected):
    """SCRIPT FLUSH mid-generation: the next commit re-loads the script (redis-py's NOSCRIPT retry). Redis
    restarted empty mid-generation: the session's record is gone, its next block fails with NOT_FOUND, the SDK
    re-opens it from what it committed; the output is unchanged. New sessions work without a verifier restart."""
    import redis as redis_py

    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec.embedded import EmbeddedServer

    rd = PrivateRedis(_redis_binary()).start()
    store = RedisSessionStore(rd.url, prefix="specdec-test:", ttl_s=60, socket_timeout_s=2.0)
    verifier = _verifier(runner, store)
    try:
        with EmbeddedServer(verifier=verifier, grace_s=1.0) as address:
            model = OnnxDraftModel(tiny_pair.draft_dir)
            backend = FailoverBackend(address, policy=RetryPolicy(connect_timeout_s=2.0, budget_s=20.0))
            with EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=2) as client:
                stream = client.stream_chunks(prompt_ids, max_new_tokens=100, ignore_eos=True)
                for _ in range(10):
                    next(stream)
                redis_py.Redis(port=rd.port).script_flush()
                for _ in range(10):
                    next(stream)
                rd.stop()
                rd.start()  # same port, empty
                rest = list(stream)
                result = client.last_result
                assert rest and result.token_ids == expected[:100]
                assert result.num_sessions == 2 and result.num_unverified_tokens == 0
                again = client.generate(prompt_ids, max_new_tokens=30, ignore_eos=True)  # no verifier restart
                assert again.token_ids == expected[:30] and again.num_sessions == 1
            # a record that vanished: NOT_FOUND for its blocks and GetSession, the replica's copy dropped
            with GrpcBackend(address) as raw:
                sid = raw.open_session(OpenRequest(prompt_ids, SamplingParams(),
                                                   StoppingCriteria(8, ignore_eos=True))).session_id
                held = verifier.num_sessions
                redis_py.Redis(port=rd.port).flushall()
                with grpc.insecure_channel(address) as ch:
                    stub = pb_grpc.VerifierStub(ch)
                    for call in (lambda: stub.VerifyBlock(block_to_proto(sid, 1, len(prompt_ids),
                                                                          DraftBlock(expected[:2])), timeout=WAIT_S),
                                 lambda: stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=WAIT_S)):
                        with pytest.raises(grpc.RpcError) as e:
                            call()
                        assert e.value.code() == grpc.StatusCode.NOT_FOUND
                assert verifier.num_sessions == held - 1
    finally:
        store.close()
        rd.stop()


@pytest.mark.redis
def test_health_tells_the_truth(runner, prompt_ids):
    """NOT_SERVING while Redis is unreachable (liveness stays SERVING: a restart would not help) and while the
    batch loop is stuck in a forward pass (liveness NOT_SERVING too); SERVING again once fixed."""
    rd = PrivateRedis(_redis_binary()).start()
    store = RedisSessionStore(rd.url, prefix="specdec-test:", ttl_s=60, socket_timeout_s=0.5)
    server = ServerOnPort(_verifier(runner, store), free_port(), health_interval_s=0.1, stuck_after_s=1.0)
    addr = server.address

    def status(service="specdec.v1.Verifier"):
        return health_status(addr, service, timeout_s=2.0)

    try:
        assert status() == status("") == status("liveness") == "SERVING"
        rd.stop()
        assert wait_until(lambda: status() == "NOT_SERVING", 10.0)
        assert status("") == "NOT_SERVING" and status("liveness") == "SERVING"
        rd.start()
        assert wait_until(lambda: status() == "SERVING", 10.0)
        with ForwardGate(runner) as gate:  # a forward pass that does not end: the batch loop stops beating
            opening = threading.Thread(target=lambda: _open_quietly(addr, prompt_ids), daemon=True)
            opening.start()
            assert gate.entered.wait(WAIT_S)
            assert wait_until(lambda: status() == "NOT_SERVING" and status("liveness") == "NOT_SERVING", 10.0)
        assert wait_until(lambda: status() == status("liveness") == "SERVING", 10.0)
        opening.join(WAIT_S)
    finally:
        server.stop()
        store.close()
        rd.stop()


def _open_quietly(address, prompt_ids):
    with grpc.insecure_channel(address) as ch:
        try:
            _open(pb_grpc.VerifierStub(ch), prompt_ids)
        except grpc.RpcError:
            pass


# ---------------------------------------------------------------------------------------------- ownership lost


class _TakesTheSession:
    """A drafter that, at its ``at``-th block, makes the store name ``holder`` as the session's replica ("" =
    given up), as a drain or a store fail-over that lost the last claim would, while this client is mid-generation
    on the replica that still holds a copy."""

    def __init__(self, inner, store, verifier_id: str, holder: str, at: int):
        self._inner, self.store, self.verifier_id, self.holder, self.at, self.calls = inner, store, verifier_id, \
            holder, at, 0

    def propose(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            (sid,) = self.store.session_ids_of(self.verifier_id)
            if self.holder:
                assert self.store.claim(sid, self.holder, time.time())
            else:
                assert self.store.disown(sid, self.verifier_id)
        return self._inner.propose(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.parametrize("holder", ["another-replica", ""])
def test_a_session_taken_from_its_replica_mid_generation_goes_on_without_an_error(tiny_pair, runner, prompt_ids,
                                                                                  expected, holder):
    """The store stops naming the replica a client is generating on as the session's holder (another replica
    claimed it; or it was given up): that replica's next commit is refused with StaleSessionError — UNAVAILABLE,
    nothing committed, its copy released — so the SDK retries the same block, the replica resumes the session
    from the store, and the output is target-only's. Before, the refusal was INVALID_ARGUMENT and ended the
    request with an error (the chaos soak's lost requests on a Redis Cluster)."""
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec.embedded import EmbeddedServer

    store = MemorySessionStore(ttl_s=60)
    verifier = _verifier(runner, store)
    draft = OnnxDraftModel(tiny_pair.draft_dir)
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address:
        with FailoverBackend([address], policy=RetryPolicy(connect_timeout_s=2.0, budget_s=20.0)) as backend:
            drafter = _TakesTheSession(ModelDrafter(draft, draft_top_k=5), store, "test-verifier", holder, at=4)
            client = EdgeClient(backend, drafter, draft.tokenizer, num_speculative_tokens=3)
            result = client.generate(prompt_ids, max_new_tokens=48, ignore_eos=True)
            failovers = backend.num_failovers
    assert drafter.calls > 4
    assert result.token_ids == expected[:48]
    assert failovers >= 1  # the refused block was retried, not answered at once
    assert result.num_sessions == 1  # the same session went on (resumed from the store), none was re-opened
