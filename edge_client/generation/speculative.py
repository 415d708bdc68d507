"""The speculative segment of a session: draft a block, send it, commit the verdict, stream — until the
generation finishes, a call fails, or ``route="auto"`` switches to cloud decode (:mod:`edge_client.generation.routing`).

One step (Leviathan et al. 2023, Algorithm 1, split across the network; docs/architecture.md "The main loop"):
draft γ = num_speculative_tokens tokens from the committed prefix (:class:`edge_client.drafting.drafter.Drafter`), send
the block (:class:`edge_client.transport.backend.SentBlock`), commit the verdict's tokens (the accepted prefix + the
recovered or bonus token), stream the new text. The speculation policy (γ per step, drafting ahead while a block
is in flight) is :mod:`edge_client.generation.policy`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import TYPE_CHECKING, Callable, Iterator

from specdec_runtime.common.types import DraftBlock, SamplingParams, SessionOpened
from specdec_runtime.edge_client.drafting.contract import UsesFeatures
from specdec_runtime.edge_client.transport.backend import SentBlock
from specdec_runtime.edge_client.generation.context import GenerationContext
from specdec_runtime.edge_client.generation.observation import BlockObservation, BlockObserver
from specdec_runtime.edge_client.generation.plan import SessionPlan
from specdec_runtime.edge_client.generation.policy import AdaptiveNumSpeculativeTokens, ProactiveBet, concat_blocks, slice_block

if TYPE_CHECKING:
    from specdec_runtime.edge_client.generation.run import Run
    from specdec_runtime.edge_client.output import Chunk

__all__ = ["draft_block", "unjudged_tail", "verify_session"]


def draft_block(client: GenerationContext, committed: list[int], num_speculative_tokens: int,
                sampling: SamplingParams, should_stop: Callable[[], bool] | None = None) -> DraftBlock:
    """A block of at most ``num_speculative_tokens`` draft tokens after ``committed`` (empty without a drafter)."""
    if client.drafter is None or num_speculative_tokens <= 0:
        return DraftBlock([])
    kwargs = {"should_stop": should_stop} if should_stop is not None else {}
    return client.drafter.propose(committed, num_speculative_tokens, sampling,
                                  min_confidence=client.min_confidence, **kwargs)


def _next_block(client: GenerationContext, committed: list[int], num_speculative_tokens: int,
                sampling: SamplingParams, bet: ProactiveBet | None,
                tail: DraftBlock | None = None) -> tuple[DraftBlock, bool, float]:
    """The block to send: the one drafted ahead when the bet won, else the unjudged ``tail`` of the last block
    completed to ``num_speculative_tokens`` tokens, else a fresh draft.

    ``tail``: the draft tokens after the prefix the verifier judged and accepted whole (adaptive verification,
    ``Verdict.num_verified_positions``): they extend exactly ``committed`` and are what the drafter would draft
    from it (same prefix, same positions, same seeded draws), so they are sent again, not drafted again.

    Returns:
        (block, proactive hit, edge time spent drafting it now in s: 0 for a hit).
    """
    block = bet.take(committed, num_speculative_tokens) if bet is not None else None
    if block is not None:  # a hit (completed now if the verdict cut drafting ahead short)
        return block, True, bet.last_extend_s
    t0 = time.perf_counter()
    if tail is not None and len(tail) and num_speculative_tokens > 0:
        block = slice_block(tail, num_speculative_tokens)
        if len(block) < num_speculative_tokens:
            more = draft_block(client, committed + list(block.draft_token_ids),
                               num_speculative_tokens - len(block), sampling)
            block = concat_blocks(block, more)
        return block, False, time.perf_counter() - t0
    block = draft_block(client, committed, num_speculative_tokens, sampling)
    return block, False, time.perf_counter() - t0


def unjudged_tail(block: DraftBlock, tokens: list[int], verdict) -> DraftBlock | None:
    """The draft tokens of ``block`` the verifier did not judge, when it verified a prefix of it and accepted
    that prefix whole (``tokens``: what the verdict committed, equal to that prefix); else None."""
    m = verdict.num_verified_positions
    if m is None or verdict.finished or verdict.num_accepted != m or list(tokens) != list(block.draft_token_ids[:m]):
        return None
    tail = slice_block(block, len(block), start=m)
    tail.draft_ms = 0.0  # drafted (and counted) with the block before
    return tail


def _session_policy(client: GenerationContext, sampling: SamplingParams, plan: SessionPlan,
                    max_num_speculative_tokens: int) -> tuple[AdaptiveNumSpeculativeTokens | None, ProactiveBet | None]:
    """The session's adaptive controller and proactive bet, as the plan says (None when off)."""
    adaptive = None
    if plan.adaptive:
        adaptive = AdaptiveNumSpeculativeTokens(max_num_speculative_tokens, bonus_drafted=plan.bonus_drafted)
    bet = None
    if plan.proactive:
        bet = ProactiveBet(lambda ids, n, should_stop: draft_block(client, ids, n, sampling, should_stop))
    return adaptive, bet


def verify_session(client: GenerationContext, run: "Run", opened: SessionOpened, sampling: SamplingParams,
                   plan: SessionPlan, route: BlockObserver) -> Iterator["Chunk"]:
    """Draft, verify, commit and stream in one session until the generation finishes (``run.finish_reason``
    set), the route asks for a switch at a block boundary (``route.after_block`` True), or a call fails (raised:
    the errors of :meth:`edge_client.transport.backend.SentBlock.wait`). Each verdict is observed once
    (:class:`edge_client.generation.observation.BlockObservation`): statistics, adaptive γ and the route read
    that one observation."""
    committed, stats = run.committed, run.stats
    capacity = min(opened.max_context_tokens, len(run.prompt_ids) + run.stopping.max_new_tokens)
    max_num_speculative_tokens = min(client.num_speculative_tokens, opened.max_num_speculative_tokens)
    adaptive, bet = _session_policy(client, sampling, plan, max_num_speculative_tokens)
    # bonus_drafted: γ speculative tokens + one for the bonus position (common.rejection)
    bonus_drafted = plan.bonus_drafted
    tail = None  # the unjudged draft tokens of the last block (adaptive verification), sent again
    heads = client.drafter if isinstance(client.drafter, UsesFeatures) else None  # reads the target's features
    for seq in itertools.count(run.first_seq):
        room = capacity - len(committed) - 1  # the verdict always adds one token of its own
        wanted = adaptive.next_num_speculative_tokens() if adaptive else max_num_speculative_tokens
        block, hit, draft_s = _next_block(client, committed, max(0, min(wanted, room)) + bonus_drafted, sampling,
                                          bet, tail)
        block.bonus_drafted = bool(bonus_drafted and len(block))  # an empty block is plain decoding
        if heads is not None:  # every block asks, the loop's own empty ones too: no gap in the features
            block.features = heads.feature_request
            # positions whose verdict was read back from the store: a replica that resumed the session has them
            block.features_from = heads.features_missing_from(committed)
        sent = SentBlock(client.backend, opened.session_id, seq, len(committed), block)
        if bet is not None and len(block) and not sent.future.done():
            # bet on full acceptance: draft the bonus guess (none after a bonus_drafted block) + the next
            # while the verdict travels
            draft_s += bet.place(committed, block, max_num_speculative_tokens, capacity, sent.future.done)
        verdict, round_trip_ms = sent.wait(client.timeout_s)
        tokens, reason = run.cut(verdict.committed_token_ids, verdict.finish_reason if verdict.finished else None)
        committed.extend(tokens)
        if heads is not None:
            heads.observe_features(committed, verdict.features)
        tail = unjudged_tail(block, tokens, verdict)
        run.logprobs.extend((verdict.logprobs or [])[: len(tokens)])  # when asked for
        run.last_seq, run.session_committed = seq, verdict.committed_length
        # the first block's drafting includes the draft's prefill of the whole prompt: no per-token cost
        # (counting it made γ collapse for long prompts: the estimate decays over ~20 steps)
        obs = BlockObservation(block, verdict, round_trip_ms, draft_s, proactive_hit=hit, first=stats.num_drafts == 0)
        if adaptive is not None:
            adaptive.observe_block(obs)
        stats.observe(obs.num_speculative_tokens, dataclasses.replace(verdict, num_accepted=obs.num_accepted),
                      draft_s=draft_s, proactive_hit=hit, num_forced=block.num_forced_tokens)
        yield from run.out.push(tokens, verified=True)
        if reason is not None or route.after_block(obs):  # or a route switch at this block boundary
            run.finish_reason = reason
            return
