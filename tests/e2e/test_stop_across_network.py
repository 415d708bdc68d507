"""Stop strings across the network and across replicas.

- Over gRPC: the EdgeClient through GrpcBackend to an EmbeddedServer stops exactly where the in-process run
  (LocalBackend) stops, on a stop string that spans two tokens inside a fully accepted draft block (the draft is
  the target's own weights: greedy blocks are accepted whole): same tokens, same text (which ends right before
  the stop string: nothing of the stop string or after it), same streamed deltas, and nothing after the stop
  committed on the verifier (GetSession).
- Across replicas: two verifiers share one Redis store (``cloud_verifier.store.make_store``, unique key prefix).
  A session opened on A with that stop string commits, on A, up to the token holding the first half of the
  stop string; then its blocks go to B, which resumes the session from the store (re-prefill, stopping state
  rebuilt from the committed tokens). The output must stop exactly where an uninterrupted run stops.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

import pytest

from _reference import hf_greedy
from specdec_runtime.cloud_verifier.config import VerifierSettings
from specdec_runtime.cloud_verifier.store import make_store
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.types import DraftBlock, FinishReason, OpenRequest, SamplingParams, StoppingCriteria
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import EmbeddedServer, LocalBackend
from specdec_runtime.common.v1 import verifier_pb2 as pb

pytestmark = [pytest.mark.timeout(180)]

GAMMA = 4
MAX_NEW = 24
WAIT_S = 30.0
PROMPTS = ["Write a limerick about a cat.", "Why is the sky blue?", "List three prime numbers."]


@dataclass(frozen=True)
class StopCase:
    prompt_ids: list[int]
    reference: list[int]  # target-only greedy tokens (MAX_NEW of them)
    index: int  # the stop string spans token `index` and `index + 1`
    stop: str
    text: str  # the expected output text: everything before the stop string

    @property
    def tokens(self) -> list[int]:
        """The expected output: up to and including the token that completes the stop string."""
        return self.reference[: self.index + 2]


@pytest.fixture(scope="module")
def runner(tiny_pair):
    return TargetRunner(tiny_pair.target_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    return OnnxDraftModel(tiny_pair.draft_dir).tokenizer


@pytest.fixture(scope="module")
def case(tiny_pair, tokenizer) -> StopCase:
    """A two-character stop string made of the last character of token i and the first of token i + 1, where
    token i + 1 is an accepted draft token in the middle of a γ = 4 block (blocks of 5 committed tokens: draft
    tokens at output positions 5b .. 5b + 3, bonus at 5b + 4) with at least one accepted draft token after it."""
    for prompt in PROMPTS:
        ids = encode_prompt(tokenizer, prompt)
        ref = hf_greedy(tiny_pair.target_dir, ids, MAX_NEW)
        texts = [tokenizer.decode(ref[: j + 1], skip_special_tokens=True) for j in range(len(ref))]
        for i in range(3, len(ref) - 2):
            if (i + 1) % (GAMMA + 1) > GAMMA - 2 or not texts[i + 1].startswith(texts[i]):
                continue
            if not texts[i].startswith(texts[i - 1]):
                continue
            a, b = texts[i][len(texts[i - 1]):], texts[i + 1][len(texts[i]):]
            if not a or not b:
                continue
            stop = a[-1] + b[0]
            if stop in texts[i] or stop.isspace():
                continue
            cut = texts[i + 1].index(stop)
            return StopCase(ids, ref, i, stop, texts[i + 1][:cut])
    pytest.fail("no prompt gives a usable two-token stop string")  # the tiny pair is fixed: this would be a bug


def _client(backend, draft_dir) -> EdgeClient:
    model = OnnxDraftModel(draft_dir)
    return EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=GAMMA)


def _generate(client: EdgeClient, case: StopCase):
    deltas = list(client.stream(case.prompt_ids, max_new_tokens=MAX_NEW, stop=[case.stop], ignore_eos=True))
    return client.last_result, deltas


def test_stop_string_over_grpc_matches_in_process(tiny_pair, runner, case):
    # fixed verification: the case is built on whole blocks (an adaptive cut depends on timing, so the two runs'
    # blocks could differ; cut blocks keep the tokens: tests/e2e/test_adaptive_verification.py)
    local = LocalBackend(Verifier(runner, verify_policy="fixed"))
    try:
        want, want_deltas = _generate(_client(local, tiny_pair.draft_dir), case)
    finally:
        local.close()
    # the in-process run itself: stops on the stop string, right after the token that completes it
    assert want.finish_reason == FinishReason.STOP_STRING
    assert want.token_ids == case.tokens
    assert want.text == case.text and case.stop not in want.text
    assert "".join(want_deltas) == want.text
    # the stop fell inside the accepted prefix of the last block: every earlier block committed its accepted
    # tokens + one token of the target's, the last one only accepted tokens up to the stop (next token -1)
    assert want.stats.num_accepted_tokens == len(case.tokens) - (want.stats.num_drafts - 1)
    assert want.stats.num_draft_tokens > want.stats.num_accepted_tokens

    verifier = Verifier(runner, verify_policy="fixed")
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address:
        backend = GrpcBackend(address, connect_timeout_s=WAIT_S)
        client = _client(backend, tiny_pair.draft_dir)
        try:
            got, got_deltas = _generate(client, case)
            assert backend.wire_stats(got.session_id).bytes_received > 0  # it did travel over gRPC
        finally:
            client.close()
    assert got.finish_reason == FinishReason.STOP_STRING
    assert got.token_ids == want.token_ids
    assert got.text == want.text and got_deltas == want_deltas
    assert case.stop not in got.text and not any(case.stop in d for d in got_deltas)
    assert got.stats.num_drafts == want.stats.num_drafts
    assert got.stats.num_accepted_tokens == want.stats.num_accepted_tokens


@pytest.mark.redis
def test_stop_string_after_resume_on_another_replica(tiny_pair, runner, case, redis_url):
    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    settings = VerifierSettings(redis_url=redis_url, redis_prefix=prefix, session_ttl_s=60, metrics_port=0)
    stores = [make_store(settings) for _ in range(2)]
    verifiers = [Verifier(runner, st, verifier_id=f"replica-{n}", max_num_speculative_tokens=GAMMA)
                 for n, st in zip("ab", stores)]
    sampling = SamplingParams(seed=1)
    stopping = StoppingCriteria(max_new_tokens=MAX_NEW, stop_strings=(case.stop,), ignore_eos=True)
    try:
        with EmbeddedServer(verifier=verifiers[0], grace_s=1.0) as addr_a, \
                EmbeddedServer(verifier=verifiers[1], grace_s=1.0) as addr_b, \
                GrpcBackend(addr_a) as a, GrpcBackend(addr_b) as b:
            drafter = ModelDrafter(OnnxDraftModel(tiny_pair.draft_dir))
            opened = a.open_session(OpenRequest(case.prompt_ids, sampling, stopping), timeout_s=WAIT_S)
            assert opened.verifier_id == "replica-a"
            sid, committed, seq = opened.session_id, list(case.prompt_ids), 0
            capacity = len(case.prompt_ids) + MAX_NEW

            def step(backend, gamma):
                nonlocal seq
                seq += 1
                seeded = dataclasses.replace(sampling, seed=opened.seed)
                block = drafter.propose(committed, gamma, seeded) if gamma else DraftBlock([])
                verdict = backend.submit(sid, seq, len(committed), block).result(timeout=WAIT_S)
                committed.extend(verdict.committed_token_ids)
                return verdict

            # on A: up to and including token `index` (the first half of the stop string), not further
            steps_a = 0
            while len(committed) - len(case.prompt_ids) < case.index + 1:
                generated = len(committed) - len(case.prompt_ids)
                verdict = step(a, min(2, case.index - generated))  # short blocks: several steps on A
                steps_a += 1
                assert not verdict.finished
                assert steps_a <= MAX_NEW
            assert committed[len(case.prompt_ids):] == case.reference[: case.index + 1]
            assert steps_a >= 2  # several blocks on A
            assert verifiers[1].num_sessions == 0
            # on B: it resumes the session from Redis and must stop exactly where an uninterrupted run stops
            for _ in range(MAX_NEW):
                verdict = step(b, min(GAMMA, capacity - len(committed) - 1))
                if verdict.finished:
                    break
            assert verifiers[1].num_sessions == 1  # B holds it now
            assert verdict.finished and verdict.finish_reason == FinishReason.STOP_STRING
            assert committed[len(case.prompt_ids):] == case.tokens
            info = b.get_session(sid)
            assert list(info.committed_token_ids) == case.prompt_ids + case.tokens
            assert info.finished and info.finish_reason == pb.FINISH_REASON_STOP_STRING
            assert info.verifier_id == "replica-b"
            assert a.get_session(sid).committed_token_ids == info.committed_token_ids  # one shared truth
            # and an uninterrupted run on A alone gives the same output
            client = EdgeClient(a, ModelDrafter(OnnxDraftModel(tiny_pair.draft_dir)), drafter.model.tokenizer,
                                num_speculative_tokens=GAMMA)
            whole, _ = _generate(client, case)
            assert whole.token_ids == case.tokens and whole.finish_reason == FinishReason.STOP_STRING
            b.close_session(sid)
    finally:
        keys = list(stores[0].client.scan_iter(match=f"{prefix}*"))
        if keys:
            stores[0].client.delete(*keys)
        for st in stores:
            st.close()
