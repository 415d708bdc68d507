"""Verdict.is_bonus and Verdict.next_token_id (-1 when a stop inside the accepted prefix ended the session), on
the wire (raw ``specdec.v1`` stub over an EmbeddedServer) and as the edge decodes them (GrpcBackend).

Greedy sessions on the tiny target; the draft blocks are the target's own greedy continuation (plain HF
``generate``), so a block is accepted whole unless a token is changed on purpose. Each case names the block,
the stopping criteria and the exact verdict expected (proto: "next_token_id: the token after the accepted
prefix: recovered (after a rejection) or bonus (full block). -1 when a stop inside the accepted prefix ended
the session before it"; "is_bonus: true when next_token_id is a bonus token").
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest

from _reference import hf_greedy
from specdec_runtime.cloud_verifier.store import MemorySessionStore
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.types import DraftBlock, FinishReason, OpenRequest, SamplingParams, StoppingCriteria
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
from specdec.embedded import EmbeddedServer
from specdec_runtime.common.v1 import verifier_pb2 as pb
from specdec_runtime.common.v1 import verifier_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

GAMMA = 4
WAIT_S = 30.0
PROMPTS = [[1, 504, 3458, 28], [1, 9690, 314, 253], [1, 2683, 2412, 30, 1170]]


@pytest.fixture(scope="module")
def ref(tiny_pair) -> tuple[list[int], list[int]]:
    """(prompt, the target's first 6 greedy tokens), with the first 5 tokens all different (so a stop token id
    names one position)."""
    for prompt in PROMPTS:
        tokens = hf_greedy(tiny_pair.target_dir, prompt, 6)
        if len(set(tokens[:5])) == 5:
            return prompt, tokens
    pytest.fail("no prompt with 5 distinct greedy tokens")


@pytest.fixture(scope="module")
def server(tiny_pair):
    runner = TargetRunner(tiny_pair.target_dir)
    # fixed verification: each case is a whole block's verdict (an adaptive cut, decided by measured step cost,
    # would verify a prefix of it)
    verifier = Verifier(runner, MemorySessionStore(ttl_s=60), max_num_speculative_tokens=GAMMA, max_batch_wait_ms=1.0,
                        verify_policy="fixed")
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address:
        yield address


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server) as ch:
        yield pb_grpc.VerifierStub(ch)


@dataclass(frozen=True)
class Case:
    block: str  # "ref[:4]" = the target's 4 next tokens; "wrong@i" = the same with position i changed
    stopping: dict
    num_accepted: int
    next_token: int | None  # index into the reference, or None for -1
    is_bonus: bool
    committed: int  # output tokens committed
    finish: int = pb.FINISH_REASON_UNSPECIFIED


CASES = {
    "full block: bonus": Case("ref[:4]", {}, 4, 4, True, 5),
    "empty block: plain decoding, not a bonus": Case("ref[:0]", {}, 0, 0, False, 1),
    "rejection at 2: recovered": Case("wrong@2", {}, 2, 2, False, 3),
    "rejection at 0: recovered": Case("wrong@0", {}, 0, 0, False, 1),
    "stop token = 2nd draft token: -1": Case("ref[:4]", {"stop_token_ids": [1]}, 2, None, False, 2,
                                             pb.FINISH_REASON_EOS),
    "stop token = 1st draft token: -1": Case("ref[:4]", {"stop_token_ids": [0]}, 1, None, False, 1,
                                             pb.FINISH_REASON_EOS),
    "stop token = last draft token: -1": Case("ref[:4]", {"stop_token_ids": [3]}, 4, None, False, 4,
                                              pb.FINISH_REASON_EOS),
    "stop token = bonus token": Case("ref[:4]", {"stop_token_ids": [4]}, 4, 4, True, 5, pb.FINISH_REASON_EOS),
    "stop token = recovered token": Case("wrong@1", {"stop_token_ids": [1]}, 1, 1, False, 2, pb.FINISH_REASON_EOS),
    "max_new_tokens inside the block: -1": Case("ref[:2]", {"max_new_tokens": 2}, 2, None, False, 2,
                                                pb.FINISH_REASON_LENGTH),
    "max_new_tokens at the bonus": Case("ref[:2]", {"max_new_tokens": 3}, 2, 2, True, 3, pb.FINISH_REASON_LENGTH),
}


def _block_ids(spec: str, tokens: list[int]) -> list[int]:
    if spec.startswith("ref[:"):
        return tokens[: int(spec[5:-1])]
    pos = int(spec.split("@")[1])
    ids = tokens[:GAMMA]
    ids[pos] = 7 if tokens[pos] != 7 else 8  # anything but the target's argmax is rejected
    return ids


def _stopping(case: Case, tokens: list[int]) -> pb.StoppingCriteria:
    stop = case.stopping
    return pb.StoppingCriteria(max_new_tokens=stop.get("max_new_tokens", 32), ignore_eos=True,
                               stop_token_ids=[tokens[i] for i in stop.get("stop_token_ids", [])])


@pytest.mark.parametrize("name", list(CASES))
def test_verdict_fields_on_the_wire(stub, ref, name):
    case = CASES[name]
    prompt, tokens = ref
    opened = stub.OpenSession(pb.OpenSessionRequest(prompt_token_ids=prompt, stopping=_stopping(case, tokens)),
                              timeout=WAIT_S)
    ids = _block_ids(case.block, tokens)
    v = stub.VerifyBlock(pb.DraftBlock(session_id=opened.session_id, seq=1, committed_length=len(prompt),
                                       draft_token_ids=ids), timeout=WAIT_S)
    expected_next = -1 if case.next_token is None else tokens[case.next_token]
    assert (v.num_accepted, v.next_token_id, v.is_bonus) == (case.num_accepted, expected_next, case.is_bonus)
    if case.next_token is None:
        assert v.next_token_id == -1
    else:
        assert v.next_token_id >= 0
    assert v.committed_length == len(prompt) + case.committed
    assert v.finished == (case.finish != pb.FINISH_REASON_UNSPECIFIED) and v.finish_reason == case.finish
    info = stub.GetSession(pb.GetSessionRequest(session_id=opened.session_id), timeout=WAIT_S)
    assert list(info.committed_token_ids) == prompt + tokens[: case.committed]  # the greedy output, cut at the stop
    assert info.finished == v.finished and info.finish_reason == v.finish_reason
    stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id), timeout=WAIT_S)


@pytest.mark.parametrize("mode", ["stream", "unary"])
def test_edge_decodes_minus_one_and_bonus(server, ref, mode):
    """GrpcBackend's Verdict: committed_token_ids is the accepted prefix cut at the stop when next is -1, and
    accepted + bonus for a full block."""
    prompt, tokens = ref
    with GrpcBackend(server, mode=mode) as backend:
        sid = backend.open_session(OpenRequest(prompt, SamplingParams(),
                                               StoppingCriteria(max_new_tokens=32, ignore_eos=True))).session_id
        v = backend.submit(sid, 1, len(prompt), DraftBlock(tokens[:4])).result(timeout=WAIT_S)
        assert v.is_bonus and v.next_token_id == tokens[4] and v.committed_token_ids == tokens[:5]
        stopping = StoppingCriteria(max_new_tokens=32, stop_token_ids=(tokens[1],), ignore_eos=True)
        sid = backend.open_session(OpenRequest(prompt, SamplingParams(), stopping)).session_id
        v = backend.submit(sid, 1, len(prompt), DraftBlock(tokens[:4])).result(timeout=WAIT_S)
        assert v.next_token_id == -1 and not v.is_bonus and v.num_accepted == 2
        assert v.committed_token_ids == tokens[:2] and v.finished and v.finish_reason == FinishReason.EOS
