"""Prefix caching across sessions on a real (tiny) target and verifier: sessions sharing a long system prompt
prefill it once, hold it once, decode token-identically to target-only HF greedy decoding (with draft blocks
that get rejected); speculative steps never write a shared page; cached pages are evicted LRU under pressure
and never while in use; the tenant salt isolates tenants; caching off shares nothing.

Tiny random Llama from conftest (2 layers, 512-token context); prompts of random token ids; prefill counted as
tokens actually run through the target (``specdec_batch_tokens_sum``)."""

from __future__ import annotations

import random

import pytest
import torch
from prometheus_client import REGISTRY
from transformers import AutoModelForCausalLM

from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.errors import CapacityError
from specdec_runtime.common.types import DraftBlock, ExtendRequest, SamplingParams, StoppingCriteria
from specdec.embedded import LocalBackend

pytestmark = pytest.mark.timeout(300)

BS = 16  # KV page size, tokens
PREFIX = 500  # shared system prompt, tokens
NEW = 8  # tokens generated per session
WAIT_S = 60.0
GREEDY = SamplingParams(), StoppingCriteria(max_new_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def runner(tiny_pair):
    return TargetRunner(tiny_pair.target_dir, kv_page_size=BS, kv_cache_budget_tokens=40 * 512)


@pytest.fixture(scope="module")
def hf_model(tiny_pair):
    return AutoModelForCausalLM.from_pretrained(tiny_pair.target_dir, dtype=torch.float32).eval()


def _reference(hf_model, prompt: list[int], new: int = NEW) -> list[int]:
    """Target-only greedy decoding with plain HF generate()."""
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(n)]


def _batch_tokens() -> float:
    return REGISTRY.get_sample_value("specdec_batch_tokens_sum") or 0.0


def _backend(runner, **kwargs) -> LocalBackend:
    backend = LocalBackend(Verifier(runner, max_batch_wait_ms=0.0, prefill_chunk_tokens=128, **kwargs))
    runner.prefix_cache.evict_all()  # each test starts with nothing cached
    return backend


def _open(backend, prompt, tenant_id: str = "", new: int = NEW):
    """(opened, prompt tokens prefilled)."""
    before = _batch_tokens()
    stopping = StoppingCriteria(max_new_tokens=new, ignore_eos=True)
    opened = backend._call(backend.verifier.open_session(prompt, GREEDY[0], stopping, tenant_id=tenant_id), WAIT_S)
    return opened, int(_batch_tokens() - before)


def _decode_with_rejections(backend, opened, reference: list[int], rng: random.Random, gamma: int = 4,
                            tenant_id: str = "", new: int = NEW) -> list[int]:
    """Verify blocks of the reference continuation with one token in most blocks made wrong (rejections, roll
    backs); returns the committed output."""
    record = backend.verifier.sessions.held(opened.session_id).record
    out, seq, length = [], record.last_seq + 1, opened.committed_length  # seq goes on after an ExtendSession
    capacity = opened.committed_length + new
    while True:
        draft = list(reference[len(out) : len(out) + min(gamma, capacity - length)])
        if draft and rng.random() < 0.75:
            j = rng.randrange(len(draft))
            draft[j] = 3 + (draft[j] + 1) % 49000
        v = backend._call(backend.verifier.verify(opened.session_id, seq, length, DraftBlock(draft),
                                                  tenant_id=tenant_id), WAIT_S)
        out += v.committed_token_ids
        length, seq = v.committed_length, seq + 1
        if v.finished:
            return out


def test_sixteen_sessions_share_a_500_token_system_prompt(runner, hf_model):
    rng = random.Random(0)
    system = _ids(rng, PREFIX)
    prompts = [system + _ids(rng, 4) for _ in range(16)]  # 504 tokens: 31 full pages of the prompt but its last
    reference = [_reference(hf_model, p) for p in prompts]
    results = {}
    for caching in (True, False):
        backend = _backend(runner, prefix_caching=caching)
        try:
            opened, prefilled = zip(*(_open(backend, p) for p in prompts))
            pages_in_use = runner.kv_pool.pages.num_used  # all 16 open, no page verified yet
            outputs = [_decode_with_rejections(backend, o, ref, rng) for o, ref in zip(opened, reference)]
            for o in opened:
                backend.close_session(o.session_id)
        finally:
            backend.close()
        results[caching] = prefilled, pages_in_use, outputs
    (shared_prefill, shared_pages, shared_out), (solo_prefill, solo_pages, solo_out) = results[True], results[False]
    assert list(solo_prefill) == [503] * 16  # everything but the last prompt token, every time
    assert list(shared_prefill) == [503] + [503 - 31 * BS] * 15  # the 2nd..16th prefill their last 7 tokens only
    assert solo_pages == 16 * 32 and shared_pages == 32 + 15 * 1  # 31 shared pages + one own page each
    assert shared_pages <= 0.3 * solo_pages
    assert shared_out == reference and solo_out == reference  # token-identical to target-only decoding


def test_speculative_steps_never_write_a_shared_page(runner, hf_model):
    rng = random.Random(1)
    prompt = _ids(rng, 31 * BS)  # a whole number of pages: the last page holds the last prompt token
    reference = _reference(hf_model, prompt)
    backend = _backend(runner)
    try:
        first, _ = _open(backend, prompt)
        second, prefilled = _open(backend, prompt)
        assert prefilled == BS - 1  # the last page (with the last prompt token) is the session's own
        table = backend.verifier.sessions.held
        a, b = table(first.session_id).kv.pages, table(second.session_id).kv.pages
        shared = [x for x in a if x in b]
        assert shared == a[:30] == b[:30] and a[30] != b[30]
        before = runner.kv_pool.tensor[:, :, shared].clone()
        written: set[int] = set()  # pages any forward pass wrote, from each row's page table and positions
        forward = runner.forward

        def observed_forward(rows, *args, **kwargs):
            for row in rows:
                pages = row.kv.pages
                end = min(row.start_position + len(row.token_ids), len(pages) * BS)
                written.update(pages[p // BS] for p in range(row.start_position, end))
            return forward(rows, *args, **kwargs)

        runner.forward = observed_forward  # observes the real forward pass (instance attribute, undone below)
        try:
            sessions = [first, second]
            for _ in range(3):  # many verify steps with rejections and roll backs, then new sessions on the prefix
                for o in sessions:
                    assert _decode_with_rejections(backend, o, reference, rng, gamma=3) == reference
                    backend.close_session(o.session_id)
                sessions = [_open(backend, prompt)[0] for _ in range(2)]
        finally:
            del runner.forward
        assert written and not written & set(shared)
        assert torch.equal(runner.kv_pool.tensor[:, :, shared], before)
        assert all(runner.kv_pool.pages.refcount(x) >= 2 for x in shared)
    finally:
        backend.close()


def test_cached_pages_are_evicted_lru_under_pressure_never_in_use(tiny_pair, hf_model):
    small = TargetRunner(tiny_pair.target_dir, kv_page_size=BS, kv_cache_budget_tokens=40 * BS)  # 40 pages
    pool = small.kv_pool.pages
    rng = random.Random(2)
    a_prompt, b_prompt = _ids(rng, 300), _ids(rng, 400)  # 19 and 25 pages; 18 and 24 of them cacheable
    backend = _backend(small)
    try:
        a, _ = _open(backend, a_prompt)
        backend.close_session(a.session_id)
        assert (pool.num_used, pool.num_cached, pool.num_free) == (0, 18, 22)
        b, prefilled = _open(backend, b_prompt)  # needs 25 pages, 22 free: 3 of A's evicted, its tail first
        assert prefilled == 399 and small.prefix_cache.stats.evicted == 3
        backend.close_session(b.session_id)
        again, prefilled = _open(backend, a_prompt)  # A's head is still cached: 15 pages
        assert prefilled == 299 - 15 * BS
        with pytest.raises(CapacityError):  # B's 24 cached pages less 3 evicted: 21 + 0 free < 25 needed
            _open(backend, _ids(rng, 400))
        assert pool.num_used == 19  # the refused session left nothing behind; A's pages in use untouched
        assert _decode_with_rejections(backend, again, _reference(hf_model, a_prompt), rng) == \
            _reference(hf_model, a_prompt)
    finally:
        backend.close()


def test_tenant_salt_isolates_tenants_and_no_salt_shares(runner):
    rng = random.Random(3)
    prompt = _ids(rng, 200)  # 12 cacheable pages
    for salt, other_tenant_prefill in (("tenant", 199), ("none", 199 - 12 * BS)):
        backend = _backend(runner, prefix_cache_salt=salt)
        try:
            assert _open(backend, prompt, "acme")[1] == 199
            assert _open(backend, prompt, "globex")[1] == other_tenant_prefill
            assert _open(backend, prompt, "acme")[1] == 199 - 12 * BS  # the same tenant always shares
        finally:
            backend.close()


def test_prefix_caching_off_shares_nothing(runner):
    prompt = _ids(random.Random(4), 100)
    backend = _backend(runner, prefix_caching=False)
    try:
        hits = REGISTRY.get_sample_value("specdec_prefix_cache_hits_total") or 0.0
        assert runner.prefix_cache.num_evictable == 0  # off: every evictable page was given back
        cached = runner.prefix_cache.num_cached  # pages of sessions still open from other tests
        opened = [_open(backend, prompt) for _ in range(3)]
        assert [prefilled for _, prefilled in opened] == [99] * 3
        assert (REGISTRY.get_sample_value("specdec_prefix_cache_hits_total") or 0.0) == hits
        assert runner.prefix_cache.num_cached == cached  # nothing registered
        for o, _ in opened:
            backend.close_session(o.session_id)
        assert runner.prefix_cache.num_evictable == 0
    finally:
        backend.close()


def test_an_extension_takes_the_pages_another_session_cached_for_the_same_history(runner, hf_model):
    rng = random.Random(5)
    prompt, appended = _ids(rng, 90), _ids(rng, 120)
    reply1 = _reference(hf_model, prompt)
    history = prompt + reply1 + appended  # 218 tokens
    reply2 = _reference(hf_model, history)
    backend = _backend(runner)
    try:
        whole, _ = _open(backend, history)  # another device already sent the whole conversation
        s, _ = _open(backend, prompt)
        assert _decode_with_rejections(backend, s, reply1, rng) == reply1
        before = _batch_tokens()
        ext = backend.extend_session(ExtendRequest(s.session_id, len(prompt) + NEW, appended, *GREEDY))
        # the old length is 98: its page 6 (positions 96..111) is prefilled from 97; pages 7..12 (112..207) are
        # taken (13 = (218 - 1) // 16 full pages cached by the other session); 208..216 prefilled
        assert _batch_tokens() - before == (112 - 97) + (217 - 13 * BS)
        out2 = _decode_with_rejections(backend, ext, reply2, rng)
        assert out2 == reply2  # token-identical to target-only decoding of the whole history
        assert out2 == _decode_with_rejections(backend, whole, reply2, rng)
    finally:
        backend.close()


def test_generated_pages_are_cached_at_each_commit_and_never_written_once_cached(runner, hf_model):
    """A's generated tokens fill pages; each verify commit registers the full ones (not only a later
    ExtendSession): B, opening with A's whole conversation as its prompt, prefills only the last partial page;
    both decode token-identically to target-only decoding, and no forward pass writes a page while it is cached."""
    rng = random.Random(7)
    gen = 56
    prompt = _ids(rng, 40)
    reply_a = _reference(hf_model, prompt, gen)
    conversation = prompt + reply_a  # 96 tokens: (96 - 1) // 16 = 5 full pages final in A's KV
    reply_b = _reference(hf_model, conversation)
    backend = _backend(runner)
    cache = runner.prefix_cache
    writes_into_cached: list[tuple[int, int]] = []  # (block, position) a forward pass wrote while it was cached
    forward = runner.forward

    def observed_forward(rows, *args, **kwargs):
        for row in rows:
            for p in range(row.start_position, row.start_position + len(row.token_ids)):
                page = row.kv.pages[p // BS] if p // BS < len(row.kv.pages) else None
                if page is not None and cache.is_cached(page):
                    writes_into_cached.append((page, p))
        return forward(rows, *args, **kwargs)

    runner.forward = observed_forward  # observes the real forward pass (instance attribute, undone below)
    try:
        a, prefilled_a = _open(backend, prompt, new=gen)
        assert prefilled_a == 39
        assert _decode_with_rejections(backend, a, reply_a, rng, new=gen) == reply_a
        a_pages = backend.verifier.sessions.held(a.session_id).kv.pages[:5]
        assert all(cache.is_cached(x) for x in a_pages)  # 2 from the prompt's prefill, 3 from verify commits
        b, prefilled_b = _open(backend, conversation)
        assert prefilled_b == 95 - 5 * BS  # only the tail past A's 5 full pages
        assert backend.verifier.sessions.held(b.session_id).kv.pages[:5] == a_pages
        assert _decode_with_rejections(backend, b, reply_b, rng) == reply_b  # token-identical to target-only
    finally:
        del runner.forward
        backend.close()
    assert not writes_into_cached
