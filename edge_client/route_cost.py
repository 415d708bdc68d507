"""The cost model behind ``route="auto"`` (edge_client.routing): expected client tokens per second of
speculative decoding and of cloud decode, from running estimates.

Speculative (Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative Decoding",
eq. 1): with i.i.d. per-token acceptance α and γ draft tokens per block, a verify step commits
E = (1 − α^(γ+1)) / (1 − α) tokens in expectation; one step costs γ·c_draft + RTT + t_verify (proactive
drafting overlaps the draft with the round trip: max(γ·c_draft, RTT) + t_verify). Rate = E / step.

Cloud decode (specdec.v1 Decode): a chunk of n tokens costs one RTT and n verifier steps: rate =
n / (RTT + n·t_step), with t_step the verifier's time per γ = 0 step (its forward pass, times 1 + floor(load)
when the verifier is saturated: a row waits for the rows queued before it).

α is estimated from blocks as A / (A + R): A accepted draft tokens, R blocks that ended in a rejection — the
maximum-likelihood estimate for acceptances that are i.i.d. until the first rejection (a block's accepted count is a
truncated geometric). Once speculative blocks have run, their measured rate wins over the model: tokens committed
per block / wall time per block (verdict to verdict: drafting, the round trip, the verify, the edge's own work —
what the model leaves out or double counts, e.g. drafting ahead that overlaps the verify on a shared CPU), shifted
by the change of RTT since it was measured. Every estimate is an exponentially weighted mean (weight 1/4 for the
newest block, 1/8 for its wall time, 1/16 for the newest cloud token), kept across generations of one client (the
device and the network change slowly), so the next generation's first choice is already informed and no generation
pays a probe: the RTT comes from the verdicts themselves (round trip − the verifier's queue and forward times it
reports).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.types import DraftBlock, SessionOpened, Verdict

if TYPE_CHECKING:
    from edge_client.client import EdgeClient
    from edge_client.generation import Run

__all__ = ["RouteEstimates", "expected_tokens_per_step"]

_W = 0.25  # weight of the newest block's observation
_W_BLOCK = 1 / 8  # weight of the newest block's wall time (a loaded device's blocks swing by 2x)
_W_TOKEN = 1 / 16  # weight of the newest cloud token's (a chunk has dozens; one stalled token must not decide)
STEP_OVERHEAD_MS = 0.5  # edge + server Python per step beyond the forward pass, ms (a floor, not measured)


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """Leviathan et al. 2023 eq. 1: E[tokens per verify step] = (1 − α^(γ+1)) / (1 − α); γ + 1 at α = 1."""
    alpha = min(max(alpha, 0.0), 1.0)
    if alpha >= 1.0 - 1e-9:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def _ewma(old: float | None, new: float, weight: float = _W) -> float:
    return new if old is None else old + weight * (new - old)


@dataclass
class RouteEstimates:
    """Running estimates of one client (ms unless named otherwise); None = not measured yet."""

    rtt_ms: float | None = None  # network round trip (verdict round trip − verifier queue and forward)
    draft_ms_per_token: float | None = None  # the draft's cost per drafted token on this device
    verify_ms: float | None = None  # a speculative block's queue + forward on the verifier
    cloud_step_ms: float | None = None  # time between two cloud-decoded tokens as they arrive
    block_wall_ms: float | None = None  # wall time of a speculative block, verdict to verdict
    tokens_per_block: float | None = None  # tokens committed per speculative block
    block_rtt_ms: float | None = None  # the RTT estimate when block_wall_ms was last updated
    accepted: float | None = None  # EWMA of accepted draft tokens per block (A)
    rejected: float | None = None  # EWMA of blocks ending in a rejection (R)
    load: float = 0.0  # the verifier's load hint at the last open
    hint_forward_ms: float = 0.0  # the verifier's recent forward pass at the last open
    _first_block: bool = True

    # ------------------------------------------------------------------ measurements
    def begin(self, client: "EdgeClient", opened: SessionOpened) -> None:
        """At a session's start: take the verifier's load hint (no probe: the RTT is learnt from the verdicts,
        and is None until the first one of this client)."""
        self.load, self.hint_forward_ms = float(opened.load), float(opened.forward_ms)

    def new_generation(self) -> None:
        self._first_block = True

    def observe_block(self, block: DraftBlock, verdict: Verdict, round_trip_ms: float, draft_s: float,
                      wall_ms: float | None = None) -> None:
        """One speculative block and its verdict. ``draft_s``: edge time spent drafting for it (the draft's
        cost per token is the block's own ``draft_ms`` when set; the first block of a generation carries the
        draft's prompt prefill: not a per-token cost). ``wall_ms``: the block's wall time since the previous
        verdict (None for the first block of a segment: it carries the draft's catch-up)."""
        gamma = block.num_speculative_tokens
        self.rtt_ms = _ewma(self.rtt_ms, max(0.0, round_trip_ms - verdict.forward_ms - verdict.queue_ms))
        self.verify_ms = _ewma(self.verify_ms, verdict.forward_ms + verdict.queue_ms)
        draft_ms = block.draft_ms if block.draft_ms > 0 else draft_s * 1000
        if gamma > 0 and draft_ms > 0 and not self._first_block:
            self.draft_ms_per_token = _ewma(self.draft_ms_per_token, draft_ms / len(block))
        self._first_block = False
        if gamma > 0:
            n = min(verdict.num_accepted, gamma)
            self.accepted = _ewma(self.accepted, float(n))
            self.rejected = _ewma(self.rejected, 1.0 if n < gamma else 0.0)
        if wall_ms is not None and wall_ms > 0:
            self.block_wall_ms = _ewma(self.block_wall_ms, wall_ms, _W_BLOCK)
            self.tokens_per_block = _ewma(self.tokens_per_block, float(len(verdict.committed_token_ids)), _W_BLOCK)
            self.block_rtt_ms = self.rtt_ms

    def observe_cloud(self, first: bool, since_last_ms: float, verdict: Verdict) -> None:
        """One cloud-decoded token, ``since_last_ms`` after the previous one (the first: after the call)."""
        if first:
            self.rtt_ms = _ewma(self.rtt_ms, max(0.0, since_last_ms - verdict.forward_ms - verdict.queue_ms))
        else:
            self.cloud_step_ms = _ewma(self.cloud_step_ms, since_last_ms, _W_TOKEN)

    # ------------------------------------------------------------------ predictions
    @property
    def alpha(self) -> float | None:
        if self.accepted is None or self.rejected is None:
            return None
        total = self.accepted + self.rejected
        return self.accepted / total if total > 0 else 1.0

    def _gamma(self, client: "EdgeClient") -> int:
        return max(1, int(client.num_speculative_tokens))

    def speculative_tokens_per_s(self, client: "EdgeClient") -> float | None:
        """Expected tokens/s of speculative blocks (module docstring): measured blocks' rate when there are
        some, else the model; None until either is known."""
        if self.block_wall_ms is not None and self.tokens_per_block is not None:
            shift = (self.rtt_ms or 0.0) - (self.block_rtt_ms or 0.0)  # the network changed since
            return 1000 * self.tokens_per_block / max(self.block_wall_ms + shift, 1e-3)
        alpha, gamma = self.alpha, self._gamma(client)
        if alpha is None or self.draft_ms_per_token is None or self.rtt_ms is None:
            return None
        verify = self.verify_ms if self.verify_ms is not None else self._forward_ms()
        draft = gamma * self.draft_ms_per_token
        step = (max(draft, self.rtt_ms) if client.proactive else draft + self.rtt_ms) + verify + STEP_OVERHEAD_MS
        return 1000 * expected_tokens_per_step(alpha, gamma) / max(step, 1e-3)

    def _forward_ms(self) -> float:
        known = self.verify_ms if self.verify_ms is not None else self.hint_forward_ms
        return known * (1 + math.floor(max(0.0, self.load)))

    def cloud_tokens_per_s(self, run: "Run | None", chunk: int) -> float | None:
        """Expected tokens/s of cloud decode in chunks of ``chunk`` tokens (fewer near the end); None until the
        RTT and a verifier step time are known."""
        step = self.cloud_step_ms if self.cloud_step_ms is not None else (
            self._forward_ms() + STEP_OVERHEAD_MS if (self.verify_ms or self.hint_forward_ms) else None)
        if step is None or self.rtt_ms is None:
            return None
        if run is not None:
            chunk = max(1, min(chunk, run.stopping.max_new_tokens - run.num_generated))
        return 1000 * chunk / max(self.rtt_ms + chunk * step, 1e-3)

    def choose(self, client: "EdgeClient", run: "Run", chunk: int) -> tuple[str, str]:
        """The first mode of an ``auto`` generation and why: the faster expected one when both are known;
        cloud when it beats even a perfect draft (α = 1, free drafting: (γ + 1) tokens per RTT + verify);
        else speculative (its first blocks measure the draft)."""
        cloud, spec = self.cloud_tokens_per_s(run, chunk), self.speculative_tokens_per_s(client)
        if cloud is not None and spec is not None:
            return ("cloud", f"expected {cloud:.1f} tok/s cloud vs {spec:.1f} speculative") if cloud > spec else \
                ("speculative", f"expected {spec:.1f} tok/s speculative vs {cloud:.1f} cloud")
        if cloud is not None and self.rtt_ms is not None:
            gamma = self._gamma(client)
            bound = 1000 * (gamma + 1) / max(self.rtt_ms + self._forward_ms() + STEP_OVERHEAD_MS, 1e-3)
            if cloud > bound:
                return "cloud", f"expected {cloud:.1f} tok/s cloud beats a perfect draft's {bound:.1f}"
        return "speculative", "draft not measured yet: speculative blocks measure it"

    def to_json(self) -> dict:
        return {"rtt_ms": self.rtt_ms, "draft_ms_per_token": self.draft_ms_per_token, "verify_ms": self.verify_ms,
                "cloud_step_ms": self.cloud_step_ms, "block_wall_ms": self.block_wall_ms,
                "tokens_per_block": self.tokens_per_block, "alpha": self.alpha, "load": self.load,
                "hint_forward_ms": self.hint_forward_ms}
