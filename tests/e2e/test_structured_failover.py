"""Structured output across a replica crash, with real processes: two `specdec serve` replicas (tiny target)
sharing a real Redis, the SDK given both addresses, a json_schema grammar on the session. The replica serving
the session is SIGKILLed mid-generation (no drain, no give-up in the store); the survivor resumes the session
from its Redis record, rebuilds the grammar from the spec the record carries and replays the committed ids into
its matcher. The output must be token-identical to target-only constrained greedy decoding (HF generate masked
by common.grammar) and validate against the schema.
"""

from __future__ import annotations

import json
import signal

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM

from _cluster import kill
from specdec_runtime.common.grammar import GrammarSpec
from specdec_runtime.common.types import FinishReason
from specdec_runtime.edge_client.client import encode_prompt
from test_replica_failover import _drafts, _sdk_client, cluster  # noqa: F401 - cluster: the two-replica fixture
from test_structured_output import EOS, SCHEMAS, masked_greedy

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(600)]

SCHEMA = SCHEMAS[0]  # nested object: strings, an integer, required keys (~30 tokens of output)
PROMPT = "Describe a city."
MAX_NEW = 60


@pytest.fixture(scope="module")
def hf_target(tiny_pair):
    return AutoModelForCausalLM.from_pretrained(tiny_pair.target_dir, dtype=torch.float32).eval()


def test_constrained_session_sigkill_mid_run_finishes_on_survivor_identical(cluster, tiny_pair,  # noqa: F811
                                                                            hf_target):
    """json_schema session, greedy, the replica holding it SIGKILLed after a few verified chunks: the survivor
    finishes it; token ids equal target-only constrained greedy, the JSON validates, num_failovers >= 1."""
    (a, b), _ = cluster
    spec = GrammarSpec.json_schema(SCHEMA)
    with _sdk_client([a.address, b.address], tiny_pair.other_draft_dir, num_speculative_tokens=2) as client:
        ids = encode_prompt(client.tokenizer, PROMPT)
        ref = masked_greedy(hf_target, client.tokenizer, ids, spec, MAX_NEW)
        assert ref[-1] == EOS, "the reference must finish within MAX_NEW"
        chunks = client.stream_chunks(ids, max_new_tokens=MAX_NEW, grammar=spec)
        first = [next(chunks) for _ in range(3)]  # low-acceptance draft: a few short blocks, verified on A
        assert _drafts(a) > 0 and b.metric("specdec_sessions_resumed_total") == 0
        kill(a, signal.SIGKILL)
        rest = list(chunks)
        result = client.last_result
    assert rest, "the output ended before A was killed"
    assert all(c.verified for c in first + rest)
    assert result.num_failovers >= 1 and result.num_unverified_tokens == 0
    assert b.metric("specdec_sessions_resumed_total") >= 1
    assert result.token_ids in (ref, ref[:-1]) and result.finish_reason == FinishReason.EOS
    jsonschema.validate(json.loads(result.text), SCHEMA)
