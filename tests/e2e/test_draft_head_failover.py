"""A draft head across a failover gets the target's features of the positions whose verdict was lost
(DraftBlock.features_from, cloud_verifier/session/features.py).

Real verifiers (two embedded gRPC servers over the tiny target sharing a real Redis) and a tiny random EAGLE-3
head converted as tests/e2e/test_draft_head.py does. Replica A's store hangs right after its third commit of the
generation lands (a replica that died between its commit and its answer): the client's attempt times out, the
retry on B is refused (the committed length moved) and its verdict is read back from the store, which keeps no
features. B re-prefilled the session for that retry; the next block says from which position the head lacks
features and B's verdict brings them. The same for a cloud-decode stream (route=cloud) resumed on B after A
stopped with a token committed unanswered, and for a chat's next turn (ExtendSession) after a turn whose last
verdict was lost. Output token-identical to target-only; every committed position (the
lost ones included) holds the target's feature, equal to HF's hidden states fused by the head.
"""

from __future__ import annotations

import logging
import threading
import uuid

import numpy as np
import pytest
import torch

from _heads import write_eagle3
from _reference import hf_greedy
from specdec_runtime.cloud_verifier.store import RedisSessionStore

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]

PROMPT = "Tell me a story about a robot who learns to paint."
DRAFT_VOCAB = sorted(set(range(0, 49152, 61)) | set(range(200)))
WAIT_S = 60.0
NEW_TOKENS = 24


class _HangAfterCommit(RedisSessionStore):
    """A's store: the ``hang_at``-th commit (or, with ``hang_at`` 0, the first that finishes the session) lands
    in Redis, then the verifier never hears back (until released)."""

    hang_at = 3

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.commits, self.hung, self.released = 0, threading.Event(), threading.Event()

    def append_committed(self, session_id, expected_length, token_ids, seq, finished, *a, **kw):
        length = super().append_committed(session_id, expected_length, token_ids, seq, finished, *a, **kw)
        self.commits += 1
        if not self.hung.is_set() and (self.commits == self.hang_at or (self.hang_at == 0 and finished)):
            self.hung.set()
            self.released.wait(WAIT_S)
        return length


class _HangAtTheTurnsEnd(_HangAfterCommit):
    hang_at = 0


@pytest.fixture(scope="module")
def head_dir(tiny_pair, tmp_path_factory):
    from specdec.models.head_export import export_head

    root = tmp_path_factory.mktemp("head-failover")
    ckpt = write_eagle3(root / "eagle3-ckpt", tiny_pair.target_dir, DRAFT_VOCAB)
    return export_head(tiny_pair.target_dir, ckpt, root / "eagle3")


def _target_features(target_dir, ids: list[int], layers) -> np.ndarray:
    """HF's hidden states of ``ids`` at ``layers`` (-1: the final normed state), concatenated: float32 [n, width]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.model(torch.tensor([ids]), output_hidden_states=True)
    states = list(out.hidden_states[:-1]) + [out.last_hidden_state]
    return torch.cat([states[len(states) - 1 if i == -1 else i][0] for i in layers], dim=-1).numpy()


def _across_a_failover(tiny_pair, head_dir, redis_url, caplog, run, store_a_class=_HangAfterCommit,
                       stop_a: bool = False):
    """``run(client)`` with a head over replicas A and B (A preferred) while one commit of A lands unanswered
    (``store_a_class``); ``stop_a``: A is then stopped (its streams cancelled), else the client's attempt times
    out. Returns (what run returned, the drafter, the number of failovers)."""
    from specdec.embedded import EmbeddedServer
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.head import HeadDrafter
    from specdec_runtime.edge_client.drafting.head_model import OnnxHead
    from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy

    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    store_a = store_a_class(redis_url, prefix=prefix, ttl_s=60)
    store_b = RedisSessionStore(redis_url, prefix=prefix, ttl_s=60)
    servers = [EmbeddedServer(verifier=Verifier(TargetRunner(tiny_pair.target_dir), store, verifier_id=vid,
                                                max_batch_wait_ms=1.0), grace_s=1.0)
               for store, vid in ((store_a, "replica-a"), (store_b, "replica-b"))]
    head = OnnxHead(head_dir)
    drafter = HeadDrafter(head)
    stopper = threading.Thread(target=lambda: store_a.hung.wait(WAIT_S) and servers[0].stop(timeout_s=WAIT_S),
                               daemon=True)
    try:
        addresses = [s.start(timeout_s=WAIT_S) for s in servers]
        if stop_a:
            stopper.start()
        policy = RetryPolicy(connect_timeout_s=2.0, budget_s=30.0, attempt_timeout_s=2.0)
        backend = FailoverBackend(addresses, policy=policy)
        with caplog.at_level(logging.INFO, logger="specdec_runtime.edge_client.transport.failover"), \
                EdgeClient(backend, drafter, head.tokenizer, num_speculative_tokens=4) as client:
            out = run(client)
        assert store_a.hung.is_set()
    finally:
        store_a.released.set()
        if stopper.is_alive():
            stopper.join(WAIT_S)
        for s in servers:
            s.stop(timeout_s=WAIT_S)
        keys = list(store_b.client.scan_iter(match=f"{prefix}*"))
        if keys:
            store_b.client.delete(*keys)
        store_a.close()
        store_b.close()
    return out, drafter, backend.num_failovers


def _generate(tiny_pair, head_dir, redis_url, caplog, stop_a: bool, **options):
    """One generation across a failover (:func:`_across_a_failover`), token-identical to target-only; returns
    (result, drafter, committed ids)."""
    from specdec_runtime.edge_client.client import encode_prompt

    result, drafter, failovers = _across_a_failover(
        tiny_pair, head_dir, redis_url, caplog, stop_a=stop_a,
        run=lambda client: client.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, **options))
    assert failovers >= 1
    prompt_ids = encode_prompt(drafter.model.tokenizer, PROMPT)
    assert result.token_ids == hf_greedy(tiny_pair.target_dir, prompt_ids, NEW_TOKENS)
    return result, drafter, prompt_ids + list(result.token_ids)


def _assert_target_features_everywhere(tiny_pair, drafter, committed: list[int]) -> None:
    """Every committed position but the last holds the target's feature (HF's hidden states, fused)."""
    n = drafter._target_features_for(committed)
    assert n == len(committed) - 1
    assert drafter._known[:n].all(), np.flatnonzero(~drafter._known[:n])
    head = drafter.model
    want = head.fuse(_target_features(tiny_pair.target_dir, committed, head.feature_request.layers)[:n])
    np.testing.assert_allclose(drafter._features[:n], want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_a_head_gets_the_lost_positions_features_after_a_failover(tiny_pair, head_dir, redis_url, caplog):
    """Speculative blocks: the retry on B is refused (A committed it), its verdict read back from the store; the
    next block says the head lacks features from there, and B's verdict brings them."""
    _, drafter, committed = _generate(tiny_pair, head_dir, redis_url, caplog, stop_a=False)
    assert "verdict rebuilt from the store" in caplog.text  # a block's verdict was lost and read back
    _assert_target_features_everywhere(tiny_pair, drafter, committed)


def test_a_cloud_decode_stream_resumed_elsewhere_brings_the_lost_tokens_features(tiny_pair, head_dir, redis_url,
                                                                                 caplog):
    """route=cloud: A's stream stops after its third token landed in the store unanswered (A is stopped while its
    commit hangs: nothing more commits there); the token is read back from the store and the stream resumed on
    B says from where the head lacks features: B's first verdict brings them."""
    result, drafter, committed = _generate(tiny_pair, head_dir, redis_url, caplog, stop_a=True, route="cloud")
    assert result.route["tokens"]["cloud"] == NEW_TOKENS
    _assert_target_features_everywhere(tiny_pair, drafter, committed)


def test_the_next_turn_brings_the_features_of_a_turns_last_verdict_lost(tiny_pair, head_dir, redis_url, caplog):
    """A chat: the commit that ends the first turn lands on A unanswered; its retry on B is refused (finished)
    and read back from the store, so the turn ends with positions the head lacks. The second turn's
    ExtendSession (on B, which resumed the session for that retry) says so and its answer brings them."""
    turn = 12

    def chat(client):
        replies = []
        with client.chat(max_new_tokens=turn, ignore_eos=True) as conversation:
            for message in ("Hi there.", "And then?"):
                "".join(c.text for c in conversation.send(message))
                replies.append((client.last_result.token_ids, list(conversation.history_ids)))
        return replies

    replies, drafter, failovers = _across_a_failover(tiny_pair, head_dir, redis_url, caplog, chat,
                                                     store_a_class=_HangAtTheTurnsEnd)
    assert failovers >= 1 and "verdict rebuilt from the store" in caplog.text
    for got, history in replies:
        assert got == hf_greedy(tiny_pair.target_dir, history[: len(history) - turn], turn)
    _assert_target_features_everywhere(tiny_pair, drafter, replies[-1][1])
