"""The draft's concurrent, chunked prefill (edge_client.drafting.prefill, ModelDrafter.prefill_step) on the tiny ONNX
draft: stopped anywhere and resumed, it leaves the KV a prefill from scratch leaves (the next logits equal a fresh
draft's); ``whole_chunks`` stops at the last chunk boundary; it follows tokens appended while it runs; it never
feeds past the draft's context."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_runtime.edge_client.drafting.prefill import DraftPrefill, can_prefill
from specdec_runtime.edge_client.drafting.drafter import PREFILL_CHUNK_TOKENS, ModelDrafter
from specdec_runtime.edge_client.drafting.ngram import NgramDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel


@pytest.fixture(scope="module")
def models(tiny_pair):
    return OnnxDraftModel(tiny_pair.draft_dir), OnnxDraftModel(tiny_pair.draft_dir)


def _ids(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(5, 500, size=n)]


def test_stopped_and_resumed_prefill_equals_a_fresh_one(models):
    model, fresh_model = models
    drafter, fresh = ModelDrafter(model), ModelDrafter(fresh_model)
    ids = _ids(150)
    first = DraftPrefill(drafter, ids)
    first.stop()  # after at most one chunk
    assert drafter.uncached(ids) >= 149 - PREFILL_CHUNK_TOKENS
    second = DraftPrefill(drafter, ids)
    assert second.wait_ready(60)
    assert second.ready and second.num_unseen() == 0 and drafter.uncached(ids) == 0
    second.stop()
    np.testing.assert_allclose(drafter.next_token_logits(ids), fresh.next_token_logits(ids), atol=1e-4)


def test_whole_chunks_and_following_appended_tokens(models):
    model, _ = models
    drafter = ModelDrafter(model)
    committed = _ids(100, seed=1)
    prefill = DraftPrefill(drafter, committed, whole_chunks=True)
    prefill.wait_ready(60)
    prefill.stop()
    assert drafter.uncached(committed) == 99 % PREFILL_CHUNK_TOKENS  # the rest is the first block's
    committed += _ids(40, seed=2)  # what the cloud committed meanwhile
    prefill = DraftPrefill(drafter, committed)
    prefill.wait_ready(60)
    prefill.stop()
    assert prefill.ready and drafter.uncached(committed) == 0 and prefill.num_fed == 139 - 96


def test_no_prefill_past_the_context_and_who_can_prefill(models):
    model, _ = models
    drafter = ModelDrafter(model)
    context = model.max_position_embeddings
    assert context and can_prefill(drafter) and not can_prefill(NgramDrafter()) and not can_prefill(None)
    ids = _ids(context + 20, seed=3)
    prefill = DraftPrefill(drafter, ids)
    prefill.wait_ready(120)
    prefill.stop()  # no error: it stops at the context, where drafting stops too (room() is 0)
    assert model.num_cached == context and drafter.room(len(ids)) == 0


def test_a_deferred_start_and_the_ready_callback(models):
    """``start=False`` feeds nothing until :meth:`DraftPrefill.start` (and stopping it unstarted is fine);
    ``on_ready`` runs once, in the prefill's thread, when it is caught up — before the thread ends."""
    import threading

    model, _ = models
    drafter = ModelDrafter(model)
    drafter.reset()
    ids = _ids(70, seed=3)
    unstarted = DraftPrefill(drafter, ids, start=False)
    unstarted.stop()
    assert drafter.uncached(ids) == 69 and not unstarted.ready  # nothing fed
    prefill = DraftPrefill(drafter, ids, start=False)
    calls = []
    prefill.on_ready = lambda: calls.append((threading.current_thread().name, prefill.ready))
    assert not prefill.wait_ready(0.2) and drafter.uncached(ids) == 69  # not started yet
    prefill.start()
    prefill.start()  # once only
    assert prefill.wait_ready(60)
    prefill.stop()
    assert calls == [("draft-prefill", True)] and drafter.uncached(ids) == 0
