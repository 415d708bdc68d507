"""The target's features on the wire (common/features.py, protos field 30): a client that does not ask gets the
wire it got before features existed, field for field; a client that asks gets one vector per committed position
(prompt at open, committed tokens with each verdict) equal to the target's own hidden states; int8 keeps each
vector within half a step of its scale; bad requests get INVALID_ARGUMENT. A session resumed on another replica
(two replicas sharing a real Redis) for a block that says ``features_from`` (field 56) gets the features from
there; a block that does not say gets the wire as before. Real gRPC on 127.0.0.1."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from specdec.embedded import EmbeddedServer
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.errors import InvalidRequestError
from specdec_runtime.common.features import FLOAT16, INT8, FeatureRequest, encode_features
from specdec_runtime.common.types import DraftBlock, OpenRequest, SamplingParams, StoppingCriteria
from specdec_runtime.common.v1 import verifier_pb2 as pb
from specdec_runtime.common.wire import block_to_proto, open_request_to_proto, sampling_to_proto, stopping_to_proto
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

PROMPT = [1, 504, 3120, 314, 253, 1789, 30, 2]
# the field numbers each message had before features (protos/common/v1/verifier.proto): nothing else may travel
OLD_FIELDS = {"OpenSessionRequest": set(range(1, 7)), "OpenSessionResponse": set(range(1, 13)),
              "DraftBlock": set(range(1, 9)), "Verdict": set(range(1, 13))}


def _field_numbers(data: bytes) -> set[int]:
    """The top-level field numbers of a serialized protobuf message (a minimal wire-format walk)."""
    def varint(i: int) -> tuple[int, int]:
        shift = value = 0
        while True:
            b = data[i]
            value |= (b & 0x7F) << shift
            i, shift = i + 1, shift + 7
            if not b & 0x80:
                return value, i
    seen, i = set(), 0
    while i < len(data):
        key, i = varint(i)
        seen.add(key >> 3)
        kind = key & 7
        if kind == 0:
            _, i = varint(i)
        elif kind == 1:
            i += 8
        elif kind == 2:
            size, i = varint(i)
            i += size
        elif kind == 5:
            i += 4
        else:
            raise AssertionError(f"wire type {kind}")
    return seen


@pytest.fixture(scope="module")
def runner(tiny_pair):
    return TargetRunner(tiny_pair.target_dir)


@pytest.fixture(scope="module")
def reference(tiny_pair):
    """HF's hidden states of a sequence: index i = the input of decoder layer i, the last = final normed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_pair.target_dir, dtype=torch.float32).eval()

    def hidden(ids: list[int]) -> list[np.ndarray]:
        with torch.inference_mode():
            out = model.model(torch.tensor([ids]), output_hidden_states=True)
        states = [h[0].numpy() for h in out.hidden_states[:-1]] + [out.last_hidden_state[0].numpy()]
        return states
    return hidden


def _raw_call(channel, method: str, request) -> bytes:
    """The response's bytes as they came over the wire (no deserializer)."""
    call = channel.unary_unary(f"/specdec.v1.Verifier/{method}", request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=None)
    return call(request, timeout=60)


def test_no_request_no_new_field_on_the_wire(runner):
    sampling, stopping = SamplingParams(), StoppingCriteria(max_new_tokens=8)
    open_msg = open_request_to_proto(PROMPT, sampling, stopping)
    assert _field_numbers(open_msg.SerializeToString()) <= OLD_FIELDS["OpenSessionRequest"]
    with EmbeddedServer(verifier=Verifier(runner), grace_s=1.0) as address, grpc.insecure_channel(address) as ch:
        raw_open = _raw_call(ch, "OpenSession", open_msg)
        assert _field_numbers(raw_open) <= OLD_FIELDS["OpenSessionResponse"]
        opened = pb.OpenSessionResponse.FromString(raw_open)
        block = block_to_proto(opened.session_id, 1, opened.committed_length, DraftBlock([5, 6, 7]))
        assert _field_numbers(block.SerializeToString()) <= OLD_FIELDS["DraftBlock"]
        raw_verdict = _raw_call(ch, "VerifyBlock", block)
        assert _field_numbers(raw_verdict) <= OLD_FIELDS["Verdict"]
        asked = pb.DraftBlock(session_id=opened.session_id, seq=2,
                              committed_length=pb.Verdict.FromString(raw_verdict).committed_length,
                              draft_token_ids=[5], features=pb.FeatureRequest(layers=[-1]))
        assert 30 in _field_numbers(_raw_call(ch, "VerifyBlock", asked))  # the walk sees the field when it is there


def test_features_are_the_targets_hidden_states(runner, reference):
    eagle3 = FeatureRequest((0, 1, -1), FLOAT16)  # every kind of index on the 2-layer target
    with EmbeddedServer(verifier=Verifier(runner), grace_s=1.0) as address, GrpcBackend(address) as backend:
        opened = backend.open_session(OpenRequest(PROMPT, SamplingParams(), StoppingCriteria(max_new_tokens=16),
                                                  features=eagle3))
        f = opened.features
        assert (f.start_position, f.num_positions, f.width) == (0, len(PROMPT) - 1, 3 * 64)
        committed = list(PROMPT)
        got = [f.decode()]
        for seq in (1, 2, 3):
            block = DraftBlock([committed[-1], 7, 9][:seq], features=eagle3)
            verdict = backend.submit(opened.session_id, seq, len(committed), block).result(60)
            assert verdict.features.start_position == len(committed) - 1
            assert verdict.features.num_positions == len(verdict.committed_token_ids)
            committed += verdict.committed_token_ids
            got.append(verdict.features.decode())
        assert not backend.submit(opened.session_id, 4, len(committed), DraftBlock([5])).result(60).features
    states = reference(committed)
    want = np.concatenate([states[0], states[1], states[2]], axis=1)[: len(committed) - 1]
    np.testing.assert_allclose(np.concatenate(got), want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_int8_encoding_and_bad_requests(runner):
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32) * 3
    x[2] = 0
    block = encode_features(x, 4, INT8)
    assert len(block.data) == 5 * 64 and block.nbytes == 5 * 64 + 5 * 4
    err = np.abs(block.decode() - x)
    assert (err <= block.scales[:, None] / 2 + 1e-6).all() and not block.decode()[2].any()
    with pytest.raises(InvalidRequestError):
        encode_features(x, 0, "bfloat16")
    with EmbeddedServer(verifier=Verifier(runner), grace_s=1.0) as address, grpc.insecure_channel(address) as ch:
        for layers in ([3], [], [0, 0, 0, 0, 0]):
            msg = pb.OpenSessionRequest(prompt_token_ids=PROMPT, sampling=sampling_to_proto(SamplingParams()),
                                        stopping=stopping_to_proto(StoppingCriteria()),
                                        features=pb.FeatureRequest(layers=layers))
            with pytest.raises(grpc.RpcError) as info:
                _raw_call(ch, "OpenSession", msg)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, layers


@pytest.fixture()
def two_replicas(runner, redis_url):
    """Addresses of two embedded verifiers over the tiny target sharing Redis under a private key prefix."""
    import uuid

    from specdec_runtime.cloud_verifier.store import RedisSessionStore

    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    stores = [RedisSessionStore(redis_url, prefix=prefix, ttl_s=60) for _ in range(2)]
    servers = [EmbeddedServer(verifier=Verifier(runner, store, verifier_id=f"replica-{i}"), grace_s=1.0)
               for i, store in enumerate(stores)]
    try:
        yield [s.start(timeout_s=60) for s in servers]
    finally:
        for s in servers:
            s.stop(timeout_s=60)
        keys = list(stores[0].client.scan_iter(match=f"{prefix}*"))
        if keys:
            stores[0].client.delete(*keys)
        for store in stores:
            store.close()


@pytest.mark.redis
def test_a_resume_sends_the_features_a_block_lacks(two_replicas, reference):
    """A session opened and advanced on one replica, continued on the other by a block that lacks the features
    from position 3 on (its verdicts 'lost'): the resumed replica's verdict starts there, equal to the target's
    hidden states; the next block, held there, gets only its own."""
    eagle3 = FeatureRequest((0, 1, -1), FLOAT16)
    first = 3
    with GrpcBackend(two_replicas[0]) as a, GrpcBackend(two_replicas[1]) as b:
        opened = a.open_session(OpenRequest(PROMPT, SamplingParams(), StoppingCriteria(max_new_tokens=16),
                                            features=eagle3))
        committed = list(PROMPT)
        for seq in (1, 2):
            committed += a.submit(opened.session_id, seq, len(committed),
                                  DraftBlock([7], features=eagle3)).result(60).committed_token_ids
        before = len(committed)
        verdict = b.submit(opened.session_id, 3, before, DraftBlock([7], features=eagle3, features_from=first)
                           ).result(60)
        committed += verdict.committed_token_ids
        f = verdict.features
        assert (f.start_position, f.num_positions) == (first, len(committed) - 1 - first)
        again = b.submit(opened.session_id, 4, len(committed), DraftBlock([7], features=eagle3,
                                                                          features_from=first)).result(60)
        assert again.features.start_position == len(committed) - 1
    states = reference(committed)
    want = np.concatenate([states[0], states[1], states[2]], axis=1)[first: len(committed) - 1]
    np.testing.assert_allclose(f.decode(), want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


@pytest.mark.redis
def test_a_resume_for_a_block_that_does_not_say_changes_nothing_on_the_wire(two_replicas):
    """Without features_from, a session resumed on another replica answers exactly as before: nothing asked,
    the old fields only; features asked, field 30 from the block's own position and nothing more."""
    for asked in (None, FeatureRequest((-1,), FLOAT16)):
        with grpc.insecure_channel(two_replicas[0]) as ch_a, grpc.insecure_channel(two_replicas[1]) as ch_b:
            open_msg = open_request_to_proto(PROMPT, SamplingParams(), StoppingCriteria(max_new_tokens=8))
            opened = pb.OpenSessionResponse.FromString(_raw_call(ch_a, "OpenSession", open_msg))
            block = block_to_proto(opened.session_id, 1, opened.committed_length, DraftBlock([5], features=asked))
            length = pb.Verdict.FromString(_raw_call(ch_a, "VerifyBlock", block)).committed_length
            block = block_to_proto(opened.session_id, 2, length, DraftBlock([5, 6], features=asked))
            assert _field_numbers(block.SerializeToString()) <= OLD_FIELDS["DraftBlock"] | {30}
            raw = _raw_call(ch_b, "VerifyBlock", block)  # B resumes the session from the store
        if asked is None:
            assert _field_numbers(raw) <= OLD_FIELDS["Verdict"]
        else:
            verdict = pb.Verdict.FromString(raw)
            assert _field_numbers(raw) <= OLD_FIELDS["Verdict"] | {30}
            assert verdict.features.start_position == length - 1
            assert verdict.features.num_positions == verdict.committed_length - length


def test_bad_features_from_is_invalid_argument(runner):
    with EmbeddedServer(verifier=Verifier(runner), grace_s=1.0) as address, grpc.insecure_channel(address) as ch:
        open_msg = open_request_to_proto(PROMPT, SamplingParams(), StoppingCriteria(max_new_tokens=8))
        opened = pb.OpenSessionResponse.FromString(_raw_call(ch, "OpenSession", open_msg))
        length = opened.committed_length
        for features, start in ((None, 0), (FeatureRequest(), length), (FeatureRequest(), -1)):
            block = block_to_proto(opened.session_id, 1, length,
                                   DraftBlock([5], features=features, features_from=start))
            with pytest.raises(grpc.RpcError) as info:
                _raw_call(ch, "VerifyBlock", block)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (features, start)
            assert "features_from" in info.value.details()
        decode = ch.unary_stream("/specdec.v1.Verifier/Decode", request_serializer=lambda m: m.SerializeToString(),
                                 response_deserializer=pb.Verdict.FromString)
        with pytest.raises(grpc.RpcError) as info:  # a Decode's first step says it as a block would
            list(decode(pb.DecodeRequest(session_id=opened.session_id, seq=1, committed_length=length,
                                         max_tokens=1, features_from=0), timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "features_from" in info.value.details()
        extend = pb.ExtendSessionRequest(session_id=opened.session_id, committed_length=length,
                                         appended_token_ids=[5], features_from=0)  # no features: refused too
        with pytest.raises(grpc.RpcError) as info:
            _raw_call(ch, "ExtendSession", extend)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "features_from" in info.value.details()
