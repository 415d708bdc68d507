"""Drafters and speculation policies on the edge: n-gram drafter, adaptive γ, confidence truncation, proactive
drafting, simulated network delay. Every setting must keep greedy output token-identical to target-only."""

from __future__ import annotations

import time

import pytest

from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.types import DraftBlock, OpenRequest, SamplingParams, StoppingCriteria
from specdec_runtime.edge_client.generation.policy import AdaptiveNumSpeculativeTokens
from specdec.embedded import LocalBackend
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.transport.netsim import DelayedBackend
from specdec_runtime.edge_client.drafting.ngram import NgramDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from _reference import hf_greedy


@pytest.fixture(scope="module")
def backend(tiny_pair):
    b = LocalBackend(Verifier(TargetRunner(tiny_pair.target_dir), max_num_speculative_tokens=8))
    yield b
    b.close()


@pytest.fixture(scope="module")
def prompt_ids(tiny_pair):
    tok = OnnxDraftModel(tiny_pair.draft_dir).tokenizer
    # repetitive text gives the n-gram drafter something to find
    return encode_prompt(tok, "one two three four, one two three four, one two three four, one two")


@pytest.fixture(scope="module")
def reference(tiny_pair, prompt_ids):
    return hf_greedy(tiny_pair.target_dir, prompt_ids, 24)


def test_ngram_lookup():
    d = NgramDrafter(max_ngram=3)
    assert d.lookup([1, 2, 3, 4, 5, 9, 1, 2, 3], 3) == [4, 5, 9]
    assert d.lookup([7, 8, 9], 2) == []  # no earlier occurrence
    assert d.lookup([5, 6, 5, 6, 5], 4) == [6, 5]  # latest match, continuation clipped at the end
    with pytest.raises(ValueError):
        NgramDrafter(min_ngram=0)


def _model_client(backend, tiny_pair, **kw):
    model = OnnxDraftModel(tiny_pair.other_draft_dir)
    return EdgeClient(backend, ModelDrafter(model, draft_top_k=4), model.tokenizer, **kw)


@pytest.mark.parametrize(
    "settings",
    [
        dict(drafter="ngram"),
        dict(adaptive=True, num_speculative_tokens=6),
        dict(min_confidence=0.5),
        dict(proactive=True),
        dict(proactive=True, adaptive=True, min_confidence=0.3, delay_ms=5),
    ],
    ids=["ngram", "adaptive", "confidence", "proactive", "all+delay"],
)
def test_greedy_identical_with_every_setting(backend, tiny_pair, prompt_ids, reference, settings):
    settings = dict(settings)
    delay = settings.pop("delay_ms", 0)
    b = DelayedBackend(backend, delay) if delay else backend
    if settings.pop("drafter", None) == "ngram":
        tok = OnnxDraftModel(tiny_pair.draft_dir).tokenizer
        client = EdgeClient(b, NgramDrafter(), tok, num_speculative_tokens=4)
    else:
        client = _model_client(b, tiny_pair, **settings)
    res = client.generate(prompt_ids, max_new_tokens=24, ignore_eos=True)
    assert res.token_ids == reference


def test_ngram_drafter_gets_accepted_on_repetitive_text(backend, tiny_pair):
    """Target-only output that repeats itself: prompt lookup must find and get tokens accepted."""
    tok = OnnxDraftModel(tiny_pair.draft_dir).tokenizer
    ids = encode_prompt(tok, "a b c")
    ref = hf_greedy(tiny_pair.target_dir, ids, 48)
    client = EdgeClient(backend, NgramDrafter(), tok, num_speculative_tokens=4)
    res = client.generate(ids, max_new_tokens=48, ignore_eos=True)
    assert res.token_ids == ref
    if len(set(ref[24:])) < 12:  # the tiny random model falls into a loop: lookup must exploit it
        assert res.stats.num_accepted_tokens > 0


def test_confidence_truncation_shortens_blocks(backend, tiny_pair, prompt_ids, reference):
    plain = _model_client(backend, tiny_pair, num_speculative_tokens=6).generate(prompt_ids, max_new_tokens=24, ignore_eos=True)
    trunc = _model_client(backend, tiny_pair, num_speculative_tokens=6, min_confidence=0.99).generate(
        prompt_ids, max_new_tokens=24, ignore_eos=True)
    assert trunc.token_ids == plain.token_ids == reference
    assert trunc.stats.num_draft_tokens / trunc.stats.num_drafts < plain.stats.num_draft_tokens / plain.stats.num_drafts


def test_proactive_drafting_same_sampled_tokens_and_hits(backend, tiny_pair, prompt_ids):
    """A seeded sampled session gives the same tokens whatever the client's timing-dependent settings (they are
    turned off for it); with the target's own weights as the draft, greedy bets on full acceptance win and
    prepared blocks get used."""
    kw = dict(max_new_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
    off = _model_client(backend, tiny_pair, num_speculative_tokens=3).generate(prompt_ids, **kw)
    on = _model_client(backend, tiny_pair, num_speculative_tokens=3, proactive=True).generate(prompt_ids, **kw)
    assert on.token_ids == off.token_ids
    model = OnnxDraftModel(tiny_pair.draft_dir)  # same weights as the target: near-full acceptance
    good = EdgeClient(DelayedBackend(backend, 5), ModelDrafter(model), model.tokenizer, num_speculative_tokens=3,
                      proactive=True)
    res = good.generate(prompt_ids, max_new_tokens=24, ignore_eos=True)
    assert res.stats.num_proactive_hits > 0


def test_delayed_backend_adds_round_trip(backend):
    delayed = DelayedBackend(backend, 30, 20)
    opened = delayed.open_session(OpenRequest([5, 6, 7], SamplingParams(), StoppingCriteria(max_new_tokens=4)))
    t = time.perf_counter()
    verdict = delayed.submit(opened.session_id, 1, 3, DraftBlock([9])).result(timeout=30)
    assert (time.perf_counter() - t) * 1000 >= 50
    assert verdict.committed_length >= 4
    delayed.close_session(opened.session_id)
    with pytest.raises(ValueError):
        DelayedBackend(backend, -1)


def test_adaptive_num_speculative_tokens_ignores_the_draft_prefill(backend, tiny_pair, prompt_ids, monkeypatch):
    """The first block's draft time includes the draft's prefill of the prompt: it must not count as a per-token
    draft cost (it made the controller choose γ = 1 on long prompts)."""
    import specdec_runtime.edge_client.generation.speculative as speculative_mod

    seen: list = []

    class Recording(AdaptiveNumSpeculativeTokens):
        def observe(self, num_speculative_tokens, num_accepted, draft_ms, round_trip_ms, forward_ms,
                    num_verified=None):
            seen.append(draft_ms)
            super().observe(num_speculative_tokens, num_accepted, draft_ms, round_trip_ms, forward_ms, num_verified)

    monkeypatch.setattr(speculative_mod, "AdaptiveNumSpeculativeTokens", Recording)
    res = _model_client(backend, tiny_pair, adaptive=True, proactive=False, num_speculative_tokens=4).generate(
        prompt_ids, max_new_tokens=16, ignore_eos=True)
    assert len(seen) == res.stats.num_drafts >= 2
    assert seen[0] is None and all(ms is not None for ms in seen[1:])


def test_adaptive_num_speculative_tokens_policy():
    # cheap draft, expensive round trip, high acceptance: long blocks pay
    c = AdaptiveNumSpeculativeTokens(max_num_speculative_tokens=8, warmup_steps=1)
    for _ in range(50):
        c.observe(8, 8, draft_ms=8 * 0.5, round_trip_ms=60, forward_ms=10)
    assert c.next_num_speculative_tokens() == 8
    # expensive draft, no network, low acceptance: short blocks
    c = AdaptiveNumSpeculativeTokens(max_num_speculative_tokens=8, warmup_steps=1)
    for n in (8, 4, 2, 1) * 10:
        c.observe(n, 0, draft_ms=n * 20, round_trip_ms=5, forward_ms=5)
    assert c.next_num_speculative_tokens() == 1
    assert abs(AdaptiveNumSpeculativeTokens(max_num_speculative_tokens=4).expected_tokens(4)
               - (1 - 0.8**5) / (1 - 0.8)) < 1e-9
