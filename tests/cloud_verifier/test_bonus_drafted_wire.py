"""bonus_drafted blocks (``DraftBlock.bonus_drafted = 7``) over real gRPC: the length rule, the verdict's meaning
of next_token_id = -1, and greedy exactness against target-only decoding.

A real verifier (tiny target, sessions in a real Redis) behind EmbeddedServer on 127.0.0.1; raw
``specdec.v1`` messages, so the server sees exactly the blocks built here. Checked:

- a bonus_drafted block with 0 draft tokens, or with more than max_num_speculative_tokens + 1, is
  INVALID_ARGUMENT and commits nothing; one of exactly max + 1 tokens is verified (a classic block of max + 1
  is still refused); the KV-capacity check counts the positions a bonus_drafted block scores (n − 1 past the
  committed length);
- greedy: a bonus_drafted block made of the target's own greedy tokens is accepted whole with
  next_token_id = -1 and is_bonus false, the committed tokens are target-only decoding's; the same tokens as a
  classic block end with the target's bonus token; a wrong last token is rejected and replaced by the target's
  (the bonus_drafted position goes through the rejection rule).
"""

from __future__ import annotations

import uuid

import grpc
import pytest

from specdec_runtime.cloud_verifier.store import RedisSessionStore
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec.embedded import EmbeddedServer
from specdec_runtime.common.v1 import verifier_pb2 as pb
from specdec_runtime.common.v1 import verifier_pb2_grpc as pb_grpc
from _reference import hf_greedy

pytestmark = [pytest.mark.timeout(300), pytest.mark.redis]

MAX_BLOCK = 3
WAIT_S = 30.0
PROMPT = [1, 504, 3458, 28]
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def server(tiny_pair, redis_url):
    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    store = RedisSessionStore(redis_url, prefix=prefix, ttl_s=60)
    verifier = Verifier(TargetRunner(tiny_pair.target_dir), store, verifier_id="bonus-drafted",
                        max_num_speculative_tokens=MAX_BLOCK, max_batch_wait_ms=1.0)
    embedded = EmbeddedServer(verifier=verifier, grace_s=1.0)
    address = embedded.start(timeout_s=WAIT_S)
    yield address
    embedded.stop(timeout_s=WAIT_S)
    keys = list(store.client.scan_iter(match=f"{prefix}*"))
    if keys:
        store.client.delete(*keys)
    store.close()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server) as ch:
        grpc.channel_ready_future(ch).result(timeout=WAIT_S)
        yield pb_grpc.VerifierStub(ch)


@pytest.fixture(scope="module")
def reference(tiny_pair):
    return hf_greedy(tiny_pair.target_dir, PROMPT, 12)


def open_session(stub, *, temperature=0.0, max_new_tokens=32) -> tuple[str, int]:
    opened = stub.OpenSession(pb.OpenSessionRequest(
        prompt_token_ids=PROMPT,
        sampling=pb.SamplingParams(temperature=temperature, seed=3, has_seed=True),
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True),
    ), timeout=WAIT_S)
    return opened.session_id, opened.committed_length


def block(sid, seq, length, ids, bonus_drafted=True) -> pb.DraftBlock:
    return pb.DraftBlock(session_id=sid, seq=seq, committed_length=length, draft_token_ids=list(ids),
                         bonus_drafted=bonus_drafted)


def committed(stub, sid) -> list[int]:
    return list(stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=WAIT_S).committed_token_ids)


@pytest.mark.parametrize("ids,needle", [([], "at least one"), ([5] * (MAX_BLOCK + 2), "+ 1")],
                         ids=["empty", "max+2"])
def test_bonus_drafted_length_rule_refused(stub, ids, needle):
    sid, length = open_session(stub)
    before = committed(stub, sid)
    with pytest.raises(grpc.RpcError) as e:
        stub.VerifyBlock(block(sid, 1, length, ids), timeout=WAIT_S)
    assert e.value.code() == INVALID, e.value.details()
    assert needle in e.value.details()
    assert committed(stub, sid) == before  # nothing committed
    # the session still works: the same seq with a valid bonus_drafted block of max + 1 tokens
    v = stub.VerifyBlock(block(sid, 1, length, [5] * (MAX_BLOCK + 1)), timeout=WAIT_S)
    assert v.seq == 1 and v.committed_length > length


def test_classic_block_of_max_plus_one_still_refused(stub):
    sid, length = open_session(stub)
    with pytest.raises(grpc.RpcError) as e:
        stub.VerifyBlock(block(sid, 1, length, [5] * (MAX_BLOCK + 1), bonus_drafted=False), timeout=WAIT_S)
    assert e.value.code() == INVALID
    assert committed(stub, sid) == PROMPT


def test_bonus_drafted_capacity_counts_scored_positions(stub, reference):
    # capacity = prompt + 2: a bonus_drafted block of 3 scores positions up to length + 2 (fits), 4 does not
    sid, length = open_session(stub, max_new_tokens=2)
    with pytest.raises(grpc.RpcError) as e:
        stub.VerifyBlock(block(sid, 1, length, reference[:3] + [7]), timeout=WAIT_S)
    assert e.value.code() == INVALID and "limit" in e.value.details()
    assert committed(stub, sid) == PROMPT
    v = stub.VerifyBlock(block(sid, 1, length, reference[:3]), timeout=WAIT_S)
    assert v.finished and committed(stub, sid) == PROMPT + reference[:2]  # cut at max_new_tokens


def test_greedy_bonus_drafted_full_block_and_exactness(stub, reference):
    n = MAX_BLOCK + 1
    sid, length = open_session(stub)
    v = stub.VerifyBlock(block(sid, 1, length, reference[:n]), timeout=WAIT_S)
    assert (v.num_accepted, v.next_token_id, v.is_bonus, v.committed_length) == (n, -1, False, length + n)
    assert committed(stub, sid) == PROMPT + reference[:n]
    # next block: its last token wrong -> rejected there, replaced by the target's token
    wrong = (reference[2 * n - 1] + 1) % 1000
    v = stub.VerifyBlock(block(sid, 2, length + n, reference[n:2 * n - 1] + [wrong]), timeout=WAIT_S)
    assert (v.num_accepted, v.next_token_id, v.is_bonus) == (n - 1, reference[2 * n - 1], False)
    assert committed(stub, sid) == PROMPT + reference[:2 * n]  # target-only decoding's tokens
    # the classic rule on the same kind of block: all accepted, then the bonus token
    sid2, length2 = open_session(stub)
    v = stub.VerifyBlock(block(sid2, 1, length2, reference[:MAX_BLOCK], bonus_drafted=False), timeout=WAIT_S)
    assert (v.num_accepted, v.next_token_id, v.is_bonus) == (MAX_BLOCK, reference[MAX_BLOCK], True)
