"""edge_client.generation.speculative: draft_block asks the client's drafter with the client's settings (empty
without a drafter), and unjudged_tail keeps the draft tokens a partially verified block left unjudged."""

from __future__ import annotations

from conftest import PROMPT_IDS, PlainContext
from specdec_runtime.common.types import NO_TOKEN, DraftBlock, SamplingParams, Verdict
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.generation.speculative import draft_block, unjudged_tail


def test_draft_block_is_the_drafters_block(room_local, room_draft, room_reference):
    ctx = PlainContext(room_local, ModelDrafter(room_draft, draft_top_k=4), room_draft.tokenizer)
    block = draft_block(ctx, list(PROMPT_IDS), 4, SamplingParams())
    assert block.draft_token_ids == room_reference[:4]  # the draft has the target's weights: its greedy tokens
    assert draft_block(ctx, list(PROMPT_IDS), 0, SamplingParams()).draft_token_ids == []
    ctx.drafter = None
    assert draft_block(ctx, list(PROMPT_IDS), 4, SamplingParams()).draft_token_ids == []


def test_unjudged_tail():
    block = DraftBlock([5, 6, 7, 8], draft_ms=3.0)
    judged_two = Verdict(2, NO_TOKEN, False, [5, 6], 12, num_verified_positions=2)
    tail = unjudged_tail(block, [5, 6], judged_two)
    assert tail.draft_token_ids == [7, 8] and tail.draft_ms == 0.0
    assert unjudged_tail(block, [5, 9], Verdict(1, 9, False, [5, 9], 12, num_verified_positions=2)) is None
    assert unjudged_tail(block, [5, 6, 7, 8, 1], Verdict(4, 1, True, [5, 6, 7, 8, 1], 14)) is None  # all judged
