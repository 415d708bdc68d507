"""One speculative block and its verdict, recorded once per verdict: :class:`BlockObservation`.

The speculative segment (:func:`edge_client.generation.speculative.verify_session`) makes one observation per verdict
and hands the same object to everything that learns from it: the generation's statistics
(:meth:`edge_client.stats.GenerationStats.observe_block`), adaptive γ
(:meth:`edge_client.generation.policy.AdaptiveNumSpeculativeTokens.observe_block`) and the route
(:class:`BlockObserver`: :mod:`edge_client.generation.routing` learns its cost estimates and decides a switch). Each
derived quantity has one definition here, so the γ controller and the route's cost model cannot read the same
verdict two ways.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specdec_runtime.common.types import DraftBlock, Verdict

__all__ = ["BlockObservation", "BlockObserver"]


@dataclass(frozen=True)
class BlockObservation:
    """A block sent and the verdict on it, with the edge's timings.

    Attributes:
        block: the block sent (``num_speculative_tokens`` speculative positions; a bonus_drafted block carries one
            draft token more, at the bonus position).
        verdict: the verifier's answer (``committed_token_ids``, ``forward_ms`` and ``queue_ms`` of its step,
            ``num_verified_positions`` when it verified a prefix only).
        round_trip_ms: the block sent → its verdict available on the edge, ms.
        draft_s: edge time spent drafting the block when it was sent, s (0 for a proactive hit: drafted ahead).
        proactive_hit: the block was drafted ahead, while an earlier one travelled (proactive drafting).
        first: the generation's first block: its drafting time includes the draft's prefill of the prompt.
    """

    block: DraftBlock
    verdict: Verdict
    round_trip_ms: float
    draft_s: float = 0.0
    proactive_hit: bool = False
    first: bool = False

    @property
    def num_speculative_tokens(self) -> int:
        """γ of the block: its speculative positions (``DraftBlock.num_speculative_tokens``)."""
        return self.block.num_speculative_tokens

    @property
    def num_accepted(self) -> int:
        """Draft tokens accepted among the speculative positions, 0..γ (a bonus_drafted block's last draft token,
        taken at the bonus position, is no speculative acceptance)."""
        return min(self.verdict.num_accepted, self.num_speculative_tokens)

    @property
    def draft_ms_per_block(self) -> float | None:
        """The edge's drafting cost of this block, ms; None when that time was hidden and is no per-token cost
        (drafted ahead behind an earlier round trip, or the first block, whose time includes the prompt's
        prefill)."""
        return None if self.proactive_hit or self.first else self.block.draft_ms

    @property
    def overhead_ms(self) -> float:
        """What the step cost beyond the target's forward pass: network and the verifier's queue, ms (≥ 0)."""
        return max(0.0, self.round_trip_ms - self.verdict.forward_ms)

    @property
    def network_ms(self) -> float:
        """The network's part of the round trip: less the verifier's queue and forward, ms (≥ 0)."""
        return max(0.0, self.round_trip_ms - self.verdict.forward_ms - self.verdict.queue_ms)


class BlockObserver(Protocol):
    """What the route does after each speculative block (:mod:`edge_client.generation.routing`)."""

    def after_block(self, observation: BlockObservation) -> bool:
        """Learn from the block; True ends the speculative segment at this block boundary (a switch to cloud
        decode)."""
