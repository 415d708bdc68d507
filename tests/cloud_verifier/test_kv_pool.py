"""The paged KV pool: the page allocator with reference counts and its release hook (the contract the prefix
cache builds on), the CPU pool's pages given back to the OS, and a session's KV as a page table on a real
(tiny) target runner: grow without copying, roll back by dropping whole pages, free, the budget counted in
pages actually held."""

from __future__ import annotations

import pytest
import torch

from specdec_runtime.cloud_verifier.kv.pool import KVPool, PagePool
from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.common.errors import CapacityError


def test_allocate_and_free_count_pages():
    pool = PagePool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a + b)) == 8 and pool.num_free == 0 and pool.num_used == 8
    with pytest.raises(CapacityError, match="1 pages requested, 0 of 8 free"):
        pool.allocate(1)
    pool.free(a)
    assert pool.num_free == 3 and pool.num_used == 5
    with pytest.raises(CapacityError):
        pool.allocate(4)  # all or nothing
    assert pool.num_free == 3
    assert sorted(pool.allocate(3)) == sorted(a)


def test_reference_counts_free_a_page_at_zero_only():
    pool = PagePool(4)
    (b,) = pool.allocate(1)
    pool.incref([b])
    assert pool.refcount(b) == 2
    pool.decref([b])
    assert pool.num_used == 1 and pool.num_free == 3  # one session still holds it
    pool.decref([b])
    assert pool.refcount(b) == 0 and pool.num_free == 4
    with pytest.raises(ValueError, match="no reference"):
        pool.decref([b])
    with pytest.raises(ValueError, match="is free"):
        pool.incref([b])


def test_on_release_hook_keeps_a_page_cached_until_released():
    pool = PagePool(4)
    kept: list[int] = []
    pool.on_release = lambda page: (kept.append(page) or page % 2 == 0)  # keep even ids only
    ids = pool.allocate(2)  # 0 and 1
    pool.decref(ids)
    assert kept == ids
    assert pool.num_cached == 1 and pool.num_free == 3 and pool.num_used == 0
    pool.incref([0])  # taken again from the cache: used, its contents kept
    assert pool.num_cached == 0 and pool.num_used == 1 and pool.refcount(0) == 1
    pool.decref([0])
    assert pool.num_cached == 1
    pool.release_cached([0])  # evicted
    assert pool.num_cached == 0 and pool.num_free == 4
    with pytest.raises(ValueError, match="not a cached page"):
        pool.release_cached([0])


def test_cpu_pool_gives_the_memory_of_free_pages_back():
    pool = KVPool(num_layers=2, num_pages=4, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                  device=torch.device("cpu"))
    assert pool.tensor.shape == (2, 2, 4, 16, 2, 64) and not pool.tensor.any()
    a, b = pool.pages.allocate(2)
    pool.tensor[:, :, [a, b]] = 1.0
    pool.pages.free([a])
    assert pool.release_free() > 0
    assert not pool.tensor[:, :, a].any()  # MADV_DONTNEED: its pages are fresh zero pages again
    assert bool((pool.tensor[:, :, b] == 1.0).all())  # the page still held keeps its contents


@pytest.fixture(scope="module")
def runner(tmp_path_factory, smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    from _architectures import make_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    target_dir = make_tiny_model("llama", tmp_path_factory.mktemp("kv-pool") / "llama", tokenizer)
    return TargetRunner(target_dir, kv_cache_budget_tokens=64, kv_page_size=4)


def test_page_table_grows_rolls_back_and_frees(runner):
    pool = runner.kv_pool.pages
    assert pool.num_pages == 16 and runner.kv_reserved_tokens == 0
    kv = runner.allocate(40, reserve_tokens=6)  # a limit of 40 tokens, pages for 6
    assert kv.capacity == 40 and len(kv.pages) == 2 and runner.kv_reserved_tokens == 8
    first = list(kv.pages)
    runner.forward([ForwardRow(kv, list(range(3, 9)), 0, "none")])
    runner.forward([ForwardRow(kv, [9, 10, 11, 12, 13], 6, "all")])  # grows to 11 positions in the forward
    assert len(kv.pages) == 3 and kv.pages[:2] == first  # grown by a page: nothing moved
    runner.truncate(kv, 7)  # a rejected tail: positions 7.. dropped, whole pages only
    assert len(kv.pages) == 2 and pool.num_used == 2
    runner.ensure(kv, 40)
    assert len(kv.pages) == 10 and runner.kv_reserved_tokens == 40
    with pytest.raises(CapacityError):
        runner.allocate(32)  # 6 pages free, 8 asked: nothing taken
    with pytest.raises(CapacityError, match="cannot fit in the 64 tokens of the whole cache"):
        runner.allocate(65, reserve_tokens=1)  # a session that could never finish is refused at once
    assert pool.num_used == 10
    runner.free(kv)
    runner.free(kv)  # idempotent
    assert pool.num_used == 0 and kv.capacity == 0
    with pytest.raises(ValueError, match="past its KV capacity"):
        runner.forward([ForwardRow(kv, [1], 0, "all")])


def test_rolled_back_pages_reused_by_another_session_leave_logits_exact(runner):
    """A page dropped by a roll-back and taken by another session is overwritten there: both sessions'
    logits still equal the reference (no position of one session is read from the other's pages)."""
    import numpy as np

    a_ids, b_ids = list(range(5, 25)), list(range(40, 58))
    ref_a, ref_b = runner.reference_logits(a_ids), runner.reference_logits(b_ids)
    a, b = runner.allocate(32, reserve_tokens=0), runner.allocate(32, reserve_tokens=0)
    try:
        got_a = [runner.forward([ForwardRow(a, a_ids[:10], 0)])[0]]
        runner.forward([ForwardRow(a, [1, 2, 3, 4, 5, 6], 10, "none")])  # rejected: positions 10..15
        runner.truncate(a, 10)
        got_b = [runner.forward([ForwardRow(b, b_ids[:12], 0)])[0]]  # takes the dropped page
        out = runner.forward([ForwardRow(a, a_ids[10:], 10), ForwardRow(b, b_ids[12:], 12)])
        got_a.append(out[0])
        got_b.append(out[1])
    finally:
        runner.free(a)
        runner.free(b)
    for got, ref in ((got_a, ref_a), (got_b, ref_b)):
        got = np.concatenate(got)
        assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


def test_page_size_setting_reads_its_former_name_with_a_warning(monkeypatch, caplog):
    from specdec_runtime.cloud_verifier.config import VerifierSettings

    monkeypatch.delenv("SPECDEC_KV_PAGE_SIZE", raising=False)
    monkeypatch.setenv("SPECDEC_KV_BLOCK_SIZE", "32")  # the name before "block" meant only a draft block
    with caplog.at_level("WARNING", logger="specdec_runtime.cloud_verifier.config"):
        assert VerifierSettings().kv_page_size == 32
    assert "SPECDEC_KV_BLOCK_SIZE is deprecated" in caplog.text
    monkeypatch.setenv("SPECDEC_KV_PAGE_SIZE", "8")  # the current name wins
    assert VerifierSettings().kv_page_size == 8
    monkeypatch.delenv("SPECDEC_KV_BLOCK_SIZE")
    caplog.clear()
    assert VerifierSettings().kv_page_size == 8 and VerifierSettings(kv_page_size=4).kv_page_size == 4
    assert "deprecated" not in caplog.text
