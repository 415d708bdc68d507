"""The draft's prefix cache (edge_client.drafting.prefix_cache) over real gRPC on 127.0.0.1: 8 new sessions on one
client that share a long system prefix, each from an emptied draft KV cache, restore the prefix instead of
prefilling it (7 hits) and are token-identical to target-only decoding (greedy); a seeded sampled generation
gives the same tokens with the cache as with a draft that has none; the bound in MiB holds."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.edge_client.client import EdgeClient
from specdec_runtime.edge_client.drafting.prefix_cache import DraftPrefixCache
from specdec_runtime.edge_client.drafting.drafter import PREFILL_CHUNK_TOKENS, ModelDrafter
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import EmbeddedServer

pytestmark = pytest.mark.timeout(400)

SYSTEM = 440  # tokens of the shared prefix (the tiny pair's context is 512)


@pytest.fixture(scope="module")
def served(tiny_pair):
    verifier = Verifier(TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=8192), max_batch_wait_ms=1.0)
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address:
        yield address


def _prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    system = [int(t) for t in rng.integers(5, 900, size=SYSTEM)]
    return [system + [int(t) for t in rng.integers(5, 900, size=12 + i)] for i in range(n)]


def test_new_sessions_reuse_the_prefix_and_stay_target_only(tiny_pair, served):
    model = OnnxDraftModel(tiny_pair.draft_dir)
    drafter = ModelDrafter(model, draft_top_k=5, prefix_cache_mb=32)
    prompts = _prompts(8)
    with GrpcBackend(served) as backend:
        client = EdgeClient(backend, drafter, model.tokenizer, num_speculative_tokens=3)
        target_only = EdgeClient(backend, None, model.tokenizer)
        for i, ids in enumerate(prompts):
            drafter.reset()  # a new session on a draft that served something else meanwhile
            restored_before = drafter.prefix_cache.hits
            result = client.generate(ids, max_new_tokens=16, ignore_eos=True)
            assert result.token_ids == target_only.generate(ids, max_new_tokens=16, ignore_eos=True).token_ids, i
            assert drafter.prefix_cache.hits == restored_before + (i > 0), i
        assert drafter.prefix_cache.nbytes <= 32 * 2**20 and len(drafter.prefix_cache) >= 1
        kw = dict(max_new_tokens=24, temperature=1.0, top_k=20, ignore_eos=True, seed=3)
        cached = client.generate(prompts[3], **kw).token_ids  # the seeded reset, then the prefix restored
        fresh_model = OnnxDraftModel(tiny_pair.draft_dir)
        fresh = EdgeClient(backend, ModelDrafter(fresh_model, draft_top_k=5), model.tokenizer, num_speculative_tokens=3)
        assert cached == fresh.generate(prompts[3], **kw).token_ids


def test_the_lru_keeps_its_bound_and_aligned_prefixes():
    kv = [np.zeros((1, 2, 64, 32), np.float32) for _ in range(4)]  # 4 x 16 KiB
    cache = DraftPrefixCache(max_mb=0.1, align=PREFILL_CHUNK_TOKENS)  # room for one 64 KiB snapshot
    a, b = list(range(64)), list(range(100, 164))
    cache.store(a, kv)
    cache.store(list(range(33)), kv)  # not chunk-aligned: refused
    assert len(cache) == 1 and cache.lookup(a + [7, 8], 65)[0] == 64
    assert cache.lookup(a[:40] + [999] * 30, 69)[0] == PREFILL_CHUNK_TOKENS  # cut to a chunk boundary
    cache.store(b, kv)  # evicts a
    assert len(cache) == 1 and cache.lookup(a, 63) is None and cache.nbytes <= cache.max_bytes
