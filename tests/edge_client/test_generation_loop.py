"""edge_client.generation.loop: one generation over the in-process verifier with a plain GenerationContext is
token for token target-only decoding; a conversation's kept session is extended (ExtendRequest) and the second
turn's output is the reference's continuation; the failover count and wire bytes follow the backend's
capabilities."""

from __future__ import annotations

from conftest import PROMPT_IDS, PlainContext
from specdec_runtime.common.types import SamplingParams, StoppingCriteria
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.generation.loop import KeptSession, generate


def test_one_generation_is_target_only(room_local, room_draft, room_reference):
    ctx = PlainContext(room_local, ModelDrafter(room_draft, draft_top_k=4), room_draft.tokenizer)
    chunks = list(generate(ctx, PROMPT_IDS, SamplingParams(), StoppingCriteria(24, ignore_eos=True)))
    result = ctx.last_result
    assert result.token_ids == room_reference and all(c.verified for c in chunks)
    assert result.num_sessions == 1 and result.num_failovers == 0 and result.bytes_sent == 0  # no wire in process


def test_a_kept_session_is_extended(room_local, room_draft, tiny_pair):
    from _reference import hf_greedy

    ctx = PlainContext(room_local, ModelDrafter(room_draft, draft_top_k=4), room_draft.tokenizer)
    keep = KeptSession()
    list(generate(ctx, PROMPT_IDS, SamplingParams(), StoppingCriteria(8, ignore_eos=True), keep=keep))
    first = ctx.last_result.token_ids
    assert keep.opened is not None and keep.committed_length == len(PROMPT_IDS) + 8
    session = keep.opened.session_id
    turn2 = PROMPT_IDS + first + [11, 12, 13]
    list(generate(ctx, turn2, SamplingParams(), StoppingCriteria(8, ignore_eos=True), keep=keep))
    assert ctx.last_result.session_id == session and ctx.last_result.num_reopened_sessions == 0
    assert ctx.last_result.token_ids == hf_greedy(tiny_pair.target_dir, turn2, 8)
    room_local.close_session(session)
