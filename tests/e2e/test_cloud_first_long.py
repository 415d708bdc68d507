"""A long prompt (~4,000 tokens) on route=cloud-first with the real SmolLM2 pair over gRPC on 127.0.0.1: the draft's
chunked prefill runs in its own thread and does not hold back the cloud's first tokens (the draft's prefill is
held at a gate that only the first cloud token opens: had that token waited for the prefill, the gate would stay
shut until its deadline), the session hands over to speculative only once it is, the prefill stops within one
chunk when the generation ends first, and the output is token-identical to target-only decoding."""

from __future__ import annotations

import threading

import pytest

from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.edge_client.client import EdgeClient
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import EmbeddedServer

pytestmark = pytest.mark.timeout(600)

GATE_DEADLINE_S = 120.0


class _GatedDrafter(ModelDrafter):
    """The real drafter, whose first prefill chunk waits until the consumer has seen a token (or a deadline)."""

    def __init__(self, model):
        super().__init__(model)
        self.first_token_seen = threading.Event()
        self.gate_opened_by_token: bool | None = None

    def prefill_step(self, token_ids, whole_chunks=False):
        if self.gate_opened_by_token is None:
            self.gate_opened_by_token = self.first_token_seen.wait(GATE_DEADLINE_S)
        return super().prefill_step(token_ids, whole_chunks)


def test_a_4k_prompt_does_not_hold_back_the_first_cloud_token(real_pair):
    model = OnnxDraftModel(real_pair.draft_dir)
    text = " ".join(f"Item {i}: the {i}th entry of a long log that the assistant must read." for i in range(180))
    ids = model.tokenizer.encode(text)
    assert len(ids) >= 3500
    verifier = Verifier(TargetRunner(real_pair.target_dir, kv_cache_budget_tokens=16384), max_batch_wait_ms=1.0)
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address, GrpcBackend(address) as backend:
        target_only = EdgeClient(backend, None, model.tokenizer).generate(ids, max_new_tokens=40, ignore_eos=True)
        drafter = _GatedDrafter(model)
        client = EdgeClient(backend, drafter, model.tokenizer, num_speculative_tokens=4, route="cloud-first")
        for chunk in client.stream_chunks(ids, max_new_tokens=40, ignore_eos=True):
            if chunk.token_ids:
                drafter.first_token_seen.set()
        result = client.last_result
    route = result.route
    print(route)
    assert result.token_ids == target_only.token_ids
    assert route["initial"] == "cloud" and route["tokens"]["cloud"] > 0
    # the prefill started and the cloud's first token reached the consumer while it was held: the cloud never
    # waits for the draft
    assert drafter.gate_opened_by_token is True
    ready = route.get("draft_ready_s")
    assert ready is None or route["final"] == "speculative"
