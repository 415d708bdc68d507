"""Cloud decode (specdec.v1 Decode) end to end over real gRPC on 127.0.0.1: the verifier generates a session's
tokens itself, as γ = 0 verify steps through the batcher. Greedy output equals target-only (HF generate); a
seeded sampled one equals target-only decoding by empty blocks with the same seed; a cancelled stream leaves
only whole steps committed, and the session goes on from the store's committed length; a stopped one
(StopDecode) ends at a token boundary with every committed token streamed, and a stop naming another call of the
session changes nothing."""

from __future__ import annotations

import time

import pytest

from _reference import hf_greedy
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.types import OpenRequest, SamplingParams, StoppingCriteria
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.transport.cloud_decode import cloud_verdicts
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import EmbeddedServer

pytestmark = pytest.mark.timeout(400)  # the tiny pair is built in the first test's setup (slow on a loaded machine)


@pytest.fixture(scope="module")
def served(tiny_pair):
    """(address, verifier, tokenizer) of one verifier over the tiny target, served on 127.0.0.1."""
    verifier = Verifier(TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=8192), max_batch_wait_ms=1.0)
    tok = OnnxDraftModel(tiny_pair.draft_dir).tokenizer
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address:
        yield address, verifier, tok


def _open(backend, ids, n, sampling=SamplingParams()):
    return backend.open_session(OpenRequest(ids, sampling, StoppingCriteria(max_new_tokens=n, ignore_eos=True)))


def test_greedy_cloud_decode_is_target_only(tiny_pair, served):
    address, _, tok = served
    ids = encode_prompt(tok, "Tell me a story about a robot who learns to paint.")
    expected = hf_greedy(tiny_pair.target_dir, ids, 24)
    with GrpcBackend(address) as backend:
        opened = _open(backend, ids, 24)
        assert opened.load >= 0.0 and opened.forward_ms >= 0.0  # the load hint is answered
        verdicts = list(cloud_verdicts(backend, opened.session_id, 1, len(ids)))
        info = backend.get_session(opened.session_id)
    got = [t for v in verdicts for t in v.committed_token_ids]
    assert got == expected
    assert all(v.num_accepted == 0 and not v.is_bonus for v in verdicts) and verdicts[-1].finished
    assert list(info.committed_token_ids) == ids + expected  # committed in the store as it streamed


def test_seeded_sampled_cloud_decode_is_target_only_with_that_seed(tiny_pair, served):
    """A γ = 0 step samples the bonus token from p_t with uniform(seed, t, TARGET_SAMPLE): the same tokens as
    target-only decoding by empty blocks (EdgeClient without a drafter) with that seed, reproducibly."""
    address, _, tok = served
    ids = encode_prompt(tok, "Name a color.")
    sampling = SamplingParams(temperature=1.0, top_k=20, seed=1234)
    with GrpcBackend(address) as backend:
        runs = []
        for _ in range(2):
            opened = _open(backend, ids, 20, sampling)
            runs.append([t for v in cloud_verdicts(backend, opened.session_id, 1, len(ids))
                         for t in v.committed_token_ids])
        reference = EdgeClient(backend, None, tok).generate(ids, max_new_tokens=20, temperature=1.0, top_k=20,
                                                            seed=1234, ignore_eos=True).token_ids
        other_seed = EdgeClient(backend, None, tok).generate(ids, max_new_tokens=20, temperature=1.0, top_k=20,
                                                             seed=99, ignore_eos=True).token_ids
    assert runs[0] == runs[1] == reference
    assert other_seed != reference  # negative control: the seed matters


def test_cancelled_stream_commits_whole_steps_and_the_session_goes_on(tiny_pair, served):
    address, verifier, tok = served
    ids = encode_prompt(tok, "What is 2 + 2?")
    expected = hf_greedy(tiny_pair.target_dir, ids, 40)
    with GrpcBackend(address) as backend:
        opened = _open(backend, ids, 40)
        stream = cloud_verdicts(backend, opened.session_id, 1, len(ids))
        got = [next(stream).next_token_id for _ in range(5)]
        stream.close()  # cancels the call
        deadline = time.monotonic() + 10
        while verifier.sessions.held(opened.session_id).busy and time.monotonic() < deadline:
            time.sleep(0.01)
        info = backend.get_session(opened.session_id)
        committed = list(info.committed_token_ids)
        assert 5 <= len(committed) - len(ids) < 40 and not info.finished  # stopped early, whole steps only
        assert committed == ids + expected[:len(committed) - len(ids)]
        # the session goes on from the store's committed length (seq = one per committed step)
        rest = list(cloud_verdicts(backend, opened.session_id, len(committed) - len(ids) + 1, len(committed)))
    assert got == expected[:5]
    assert committed[len(ids):] + [t for v in rest for t in v.committed_token_ids] == expected


def _stop_decode(address, session_id, seq) -> bool:
    import grpc

    from specdec_runtime.common.v1 import verifier_pb2 as pb
    from specdec_runtime.common.v1 import verifier_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        return pb_grpc.VerifierStub(channel).StopDecode(pb.StopDecodeRequest(session_id=session_id, seq=seq),
                                                        timeout=10).stopped


@pytest.mark.parametrize("failover", [False, True])
def test_a_stopped_stream_ends_at_a_token_boundary_with_every_committed_token_streamed(tiny_pair, served, failover):
    from specdec_runtime.edge_client.transport.failover import FailoverBackend

    address, verifier, tok = served
    ids = encode_prompt(tok, "What is 2 + 2?")
    expected = hf_greedy(tiny_pair.target_dir, ids, 40)
    with (FailoverBackend([address]) if failover else GrpcBackend(address)) as backend:
        opened = _open(backend, ids, 40)
        stream = cloud_verdicts(backend, opened.session_id, 1, len(ids))  # no max_tokens: only the stop ends it
        got = [t for _, v in zip(range(5), stream) for t in v.committed_token_ids]
        stream.stop()
        got += [t for v in stream for t in v.committed_token_ids]  # what was committed until the stop landed
        deadline = time.monotonic() + 10
        while verifier.sessions.held(opened.session_id).busy and time.monotonic() < deadline:
            time.sleep(0.01)
        info = backend.get_session(opened.session_id)
        assert 5 <= len(got) < 40 and not info.finished, len(got)  # ended early by the stop
        assert list(info.committed_token_ids) == ids + got  # nothing committed without its verdict reaching us
        assert not _stop_decode(address, opened.session_id, 1)  # that call has ended: nothing to stop
        second = cloud_verdicts(backend, opened.session_id, len(got) + 1, len(ids) + len(got))
        first = next(second).committed_token_ids
        assert not _stop_decode(address, opened.session_id, 1)  # a late stop of the first call: not this one
        rest = first + [t for v in second for t in v.committed_token_ids]
    assert got + rest == expected  # the second call ran to the session's end


def test_decode_refuses_a_wrong_committed_length(served):
    from specdec_runtime.common.errors import InvalidRequestError

    address, _, tok = served
    ids = encode_prompt(tok, "Name a color.")
    with GrpcBackend(address) as backend:
        opened = _open(backend, ids, 8)
        with pytest.raises(InvalidRequestError):
            list(cloud_verdicts(backend, opened.session_id, 1, len(ids) + 1))
        with pytest.raises(InvalidRequestError):
            list(cloud_verdicts(backend, opened.session_id, 0, len(ids)))
        # nothing was committed: the right request still decodes all of it
        assert len(list(cloud_verdicts(backend, opened.session_id, 1, len(ids)))) == 8


def _carries_http2_data(chunk: bytes) -> bool:
    """A chunk of a gRPC connection that holds a non-empty HTTP/2 DATA frame (as tests/specdec/test_wan_proxy.py)."""
    i = 0
    while i + 9 <= len(chunk):
        length = int.from_bytes(chunk[i:i + 3], "big")
        if chunk[i + 3] == 0 and length > 0:
            return True
        i += 9 + length
    return False


def test_cloud_route_survives_a_reset_mid_stream(tiny_pair, served):
    """route=cloud through the WAN proxy (5 ms each way, 5 % stalls of 100 ms): the connection is reset while
    verdicts stream; the SDK reads the tokens committed meanwhile back from the store and resumes the stream on a
    new connection — output identical to target-only, no token lost or repeated."""
    from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
    from specdec.netem import LinkProfile, WanProxy

    address, _, tok = served
    ids = encode_prompt(tok, "Tell me a story about a robot who learns to paint.")
    expected = hf_greedy(tiny_pair.target_dir, ids, 40)
    profile = LinkProfile.symmetric(latency_ms=5, stall_probability=0.05, stall_ms=100)
    with WanProxy(0, address, profile, seed=3) as wan:
        backend = FailoverBackend(wan.address, policy=RetryPolicy(connect_timeout_s=5.0, budget_s=20.0), seed=0)
        with EdgeClient(backend, None, tok, route="cloud") as client:
            stream = client.stream_chunks(ids, max_new_tokens=40, ignore_eos=True)
            for _ in range(5):
                next(stream)
            wan.reset_on_next_chunk("down", match=_carries_http2_data)
            list(stream)
            result = client.last_result
        stats = wan.stats()
    assert result.token_ids == expected and result.num_unverified_tokens == 0
    assert stats.resets >= 1 and backend.num_failovers >= 1 and result.route["tokens"]["cloud"] == 40
