"""The declared contracts (edge_client.drafting.contract, edge_client.transport.backend): a drafter with only the
required ``propose`` serves the speculative route token for token as target-only decoding; a request that needs
a capability the drafter lacks gets one UnsupportedByDrafterError before any call reaches the verifier; where the
request still works without it (cloud-first without a prefill), it is logged once, not per generation."""

from __future__ import annotations

import logging

import pytest

from conftest import PROMPT_IDS, PlainContext
from specdec_runtime.common.errors import UnsupportedByDrafterError
from specdec_runtime.common.types import DraftBlock, SamplingParams, StoppingCriteria
from specdec_runtime.edge_client.drafting import contract
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.ngram import NgramDrafter
from specdec_runtime.edge_client.generation.loop import generate
from specdec_runtime.edge_client.transport.backend import VerifierBackend

CAPABILITIES = ("Resettable", "TurnAware", "HistoryProcessing", "ConstrainsGrammar", "DecodesAlone",
                "PrefillsConcurrently", "TracksContext")


class RepeatLast:
    """The required protocol only: proposes the last committed token γ times (greedy drafting: q one-hot)."""

    def propose(self, committed_token_ids, num_speculative_tokens, sampling, min_confidence=0.0,
                should_stop=None):
        return DraftBlock([int(committed_token_ids[-1])] * num_speculative_tokens)


class Recording(VerifierBackend):
    """A real backend (the in-process verifier) that records the calls it passes on."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def open_session(self, request, timeout_s=None):
        self.calls.append("open_session")
        return self.inner.open_session(request, timeout_s=timeout_s)

    def submit(self, session_id, seq, committed_length, block):
        self.calls.append("submit")
        return self.inner.submit(session_id, seq, committed_length, block)

    def close_session(self, session_id):
        self.calls.append("close_session")
        self.inner.close_session(session_id)


def _generate(ctx, sampling=SamplingParams(), route=None, n=24):
    list(generate(ctx, PROMPT_IDS, sampling, StoppingCriteria(max_new_tokens=n, ignore_eos=True), route=route))
    return ctx.last_result


def test_a_propose_only_drafter_serves_the_speculative_route(room_local, room_draft, room_reference):
    assert [c for c in CAPABILITIES if isinstance(RepeatLast(), getattr(contract, c))] == []
    backend = Recording(room_local)
    ctx = PlainContext(backend, RepeatLast(), room_draft.tokenizer)
    result = _generate(ctx)
    assert result.token_ids == room_reference
    assert result.stats.num_drafts > 0 and result.stats.num_draft_tokens > 0  # its blocks were sent
    unseeded = _generate(ctx, SamplingParams(temperature=0.8, top_k=20), n=8)  # sampled without a seed: no reset
    assert len(unseeded.token_ids) == 8


@pytest.mark.parametrize("route, fallback, sampling, capability", [
    ("device", "none", SamplingParams(), "DecodesAlone"),
    ("speculative", "device", SamplingParams(), "DecodesAlone"),
    ("cloud", "device", SamplingParams(), "DecodesAlone"),
    ("speculative", "none", SamplingParams(temperature=0.8, seed=3), "Resettable"),
    ("auto", "none", SamplingParams(temperature=0.8, seed=3), "Resettable"),
])
def test_a_missing_capability_is_one_error_before_anything_is_sent(room_local, room_draft, route, fallback,
                                                                   sampling, capability):
    backend = Recording(room_local)
    ctx = PlainContext(backend, RepeatLast(), room_draft.tokenizer, fallback=fallback)
    with pytest.raises(UnsupportedByDrafterError) as e:
        _generate(ctx, sampling, route=route)
    assert e.value.capability == capability and capability in str(e.value)
    assert backend.calls == []


def test_decoding_alone_needs_the_request_processors(room_local, room_draft, room_reference):
    """A drafter that decodes alone but applies no penalties is refused a penalised device request (its tokens
    would ignore them, unverified); without penalties it decodes, the draft's greedy output (= the target's)."""
    inner = ModelDrafter(room_draft, draft_top_k=4)

    class AloneOnly:
        model, valid_vocab_size = inner.model, inner.valid_vocab_size

        def propose(self, *args, **kwargs):
            return inner.propose(*args, **kwargs)

        def next_token_logits(self, committed_token_ids):
            return inner.next_token_logits(committed_token_ids)

    drafter = AloneOnly()
    assert isinstance(drafter, contract.DecodesAlone) and not isinstance(drafter, contract.HistoryProcessing)
    backend = Recording(room_local)
    ctx = PlainContext(backend, drafter, room_draft.tokenizer)
    with pytest.raises(UnsupportedByDrafterError) as e:
        _generate(ctx, SamplingParams(repetition_penalty=1.3), route="device")
    assert e.value.capability == "HistoryProcessing"
    assert _generate(ctx, route="device").token_ids == room_reference
    assert backend.calls == []  # the device route calls no verifier


def test_the_shipped_drafters_declare_what_they_have():
    assert [c for c in CAPABILITIES if isinstance(NgramDrafter(), getattr(contract, c))] == ["Resettable"]
    assert all(issubclass(ModelDrafter, getattr(contract, c)) for c in CAPABILITIES if c not in (
        "DecodesAlone",))  # data members: isinstance only (checked on an instance in test_fallback)


def test_cloud_first_without_a_prefill_is_logged_once(room_local, room_draft, room_reference, caplog):
    ctx = PlainContext(room_local, NgramDrafter(), room_draft.tokenizer)
    contract._logged.discard(("NgramDrafter", "PrefillsConcurrently"))
    with caplog.at_level(logging.WARNING, logger=contract.__name__):
        first = _generate(ctx, route="cloud-first")
        second = _generate(ctx, route="cloud-first")
    assert first.token_ids == second.token_ids == room_reference
    assert len([r for r in caplog.records if "PrefillsConcurrently" in r.getMessage()
                or "no prefill to overlap" in r.getMessage()]) == 1


def test_a_draft_model_handed_over_bare_is_refused_at_construction(room_local, room_draft):
    from specdec_runtime.edge_client.client import EdgeClient

    with pytest.raises(TypeError, match="wrap a draft model in .*ModelDrafter"):
        EdgeClient(room_local, room_draft, room_draft.tokenizer)
    assert EdgeClient(room_local, RepeatLast(), room_draft.tokenizer).drafter is not None  # propose alone suffices
