"""The gRPC layer: real grpc.aio server on loopback around the real Verifier (tiny random Llama), real clients.

Checks health, reflection, the status code of each error (with the session's committed tokens unchanged
afterwards, read back through GetSession), the bidi Verify stream, graceful shutdown and the edge's
GrpcBackend (both transports, error mapping, bytes on the wire).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specdec_runtime.cloud_verifier.serving.server import SERVICE_NAME, VerifierServer
from specdec.embedded import EmbeddedServer
from specdec_runtime.cloud_verifier.store import MemorySessionStore
from specdec_runtime.common.errors import (
    InvalidRequestError,
    PreconditionError,
    SessionNotFoundError,
    VerifierUnavailableError,
)
from specdec_runtime.common.types import DraftBlock, OpenRequest, SamplingParams, SparseDraftProbs, StoppingCriteria
from specdec_runtime.common.wire import block_to_proto, open_request_to_proto
from specdec_runtime.common.v1 import verifier_pb2 as pb
from specdec_runtime.common.v1 import verifier_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

MAX_BLOCK = 4
WAIT_S = 30.0  # timeout of every RPC / wait in these tests, s


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def target_dir(tiny_pair) -> Path:
    """The tiny random Llama with the real SmolLM2 tokenizer (conftest)."""
    return Path(tiny_pair.target_dir)


@pytest.fixture(scope="module")
def runner(target_dir):
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner

    return TargetRunner(target_dir, kv_cache_budget_tokens=16384)


def _verifier(runner, **kw):
    from specdec_runtime.cloud_verifier.verifier import Verifier

    kw.setdefault("max_num_speculative_tokens", MAX_BLOCK)
    kw.setdefault("max_batch_wait_ms", 1.0)
    return Verifier(runner, MemorySessionStore(ttl_s=60), verifier_id="test-verifier", **kw)


@pytest.fixture(scope="module")
def server(runner):
    """(address, verifier) of an embedded server around the real Verifier."""
    verifier = _verifier(runner, max_sessions=64)
    embedded = EmbeddedServer(verifier=verifier, grace_s=2.0)
    address = embedded.start(timeout_s=WAIT_S)
    yield address, verifier
    embedded.stop(timeout_s=WAIT_S)


@pytest.fixture(scope="module")
def channel(server):
    ch = grpc.insecure_channel(server[0])
    grpc.channel_ready_future(ch).result(timeout=WAIT_S)
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.VerifierStub(channel)


def _open(stub, prompt=(1, 504, 3458, 28), *, temperature=0.0, top_k=0, seed=7, max_new_tokens=64,
          fingerprint="") -> pb.OpenSessionResponse:
    req = open_request_to_proto(list(prompt), SamplingParams(temperature=temperature, top_k=top_k, seed=seed),
                                StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True), fingerprint)
    return stub.OpenSession(req, timeout=WAIT_S)


def _committed(stub, session_id) -> list[int]:
    return list(stub.GetSession(pb.GetSessionRequest(session_id=session_id), timeout=WAIT_S).committed_token_ids)


def _block(session_id, seq, committed_length, ids, probs=None) -> pb.DraftBlock:
    return block_to_proto(session_id, seq, committed_length, DraftBlock(list(ids), probs))


def _code(excinfo) -> grpc.StatusCode:
    return excinfo.value.code()


# ---------------------------------------------------------------------------------------------- basics


def test_health_serving(server, channel):
    hstub = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        resp = hstub.Check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT_S)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    from specdec_runtime.cloud_verifier.serving.healthcheck import main

    assert main(["--address", server[0], "--timeout", "10"]) == 0


def test_reflection_lists_service(channel):
    rstub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = rstub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                           timeout=WAIT_S)
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


def test_open_verify_get_close(stub, server):
    _, verifier = server
    opened = _open(stub)
    assert opened.committed_length == 4 and opened.max_num_speculative_tokens == MAX_BLOCK
    assert opened.verifier_id == "test-verifier" and opened.vocab_size > 0 and opened.seed == 7
    assert opened.tokenizer_fingerprint == verifier.info.tokenizer_fingerprint
    sid = opened.session_id
    verdict = stub.VerifyBlock(_block(sid, 1, 4, [5, 6, 7]), timeout=WAIT_S)
    assert verdict.seq == 1 and 0 <= verdict.num_accepted <= 3
    assert verdict.committed_length == 4 + verdict.num_accepted + 1 and verdict.batch_size >= 1
    info = stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=WAIT_S)
    assert info.committed_length == verdict.committed_length and info.prompt_length == 4
    assert list(info.committed_token_ids[:4]) == [1, 504, 3458, 28]
    assert list(info.committed_token_ids[4:]) == [5, 6, 7][: verdict.num_accepted] + [verdict.next_token_id]
    # empty block = plain decoding: one target token
    v2 = stub.VerifyBlock(_block(sid, 2, verdict.committed_length, []), timeout=WAIT_S)
    assert v2.num_accepted == 0 and v2.committed_length == verdict.committed_length + 1
    assert stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=WAIT_S).existed
    assert not stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=WAIT_S).existed
    with pytest.raises(grpc.RpcError) as e:
        stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=WAIT_S)
    assert _code(e) == grpc.StatusCode.NOT_FOUND


# ---------------------------------------------------------------------------------------------- status codes


def _assert_rejected(stub, sid, request: pb.DraftBlock, code: grpc.StatusCode, match: str = ""):
    before = _committed(stub, sid)
    with pytest.raises(grpc.RpcError) as e:
        stub.VerifyBlock(request, timeout=WAIT_S)
    assert _code(e) == code, e.value.details()
    assert match.lower() in e.value.details().lower()
    assert _committed(stub, sid) == before  # nothing committed


def test_invalid_argument_wrong_committed_length(stub):
    sid = _open(stub).session_id
    _assert_rejected(stub, sid, _block(sid, 1, 3, [5]), grpc.StatusCode.INVALID_ARGUMENT, "committed length")
    _assert_rejected(stub, sid, _block(sid, 1, 9, [5]), grpc.StatusCode.INVALID_ARGUMENT, "committed length")


def test_invalid_argument_out_of_vocab(stub):
    opened = _open(stub)
    sid = opened.session_id
    for bad in (opened.vocab_size, 10**9, -1):
        _assert_rejected(stub, sid, _block(sid, 1, 4, [5, bad]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary")


def test_invalid_argument_block_too_long(stub):
    sid = _open(stub).session_id
    _assert_rejected(stub, sid, _block(sid, 1, 4, [5] * (MAX_BLOCK + 1)), grpc.StatusCode.INVALID_ARGUMENT,
                     "longer than")


def test_invalid_argument_probs_not_a_distribution(stub):
    sid = _open(stub, temperature=0.8, top_k=4).session_id
    ids = np.array([[5, 6, 7], [6, 7, 8]], dtype=np.int64)
    cases = {
        "sum 0.5": np.array([[0.25, 0.125, 0.125], [0.5, 0.25, 0.25]], dtype=np.float32),
        "negative": np.array([[1.5, -0.25, -0.25], [0.5, 0.25, 0.25]], dtype=np.float32),
        "nan": np.array([[np.nan, 0.5, 0.5], [0.5, 0.25, 0.25]], dtype=np.float32),
    }
    for probs in cases.values():
        _assert_rejected(stub, sid, _block(sid, 1, 4, [5, 6], SparseDraftProbs(ids, probs)),
                         grpc.StatusCode.INVALID_ARGUMENT, "distribution")
    # structural: ragged rows / one entry missing (checked by common.wire before the verifier)
    ragged = _block(sid, 1, 4, [5, 6])
    ragged.draft_probs.add(token_ids=[5, 6], probs=[0.5, 0.5])
    ragged.draft_probs.add(token_ids=[6], probs=[1.0])
    _assert_rejected(stub, sid, ragged, grpc.StatusCode.INVALID_ARGUMENT, "share one k")
    missing = _block(sid, 1, 4, [5, 6])
    missing.draft_probs.add(token_ids=[5, 6], probs=[0.5, 0.5])
    _assert_rejected(stub, sid, missing, grpc.StatusCode.INVALID_ARGUMENT, "one per token")
    # and a valid top-k block goes through
    ok = stub.VerifyBlock(_block(sid, 1, 4, [5, 6], SparseDraftProbs(ids, np.full((2, 3), 1 / 3, np.float32))),
                          timeout=WAIT_S)
    assert ok.committed_length == _committed_len(stub, sid)


def _committed_len(stub, sid) -> int:
    return len(_committed(stub, sid))


def test_not_found(stub):
    for call in (
        lambda: stub.VerifyBlock(_block("no-such-session", 1, 4, [5]), timeout=WAIT_S),
        lambda: stub.GetSession(pb.GetSessionRequest(session_id="no-such-session"), timeout=WAIT_S),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert _code(e) == grpc.StatusCode.NOT_FOUND


def test_failed_precondition(stub, server):
    _, verifier = server
    with pytest.raises(grpc.RpcError) as e:
        _open(stub, fingerprint="0" * 16)
    assert _code(e) == grpc.StatusCode.FAILED_PRECONDITION and "fingerprint" in e.value.details()
    # the right fingerprint opens
    assert _open(stub, fingerprint=verifier.info.tokenizer_fingerprint).committed_length == 4
    # a block for a finished session
    sid = _open(stub, max_new_tokens=1).session_id
    v = stub.VerifyBlock(_block(sid, 1, 4, [5]), timeout=WAIT_S)
    assert v.finished and v.finish_reason == pb.FINISH_REASON_LENGTH and v.committed_length == 5
    _assert_rejected(stub, sid, _block(sid, 2, 5, [5]), grpc.StatusCode.FAILED_PRECONDITION, "finished")


def test_resource_exhausted(runner):
    verifier = _verifier(runner, max_sessions=2)
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address, grpc.insecure_channel(address) as ch:
        stub = pb_grpc.VerifierStub(ch)
        sids = [_open(stub).session_id for _ in range(2)]
        stub.VerifyBlock(_block(sids[0], 1, 4, [5]), timeout=WAIT_S)
        before = {sid: _committed(stub, sid) for sid in sids}
        with pytest.raises(grpc.RpcError) as e:
            _open(stub)
        assert _code(e) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert {sid: _committed(stub, sid) for sid in sids} == before
        stub.CloseSession(pb.CloseSessionRequest(session_id=sids[1]), timeout=WAIT_S)
        assert _open(stub).committed_length == 4  # room again


def test_invalid_open_requests(stub):
    for req in (
        pb.OpenSessionRequest(),  # empty prompt
        pb.OpenSessionRequest(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(temperature=-1)),
        pb.OpenSessionRequest(prompt_token_ids=[1, 2], stopping=pb.StoppingCriteria(max_new_tokens=0)),
        pb.OpenSessionRequest(prompt_token_ids=[1, 10**9]),
    ):
        with pytest.raises(grpc.RpcError) as e:
            stub.OpenSession(req, timeout=WAIT_S)
        assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()


# ---------------------------------------------------------------------------------------------- stream


class _Feeder:
    """A request iterator the test feeds one message at a time."""

    def __init__(self):
        self._items: list = []
        self._cv = threading.Condition()

    def put(self, item) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify()

    def end(self) -> None:
        self.put(None)

    def __iter__(self):
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._items, timeout=WAIT_S)
                if not self._items:
                    return
                item = self._items.pop(0)
            if item is None:
                return
            yield item


def test_verify_stream_many_sessions_in_order(stub):
    sids = [_open(stub, prompt=(1, 504 + i, 3458, 28)).session_id for i in range(3)]
    lengths = {sid: 4 for sid in sids}
    feeder = _Feeder()
    responses = stub.Verify(iter(feeder), timeout=WAIT_S)
    for step in range(1, 4):
        for sid in sids:  # three sessions' blocks in flight at once on one stream: batched together
            feeder.put(_block(sid, step, lengths[sid], [5, 6, 7]))
        for sid in sids:
            verdict = next(responses)
            assert verdict.seq == step
            assert verdict.committed_length == lengths[sid] + verdict.num_accepted + 1
            lengths[sid] = verdict.committed_length
    feeder.end()
    assert list(responses) == []
    assert {sid: _committed_len(stub, sid) for sid in sids} == lengths


def test_verify_stream_malformed_block_aborts(stub):
    sid = _open(stub).session_id
    feeder = _Feeder()
    responses = stub.Verify(iter(feeder), timeout=WAIT_S)
    feeder.put(_block(sid, 1, 4, [5, 6]))
    first = next(responses)
    assert first.seq == 1
    before = _committed(stub, sid)
    feeder.put(_block(sid, 2, first.committed_length, [5] * (MAX_BLOCK + 1)))  # too long
    with pytest.raises(grpc.RpcError) as e:
        next(responses)
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
    feeder.end()
    assert _committed(stub, sid) == before
    # a structurally malformed message (ragged probs) ends the stream the same way
    feeder = _Feeder()
    responses = stub.Verify(iter(feeder), timeout=WAIT_S)
    bad = _block(sid, 2, first.committed_length, [5])
    bad.draft_probs.add(token_ids=[5, 6], probs=[1.0])
    feeder.put(bad)
    with pytest.raises(grpc.RpcError) as e:
        next(responses)
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
    feeder.end()
    assert _committed(stub, sid) == before


def test_verify_stream_failure_stops_later_blocks(stub):
    """Blocks after a failed one on the same stream are not verified (nothing committed for them)."""
    a, c = _open(stub).session_id, _open(stub).session_id
    responses = stub.Verify(iter([_block(a, 1, 4, [5, 6]), _block("nope", 1, 4, [5]), _block(c, 1, 4, [5, 6])]),
                            timeout=WAIT_S)
    first = next(responses)
    assert first.seq == 1 and first.committed_length == _committed_len(stub, a)
    with pytest.raises(grpc.RpcError) as e:
        next(responses)
    assert _code(e) == grpc.StatusCode.NOT_FOUND
    assert _committed_len(stub, c) == 4


def test_grpc_backend_stream_isolates_sessions(server):
    """Stream mode: one session's bad block fails only that block; later blocks are resent and answered."""
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

    address, _ = server
    with GrpcBackend(address, mode="stream") as backend:
        a, c = (backend.open_session(OpenRequest([1, 2, 3], SamplingParams(),
                                                 StoppingCriteria(max_new_tokens=16))).session_id
                for _ in range(2))
        fa = backend.submit(a, 1, 3, DraftBlock([5, 6]))
        fb = backend.submit(a + "x", 1, 3, DraftBlock([5]))
        fc = backend.submit(c, 1, 3, DraftBlock([5, 6]))
        assert fa.result(timeout=WAIT_S).committed_length >= 4
        with pytest.raises(SessionNotFoundError):
            fb.result(timeout=WAIT_S)
        vc = fc.result(timeout=WAIT_S)
        assert vc.committed_length == len(backend.get_session(c).committed_token_ids)


def test_verify_stream_unknown_session(stub):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Verify(iter([_block("nope", 1, 4, [5])]), timeout=WAIT_S))
    assert _code(e) == grpc.StatusCode.NOT_FOUND


# ---------------------------------------------------------------------------------------------- shutdown


def test_graceful_shutdown(runner):
    """SIGTERM path: NOT_SERVING, idle streams end UNAVAILABLE at once (not after the grace period)."""
    verifier = _verifier(runner)
    # a grace far past every wait here: a server that waited it out would fail the RPC's own deadline
    # (DEADLINE_EXCEEDED, not UNAVAILABLE) and leave stop() running, whatever the machine's load
    embedded = EmbeddedServer(verifier=verifier, grace_s=4 * WAIT_S)
    address = embedded.start(timeout_s=WAIT_S)
    ch = grpc.insecure_channel(address)
    try:
        stub = pb_grpc.VerifierStub(ch)
        sid = _open(stub).session_id
        feeder = _Feeder()
        responses = stub.Verify(iter(feeder), timeout=WAIT_S)
        feeder.put(_block(sid, 1, 4, [5]))
        assert next(responses).seq == 1
        stopper = threading.Thread(target=embedded.stop, kwargs={"timeout_s": WAIT_S})
        stopper.start()
        with pytest.raises(grpc.RpcError) as e:
            next(responses)
        assert _code(e) == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()
        stopper.join(WAIT_S)
        assert not stopper.is_alive()  # stop() returned without waiting out the grace
        feeder.end()
    finally:
        ch.close()
    with pytest.raises(VerifierUnavailableError, match="cannot reach verifier"):
        from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

        GrpcBackend(address, connect_timeout_s=0.5)


def test_health_not_serving_during_shutdown(runner):
    """The health status flips before in-flight work is waited for."""

    async def main():
        verifier = _verifier(runner)
        srv = VerifierServer(verifier, host="127.0.0.1", port=0, grace_s=5.0)
        await srv.start()
        ch = grpc.aio.insecure_channel(srv.address)
        hstub = health_pb2_grpc.HealthStub(ch)
        req = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        assert (await hstub.Check(req, timeout=WAIT_S)).status == health_pb2.HealthCheckResponse.SERVING
        watch = hstub.Watch(req, timeout=WAIT_S)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        stop = asyncio.create_task(srv.stop())
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        await asyncio.wait_for(stop, WAIT_S)
        await ch.close()

    asyncio.run(main())


def test_serve_entry_point(runner):
    """``serve(settings, verifier, ready=..., stop=...)`` starts, answers health, stops."""
    import socket

    from specdec_runtime.cloud_verifier.config import VerifierSettings
    from specdec_runtime.cloud_verifier.serving.healthcheck import check
    from specdec_runtime.cloud_verifier.serving.server import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = VerifierSettings(host="127.0.0.1", port=port, metrics_port=0, grace_period_s=1.0)

    async def main():
        ready, stop = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(serve(settings, _verifier(runner), ready=ready, stop=stop))
        await asyncio.wait_for(ready.wait(), WAIT_S)
        status = await asyncio.to_thread(check, f"127.0.0.1:{port}", SERVICE_NAME, 10.0)
        stop.set()
        await asyncio.wait_for(task, WAIT_S)
        return status

    assert asyncio.run(main()) == "SERVING"


# ---------------------------------------------------------------------------------------------- GrpcBackend


@pytest.mark.parametrize("mode", ["unary", "stream"])
def test_grpc_backend(server, stub, mode):
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

    address, verifier = server
    with GrpcBackend(address, mode=mode, connect_timeout_s=WAIT_S) as backend:
        opened = backend.open_session(OpenRequest([1, 504, 3458, 28], SamplingParams(seed=3),
                                                  StoppingCriteria(max_new_tokens=6),
                                                  verifier.info.tokenizer_fingerprint), timeout_s=WAIT_S)
        sid, length, seq = opened.session_id, opened.committed_length, 0
        assert length == 4 and opened.seed == 3 and opened.max_num_speculative_tokens == MAX_BLOCK
        finished = False
        while not finished:
            seq += 1
            gamma = min(2, 4 + 6 - length)  # a block may not pass prompt + max_new_tokens
            verdict = backend.submit(sid, seq, length, DraftBlock([5, 6][:gamma])).result(timeout=WAIT_S)
            assert verdict.seq == seq and len(verdict.committed_token_ids) == verdict.committed_length - length
            length, finished = verdict.committed_length, verdict.finished
        assert length == 4 + 6 and verdict.finish_reason is not None
        assert _committed(stub, sid)[4:] == backend.get_session(sid).committed_token_ids[4:]
        # errors come back as the specdec exception of the status code
        cases = [
            ((sid, seq + 1, length, DraftBlock([5])), PreconditionError),
            (("nope", 1, 4, DraftBlock([5])), SessionNotFoundError),
        ]
        sid2 = backend.open_session(OpenRequest([1, 2, 3], SamplingParams(),
                                                StoppingCriteria(max_new_tokens=8))).session_id
        cases += [
            ((sid2, 1, 99, DraftBlock([5])), InvalidRequestError),
            ((sid2, 1, 3, DraftBlock([5] * (MAX_BLOCK + 1))), InvalidRequestError),
        ]
        for args, exc in cases:
            with pytest.raises(exc):
                backend.submit(*args).result(timeout=WAIT_S)
        # the backend still works after errors (a stream is reopened)
        assert backend.submit(sid2, 1, 3, DraftBlock([5])).result(timeout=WAIT_S).committed_length >= 4
        with pytest.raises(PreconditionError, match="fingerprint"):
            backend.open_session(OpenRequest([1, 2], SamplingParams(), StoppingCriteria(), "f" * 16))
        stats = backend.wire_stats(sid)
        # open + seq blocks + the block refused (finished session); errors carry no message back
        assert stats.messages_sent == seq + 2 and stats.messages_received == seq + 1
        assert 0 < stats.bytes_sent < 400 and 0 < stats.bytes_received < 300
        backend.close_session(sid)
        assert backend.wire_stats(sid).messages_sent == seq + 3
        backend.close_session(sid)  # already gone: not an error
    with pytest.raises(VerifierUnavailableError):
        backend.submit(sid2, 2, 4, DraftBlock([5])).result(timeout=WAIT_S)


def test_grpc_backend_unreachable_fast():
    import socket

    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    t0 = time.monotonic()
    with pytest.raises(VerifierUnavailableError, match=f"cannot reach verifier at 127.0.0.1:{port}"):
        GrpcBackend(f"127.0.0.1:{port}", connect_timeout_s=1.0)
    # gRPC retries a refused connect until the timeout: the 1 s timeout ends it (the bound only catches a wait
    # that ignores it, e.g. the 60 s of a stuck channel, and is loose enough for a loaded machine)
    assert time.monotonic() - t0 < 20.0


class _EchoVerifier:
    """A no-op Verifier (same API) to time the transport alone: accepts everything, no model."""

    def __init__(self):
        from specdec_runtime.common.types import ServedInfo

        self.info = ServedInfo("echo", "", 4096, 16, 100, "echo", 60)

    async def start(self):
        pass

    async def stop(self, grace_s):
        pass

    async def open_session(self, prompt_token_ids, sampling, stopping, tokenizer_fingerprint=""):
        from specdec_runtime.common.types import SessionOpened

        return SessionOpened.of(self.info, "s", len(prompt_token_ids), 0)

    async def verify(self, session_id, seq, committed_length, block):
        from specdec_runtime.common.types import Verdict

        n = len(block.draft_token_ids)
        return Verdict(n, 1, True, [*block.draft_token_ids, 1], committed_length + n + 1, seq=seq)

    def get_session(self, session_id):
        raise SessionNotFoundError(session_id)

    def close_session(self, session_id):
        return True


def test_backend_modes_latency(capsys):
    """Transport round trip per block, both modes (printed; no timing assertion: shared CI machines)."""
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

    with EmbeddedServer(verifier=_EchoVerifier(), grace_s=1.0) as address:
        results = {}
        for mode in ("unary", "stream"):
            with GrpcBackend(address, mode=mode) as backend:
                for seq in range(1, 21):  # warm-up
                    backend.submit("s", seq, 10, DraftBlock([1, 2, 3, 4])).result(timeout=WAIT_S)
                n = 200
                t0 = time.perf_counter()
                for seq in range(n):
                    backend.submit("s", seq, 10, DraftBlock([1, 2, 3, 4])).result(timeout=WAIT_S)
                sequential_ms = (time.perf_counter() - t0) / n * 1000
                t0 = time.perf_counter()
                futures = [backend.submit(f"s{i % 8}", i, 10, DraftBlock([1, 2, 3, 4])) for i in range(n)]
                for f in futures:
                    assert f.result(timeout=WAIT_S).committed_length == 15
                pipelined_ms = (time.perf_counter() - t0) / n * 1000
                results[mode] = (sequential_ms, pipelined_ms)
    with capsys.disabled():
        for mode, (seq_ms, pipe_ms) in results.items():
            print(f"\n[{mode}] round trip {seq_ms:.3f} ms/block sequential, {pipe_ms:.3f} ms/block pipelined")


# ---------------------------------------------------------------------------------------------- Redis


@pytest.mark.redis
def test_two_replicas_share_redis(runner, redis_url):
    """Sessions live in Redis: a session opened on replica A continues on replica B (resumed by prefill)."""
    import uuid

    from specdec_runtime.cloud_verifier.store import RedisSessionStore
    from specdec_runtime.cloud_verifier.verifier import Verifier

    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    stores = [RedisSessionStore(redis_url, prefix=prefix, ttl_s=60) for _ in range(2)]
    verifiers = [Verifier(runner, st, verifier_id=f"replica-{i}", max_num_speculative_tokens=MAX_BLOCK, max_batch_wait_ms=1.0)
                 for i, st in enumerate(stores)]
    try:
        with EmbeddedServer(verifier=verifiers[0], grace_s=1.0) as addr_a, \
                EmbeddedServer(verifier=verifiers[1], grace_s=1.0) as addr_b, \
                grpc.insecure_channel(addr_a) as ch_a, grpc.insecure_channel(addr_b) as ch_b:
            a, b = pb_grpc.VerifierStub(ch_a), pb_grpc.VerifierStub(ch_b)
            sid = _open(a).session_id
            v1 = a.VerifyBlock(_block(sid, 1, 4, [5, 6]), timeout=WAIT_S)
            keys = list(stores[0].client.scan_iter(match=f"{prefix}*"))
            assert len(keys) == 3 and all(stores[0].client.pttl(k) > 0 for k in keys)
            assert _committed(b, sid) == _committed(a, sid)  # B sees the session through Redis
            v2 = b.VerifyBlock(_block(sid, 2, v1.committed_length, [5]), timeout=WAIT_S)
            assert v2.committed_length == v1.committed_length + v2.num_accepted + 1
            assert _committed(a, sid) == _committed(b, sid) and len(_committed(a, sid)) == v2.committed_length
            # a block to A, whose copy is stale (B holds the session now): refused at the commit, which names
            # its holder: UNAVAILABLE (retry), nothing committed, A's copy released
            with pytest.raises(grpc.RpcError) as e:
                a.VerifyBlock(_block(sid, 2, v1.committed_length, [5]), timeout=WAIT_S)
            assert _code(e) == grpc.StatusCode.UNAVAILABLE
            assert len(_committed(b, sid)) == v2.committed_length
            # the same block retried: A resumes from Redis and finds it behind (a compare-and-append): ended
            with pytest.raises(grpc.RpcError) as e:
                a.VerifyBlock(_block(sid, 2, v1.committed_length, [5]), timeout=WAIT_S)
            assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
            assert len(_committed(b, sid)) == v2.committed_length
            assert b.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=WAIT_S).existed
            with pytest.raises(grpc.RpcError) as e:
                a.GetSession(pb.GetSessionRequest(session_id=sid), timeout=WAIT_S)
            assert _code(e) == grpc.StatusCode.NOT_FOUND
    finally:
        keys = list(stores[0].client.scan_iter(match=f"{prefix}*"))
        if keys:
            stores[0].client.delete(*keys)
        for st in stores:
            st.close()
