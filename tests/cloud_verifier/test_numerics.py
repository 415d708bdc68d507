"""Bad numbers from the model: a target forward whose logits for ONE row are NaN / +inf / all -inf / overflowing.

Fault injection on a real component: a real TargetRunner (tiny random Llama) whose ``forward`` is wrapped by the
test to corrupt the row of one session after the real forward pass. The corrupted session's block fails with
TargetOutputError (INTERNAL over gRPC, a clear message), nothing is committed, no id outside the vocabulary is
ever committed, the batch does not hang, the other session in the same forward pass gets exactly its
reference tokens, ``specdec_nonfinite_logits_total`` counts it, and the corrupted session's next block (the
fault gone) rebuilds its KV cache and continues exactly as the target would.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest

from _reference import hf_greedy
from specdec_runtime.cloud_verifier import metrics
from specdec_runtime.cloud_verifier.store import MemorySessionStore
from specdec_runtime.cloud_verifier.verdict.numerics import logits_fault, verify_row
from specdec_runtime.common.errors import TargetOutputError
from specdec_runtime.common.types import DraftBlock, SamplingParams, StoppingCriteria
from specdec_runtime.common.wire import block_to_proto, open_request_to_proto
from specdec.embedded import EmbeddedServer
from specdec_runtime.common.v1 import verifier_pb2 as pb
from specdec_runtime.common.v1 import verifier_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(180)

WAIT_S = 30.0
PROMPT_A = [1, 504, 3458, 28]
PROMPT_B = [1, 3458, 11, 905, 77]


class Corrupter:
    """Wraps a real TargetRunner's forward: after the real pass, the rows of the session whose KV cache is
    ``kv`` get ``kind`` written into their logits."""

    def __init__(self, runner):
        self.runner = runner
        self.inner = runner.forward
        self.kv = None
        self.kind = "nan"
        self.rows_corrupted = 0
        runner.forward = self.forward

    def forward(self, rows):
        out = self.inner(rows)
        for i, row in enumerate(rows):
            if self.kv is not None and row.kv is self.kv and out[i] is not None:
                x = np.array(out[i], copy=True)
                if self.kind == "nan":
                    x[0, 17] = np.nan
                elif self.kind == "posinf":
                    x[-1, 99] = np.inf
                elif self.kind == "allneginf":
                    x[0, :] = -np.inf
                out[i] = x
                self.rows_corrupted += 1
        return out

    def restore(self):
        self.runner.forward = self.inner


@pytest.fixture(scope="module")
def target_dir(tiny_pair) -> Path:
    return Path(tiny_pair.target_dir)


@pytest.fixture(scope="module")
def runner(target_dir):
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner

    return TargetRunner(target_dir, kv_cache_budget_tokens=8192)


@pytest.fixture
def corrupter(runner):
    c = Corrupter(runner)
    yield c
    c.restore()


@pytest.fixture(scope="module")
def references(target_dir):
    return {"A": hf_greedy(target_dir, PROMPT_A, 12), "B": hf_greedy(target_dir, PROMPT_B, 12)}


def _verifier(runner):
    from specdec_runtime.cloud_verifier.verifier import Verifier

    # a long batch wait: both sessions' blocks share one forward pass
    return Verifier(runner, MemorySessionStore(ttl_s=60), verifier_id="numerics", max_num_speculative_tokens=4,
                    max_batch_wait_ms=300.0)


def _nonfinite_count() -> float:
    return metrics.NONFINITE_LOGITS._value.get()


@pytest.mark.parametrize("kind,temperature", [("nan", 0.0), ("posinf", 0.8), ("allneginf", 0.0), ("nan", 1.0)])
def test_one_bad_row_fails_alone(runner, corrupter, references, kind, temperature):
    async def main():
        v = _verifier(runner)
        await v.start()
        try:
            stop = StoppingCriteria(max_new_tokens=12, ignore_eos=True)
            a = await v.open_session(PROMPT_A, SamplingParams(temperature=temperature, seed=5), stop)
            b = await v.open_session(PROMPT_B, SamplingParams(), stop)
            ref_a, ref_b = references["A"], references["B"]
            corrupter.kv, corrupter.kind = v.sessions.held(a.session_id).kv, kind
            before = _nonfinite_count()
            results = await asyncio.wait_for(asyncio.gather(
                v.verify(a.session_id, 1, len(PROMPT_A), DraftBlock(ref_a[:4])),
                v.verify(b.session_id, 1, len(PROMPT_B), DraftBlock(ref_b[:4])),
                return_exceptions=True), WAIT_S)
            err_a, verdict_b = results
            assert isinstance(err_a, TargetOutputError), err_a
            assert err_a.code == grpc.StatusCode.INTERNAL and "unusable logits" in str(err_a)
            assert corrupter.rows_corrupted == 1
            # the other row of the same forward pass: exactly the target's tokens
            assert not isinstance(verdict_b, BaseException), verdict_b
            assert verdict_b.batch_size == 2 and verdict_b.committed_token_ids == ref_b[:5]
            # nothing committed for A, its local copy dropped (KV rebuilt at its next block), one count
            assert v.get_session(a.session_id).committed_token_ids == PROMPT_A
            assert v.sessions.held(a.session_id) is None
            assert _nonfinite_count() == before + 1
            # the fault gone: A's next block resumes (re-prefill) and continues as the target would
            corrupter.kv = None
            verdict_a = await asyncio.wait_for(
                v.verify(a.session_id, 1, len(PROMPT_A), DraftBlock(ref_a[:4])), WAIT_S)
            if temperature == 0.0:
                assert verdict_a.committed_token_ids == ref_a[:5]
            assert all(0 <= t < v.valid_vocab_size for t in v.get_session(a.session_id).committed_token_ids)
            verdict_b2 = await v.verify(b.session_id, 2, len(PROMPT_B) + 5, DraftBlock(ref_b[5:9]))
            assert verdict_b2.committed_token_ids == ref_b[5:10]
        finally:
            await v.stop(1.0)
            v.shutdown()

    asyncio.run(main())


def test_grpc_maps_the_fault_to_internal(runner, corrupter, references):
    """Over gRPC: INTERNAL with the clear message for the corrupted session; a stream of the other session in
    flight at the same time is answered normally."""
    v = _verifier(runner)
    with EmbeddedServer(verifier=v, grace_s=1.0) as address, grpc.insecure_channel(address) as ch:
        stub = pb_grpc.VerifierStub(ch)
        stop = StoppingCriteria(max_new_tokens=12, ignore_eos=True)
        a = stub.OpenSession(open_request_to_proto(PROMPT_A, SamplingParams(), stop), timeout=WAIT_S).session_id
        b = stub.OpenSession(open_request_to_proto(PROMPT_B, SamplingParams(), stop), timeout=WAIT_S).session_id
        corrupter.kv, corrupter.kind = v.sessions.held(a).kv, "nan"
        fut_b = stub.VerifyBlock.future(block_to_proto(b, 1, len(PROMPT_B), DraftBlock(references["B"][:4])),
                                        timeout=WAIT_S)
        with pytest.raises(grpc.RpcError) as e:
            stub.VerifyBlock(block_to_proto(a, 1, len(PROMPT_A), DraftBlock(references["A"][:4])), timeout=WAIT_S)
        assert e.value.code() == grpc.StatusCode.INTERNAL and "NaN logits" in e.value.details()
        assert fut_b.result().committed_length == len(PROMPT_B) + 5
        info = stub.GetSession(pb.GetSessionRequest(session_id=a), timeout=WAIT_S)
        assert list(info.committed_token_ids) == PROMPT_A


def test_logits_fault_and_guarded_verify():
    vocab = 50
    ok = np.zeros((3, vocab), dtype=np.float32)
    assert logits_fault(ok) is None
    masked = ok.copy()
    masked[:, :10] = -np.inf  # masked tokens are fine
    assert logits_fault(masked) is None
    padded = ok.copy()
    padded[:, 45:] = np.nan  # padded columns past the vocabulary are ignored
    assert logits_fault(padded, valid_vocab_size=45) is None and logits_fault(padded) == "NaN logits"
    bad = ok.copy()
    bad[1, :] = -np.inf
    assert logits_fault(bad) == "a position with no finite logit"
    # the residual with no mass (p == q: the draft distribution is the target's) falls back to p: a valid token
    logits = np.random.default_rng(0).normal(size=(3, vocab)).astype(np.float32)
    result = verify_row(DraftBlock([3, 4]), logits, SamplingParams(temperature=1.0).seeded(11), 7, vocab)
    assert 0 <= result.next_token_id < vocab
    # finite logits that leave no distribution: logits / temperature overflows (a temperature validation refuses
    # at OpenSession, MIN_TEMPERATURE; the guard catches it anyway)
    with pytest.raises(TargetOutputError, match="no distribution"):
        verify_row(DraftBlock([3, 4]), logits * 1e3, SamplingParams(temperature=1e-310).seeded(11), 7, vocab)
