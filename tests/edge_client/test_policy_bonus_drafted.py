"""The speculation policy with bonus_drafted blocks (``DraftBlock.bonus_drafted``): the proactive bet drafts no
bonus guess and prepares a bonus_drafted block; adaptive γ counts the extra draft step (no models)."""

from __future__ import annotations

from specdec_runtime.common.types import DraftBlock
from specdec_runtime.edge_client.drafting.ngram import NgramDrafter
from specdec_runtime.common.types import SamplingParams
from specdec_runtime.edge_client.generation.policy import AdaptiveNumSpeculativeTokens, ProactiveBet


def test_proactive_bet_on_a_bonus_drafted_block():
    calls = []

    def propose(ids, n, should_stop):
        calls.append((list(ids), n))
        return DraftBlock([50, 51, 52, 53, 54][:n], draft_ms=2.0)

    bet = ProactiveBet(propose)
    sent = DraftBlock([3, 4, 5], bonus_drafted=True)  # γ = 2 + the bonus_drafted token
    bet.place([1, 2], sent, max_num_speculative_tokens=2, capacity=100, should_stop=lambda: False)
    assert calls == [([1, 2, 3, 4, 5], 3)]  # no bonus guess: the next block (γ = 2 + its bonus_drafted)
    # won: the block in flight accepted whole (no bonus token); the prepared block is a bonus_drafted block
    block = bet.take([1, 2, 3, 4, 5], 3)
    assert block.draft_token_ids == [50, 51, 52] and block.bonus_drafted
    # the classic bet on the same committed ids would have wanted a guessed bonus token after them
    bet.place([1, 2], sent, max_num_speculative_tokens=2, capacity=100, should_stop=lambda: False)
    assert bet.take([1, 2, 3, 4, 5, 50], 3) is None
    # cut to a shorter block: still a bonus_drafted block
    bet.place([1, 2], sent, max_num_speculative_tokens=2, capacity=100, should_stop=lambda: False)
    short = bet.take([1, 2, 3, 4, 5], 2)
    assert short.draft_token_ids == [50, 51] and short.bonus_drafted


def test_proactive_bet_bonus_drafted_capacity():
    calls = []

    def propose(ids, n, should_stop):
        calls.append(n)
        return DraftBlock([9] * n)

    bet = ProactiveBet(propose)
    sent = DraftBlock([3, 4], bonus_drafted=True)
    # capacity 6 after 2 + 2 tokens: a verdict leaves room for γ = 1, so 2 tokens are drafted ahead
    bet.place([1, 2], sent, max_num_speculative_tokens=4, capacity=6, should_stop=lambda: False)
    # capacity 5: room for γ = 0, the bonus_drafted token alone; capacity 4: the bet would end the session
    bet.place([1, 2], sent, max_num_speculative_tokens=4, capacity=5, should_stop=lambda: False)
    bet.place([1, 2], sent, max_num_speculative_tokens=4, capacity=4, should_stop=lambda: False)
    assert calls == [2, 1]


def test_adaptive_counts_the_bonus_drafted_step():
    plain = AdaptiveNumSpeculativeTokens(4)
    drafted = AdaptiveNumSpeculativeTokens(4, bonus_drafted=True)
    for a in (plain, drafted):
        a.observe(3, 3, draft_ms=12.0, round_trip_ms=20.0, forward_ms=10.0)  # γ = 3 (4 tokens drafted if drafted)
    assert plain.draft_ms_per_token == 4.0 and drafted.draft_ms_per_token == 3.0
    assert drafted.expected_ms(2) == 3 * 3.0 + drafted.verify_base_ms + 2 * drafted.verify_ms_per_token + drafted.rtt_ms
    assert plain.expected_tokens(2) == drafted.expected_tokens(2)  # the last position still yields one token


def test_ngram_sampled_proposals_depend_on_the_prefix_only():
    """Sampled sessions: the token proposed for a position is the lookup after the prefix before it, so a block
    started later proposes the same tokens for the positions it shares (greedy copies one match)."""
    d = NgramDrafter(max_ngram=1)  # unigram lookup: the latest earlier occurrence of the last token
    ctx = [1, 2, 3, 2, 4, 1]
    sampled = SamplingParams(temperature=1.0, seed=0)
    first = d.propose(ctx, 4, sampled).draft_token_ids
    assert first[:1] == d.lookup(ctx, 1)
    for k in range(1, len(first)):
        later = d.propose(ctx + first[:k], 4 - k, sampled).draft_token_ids
        assert later == first[k:], (k, first, later)
    greedy = d.propose(ctx, 4, SamplingParams()).draft_token_ids
    assert greedy == d.lookup(ctx, 4) == [2, 3, 2, 4]  # the continuation of the match at 0
    assert first != greedy  # the two rules differ on this context (the test can tell them apart)


def test_proactive_hit_cut_by_the_verdict_is_completed():
    """Drafting ahead stopped by the verdict's arrival: a hit drafts the missing tokens at take (the block the
    client would have drafted), with top-k rows of different k padded to one; a block the drafter itself ended
    early (the verdict not in yet) is sent as it is."""
    import numpy as np

    from specdec_runtime.common.types import SparseDraftProbs

    def propose(ids, n, should_stop):
        out = []
        for i in range(n):
            if i > 0 and should_stop():
                break
            out.append(100 + len(ids) + i)  # a function of the position: blocks can be checked token by token
        k = 3 if len(ids) > 4 else 2  # the completion (after 6 ids) has wider rows
        rows = np.array([[t] + [1 + j for j in range(k - 1)] for t in out], dtype=np.int64).reshape(len(out), k)
        return DraftBlock(out, SparseDraftProbs(rows, np.full((len(out), k), 1 / k, np.float32)), draft_ms=1.0)

    arrived = iter([False, True, True])  # the verdict arrives after the first token drafted ahead
    bet = ProactiveBet(propose)
    bet.place([1, 2], DraftBlock([3, 4], bonus_drafted=True), 3, 100, lambda: next(arrived, True))
    block = bet.take([1, 2, 3, 4], 4)
    assert block.draft_token_ids == [104, 105, 106, 107] and block.bonus_drafted
    assert block.draft_probs.token_ids.shape == (4, 3) and bet.last_extend_s > 0
    assert block.draft_probs.probs[:2, 2].tolist() == [0.0, 0.0]  # padding of the narrower rows
    bet.place([1, 2], DraftBlock([3, 4], bonus_drafted=True), 3, 100, lambda: False)
    assert bet.take([1, 2, 3, 4], 4).draft_token_ids == [104, 105, 106, 107]  # not cut: as drafted
