"""Structured output off the happy path, end to end with real components (tiny pair, real gRPC, real Redis):

- route=device (the draft alone, no verifier listening): the draft decodes under the same grammar mask, so the
  output still parses and validates; the tiny draft is the target exported, so it equals target-only constrained
  greedy decoding (HF generate masked by common.grammar).
- failover: a schema-constrained session whose replica stops mid-generation finishes on the other replica (it
  resumes the session from the Redis record and replays the committed ids into its matcher) token-identical to
  target-only under the same grammar.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec_runtime.cloud_verifier.store import RedisSessionStore
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.grammar import GrammarSpec
from specdec_runtime.common.types import FinishReason
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import EmbeddedServer
from test_structured_output import EOS, SCHEMAS, masked_greedy

pytestmark = pytest.mark.timeout(400)

SCHEMA = SCHEMAS[0]  # nested object: strings, an integer, required keys
MAX_NEW = 80


@pytest.fixture(scope="module")
def hf_target(tiny_pair):
    return AutoModelForCausalLM.from_pretrained(tiny_pair.target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def draft(tiny_pair):
    return OnnxDraftModel(tiny_pair.draft_dir)


@pytest.mark.parametrize("prompt", ["Give me JSON.", "A user record:"])
def test_route_device_decodes_under_the_grammar(tiny_pair, hf_target, draft, prompt):
    spec = GrammarSpec.json_schema(SCHEMA)
    ids = encode_prompt(draft.tokenizer, prompt)
    backend = FailoverBackend("127.0.0.1:1", policy=RetryPolicy(connect_timeout_s=0.5, budget_s=1.0), connect=False)
    with EdgeClient(backend, ModelDrafter(draft, draft_top_k=5), draft.tokenizer, num_speculative_tokens=3) as client:
        chunks = list(client.stream_chunks(ids, max_new_tokens=MAX_NEW, route="device", grammar=spec))
        result = client.last_result
    assert chunks and not any(c.verified for c in chunks)
    assert result.num_sessions == 0 and result.num_unverified_tokens == len(result.token_ids)
    assert result.finish_reason == FinishReason.EOS
    jsonschema.validate(json.loads(result.text), SCHEMA)
    ref = masked_greedy(hf_target, draft.tokenizer, ids, spec, MAX_NEW)
    assert result.token_ids in (ref, ref[:-1])


@pytest.fixture()
def two_replicas(tiny_pair, redis_url):
    """Two in-process verifiers (replica-a, replica-b) sharing one Redis under a private prefix, each behind
    its own gRPC server."""
    import uuid

    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    stores = [RedisSessionStore(redis_url, prefix=prefix, ttl_s=60) for _ in range(2)]
    runner = TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=8192)
    servers = [EmbeddedServer(verifier=Verifier(runner if i == 0 else TargetRunner(tiny_pair.target_dir,
                                                                                   kv_cache_budget_tokens=8192),
                                                stores[i], verifier_id=f"replica-{'ab'[i]}", max_batch_wait_ms=1.0),
                              grace_s=0.2) for i in range(2)]
    addresses = [s.start() for s in servers]
    yield servers, addresses
    for s in servers:
        s.stop(timeout_s=5.0)
    keys = list(stores[0].client.scan_iter(match=f"{prefix}*"))
    if keys:
        stores[0].client.delete(*keys)
    for st in stores:
        st.close()


@pytest.mark.redis
def test_constrained_session_survives_a_replica_change(tiny_pair, hf_target, two_replicas):
    (server_a, server_b), addresses = two_replicas
    spec = GrammarSpec.json_schema(SCHEMA)
    model = OnnxDraftModel(tiny_pair.other_draft_dir)  # low acceptance: many blocks before the switch
    ids = encode_prompt(model.tokenizer, "Describe a city.")
    ref = masked_greedy(hf_target, model.tokenizer, ids, spec, MAX_NEW)
    assert ref[-1] == EOS
    backend = FailoverBackend(addresses, policy=RetryPolicy(connect_timeout_s=5.0, budget_s=30.0))
    with EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=2) as client:
        chunks = client.stream_chunks(ids, max_new_tokens=MAX_NEW, grammar=spec)
        first = [next(chunks) for _ in range(3)]  # part of the output, verified on replica A
        server_a.stop(timeout_s=5.0)
        rest = list(chunks)
        result = client.last_result
    assert all(c.verified for c in first + rest) and rest
    assert result.num_failovers >= 1 and result.num_unverified_tokens == 0
    assert result.token_ids in (ref, ref[:-1]) and result.finish_reason == FinishReason.EOS
    jsonschema.validate(json.loads(result.text), SCHEMA)


@pytest.fixture(scope="module")
def local_verifier(tiny_pair):
    from specdec.embedded import LocalBackend

    backend = LocalBackend(Verifier(TargetRunner(tiny_pair.target_dir), max_num_speculative_tokens=8))
    yield backend
    backend.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_yields_to_a_grammar_that_can_only_end(tiny_pair, local_verifier, draft, temperature):
    """min_tokens=20 under a grammar whose whole language is short: where the grammar allows only EOS the
    grammar wins (EOS is not masked there; a row of nothing but −inf would have no distribution), on the verifier
    and on the draft, speculative and target-only alike: the output is the grammar's, ended by EOS."""
    spec = GrammarSpec("regex", "(yes|no)")
    ids = encode_prompt(draft.tokenizer, "Answer:")
    kw = dict(max_new_tokens=40, grammar=spec, min_tokens=20, temperature=temperature, seed=7)
    outputs = []
    for drafter in (ModelDrafter(draft, draft_top_k=5), None):
        client = EdgeClient(local_verifier, drafter, draft.tokenizer, num_speculative_tokens=4)
        result = client.generate(ids, **kw)
        assert result.text in ("yes", "no") and result.finish_reason == FinishReason.EOS
        outputs.append(result.token_ids)
    assert temperature > 0 or outputs[0] == outputs[1]


def test_a_constrained_session_lost_mid_generation_resumes_its_grammar(tiny_pair, hf_target, local_verifier):
    """The verifier loses a schema-constrained session mid-generation (its record gone, as after a store restarted
    empty): the SDK re-opens one over everything committed and says how much of it is output
    (num_output_tokens), so the new session's grammar starts at the turn's output start and replays the partial
    output into its matcher, not at the new prompt's end: the output is target-only constrained greedy's."""
    spec = GrammarSpec.json_schema(SCHEMA)
    model = OnnxDraftModel(tiny_pair.other_draft_dir)  # low acceptance: several blocks before the loss
    ids = encode_prompt(model.tokenizer, "Describe a city.")
    ref = masked_greedy(hf_target, model.tokenizer, ids, spec, MAX_NEW)
    client = EdgeClient(local_verifier, ModelDrafter(model), model.tokenizer, num_speculative_tokens=2)
    chunks = client.stream_chunks(ids, max_new_tokens=MAX_NEW, grammar=spec)
    streamed = list(next(chunks).token_ids) + list(next(chunks).token_ids)
    assert 0 < len(streamed) < len(ref) - 2
    [session_id] = list(local_verifier.verifier.sessions._sessions)  # the generation's one session
    assert local_verifier.verifier.close_session(session_id)
    streamed += [t for chunk in chunks for t in chunk.token_ids]
    result = client.last_result
    assert result.num_reopened_sessions == 1
    assert result.token_ids == streamed and result.token_ids in (ref, ref[:-1])
    jsonschema.validate(json.loads(result.text), SCHEMA)
