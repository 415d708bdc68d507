"""Logprobs survive a failover: a block that replica A committed but never answered is settled from the store
(GetSession), and the store keeps each committed token's logprobs with its id, so the settled block has them.

Real verifiers (two embedded gRPC servers, the tiny target, a real Redis). Replica A's store hangs right after
its third commit of the generation lands (a replica that died between its commit and its answer); the
client's attempt times out, the retry on B is refused (the committed length moved) and reconciled from the
store. Then A is stopped. The generation must have one logprob per token, token ids and logprobs (1e-4) equal
to a fault-free run on one in-process verifier.
"""

from __future__ import annotations

import logging
import threading
import uuid

import pytest

from specdec_runtime.cloud_verifier.store import RedisSessionStore

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]

PROMPT = "Tell me a story about a robot who learns to paint."
WAIT_S = 60.0
OPTIONS = dict(max_new_tokens=40, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)


class _HangAfterCommit(RedisSessionStore):
    """A's store: the ``hang_at``-th commit lands in Redis, then the verifier never hears back (until released)."""

    hang_at = 3

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.commits, self.hung, self.released = 0, threading.Event(), threading.Event()

    def append_committed(self, *a, **kw):
        length = super().append_committed(*a, **kw)
        self.commits += 1
        if self.commits == self.hang_at:
            self.hung.set()
            self.released.wait(WAIT_S)
        return length


def _client(backend, draft_dir):
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    model = OnnxDraftModel(draft_dir)
    return EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=3)


def test_logprobs_of_a_block_settled_from_the_store(tiny_pair, redis_url, caplog):
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
    from specdec.embedded import EmbeddedServer, LocalBackend

    local = LocalBackend(Verifier(TargetRunner(tiny_pair.target_dir)))
    try:
        reference = _client(local, tiny_pair.draft_dir).generate(PROMPT, **OPTIONS)
    finally:
        local.close()
    assert len(reference.logprobs) == len(reference.token_ids) == OPTIONS["max_new_tokens"]

    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    store_a = _HangAfterCommit(redis_url, prefix=prefix, ttl_s=60)
    store_b = RedisSessionStore(redis_url, prefix=prefix, ttl_s=60)
    servers = [EmbeddedServer(verifier=Verifier(TargetRunner(tiny_pair.target_dir), store, verifier_id=vid,
                                                max_batch_wait_ms=1.0), grace_s=1.0)
               for store, vid in ((store_a, "replica-a"), (store_b, "replica-b"))]
    try:
        addresses = [s.start(timeout_s=WAIT_S) for s in servers]
        policy = RetryPolicy(connect_timeout_s=2.0, budget_s=30.0, attempt_timeout_s=2.0)
        with caplog.at_level(logging.INFO, logger="specdec_runtime.edge_client.transport.failover"), \
                _client(FailoverBackend(addresses, policy=policy), tiny_pair.draft_dir) as client:
            result = client.generate(PROMPT, **OPTIONS)
        assert store_a.hung.is_set()
        store_a.released.set()
        servers[0].stop(timeout_s=WAIT_S)  # A goes away
    finally:
        store_a.released.set()
        for s in servers:
            s.stop(timeout_s=WAIT_S)
        keys = list(store_b.client.scan_iter(match=f"{prefix}*"))
        if keys:
            store_b.client.delete(*keys)
        store_a.close()
        store_b.close()
    assert "verdict rebuilt from the store" in caplog.text  # the settled block is in the output
    assert result.num_failovers >= 1
    assert result.token_ids == reference.token_ids
    assert len(result.logprobs) == len(result.token_ids)
    for got, want in zip(result.logprobs, reference.logprobs):
        assert abs(got.logprob - want.logprob) <= 1e-4
        assert got.top_token_ids == want.top_token_ids
        assert max(abs(a - b) for a, b in zip(got.top_logprobs, want.top_logprobs)) <= 1e-4
