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
maximum-likelihood estimate for acceptances that are i.i.d. until the first rejection (a block's accepted count
is a truncated geometric). Every estimate is an exponentially weighted mean (weight 1/4 for the newest), kept
across generations of one client (the device and the network change slowly), so the next generation's first
choice is already informed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.types import DraftBlock, SessionOpened, Verdict

if TYPE_CHECKING:
    from edge_client.client import EdgeClient
    from edge_client.generation import Run

__all__ = ["RouteEstimates", "expected_tokens_per_step"]

_W = 0.25  # weight of the newest observation
STEP_OVERHEAD_MS = 0.5  # edge + server Python per step beyond the forward pass, ms (a floor, not measured)


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """Leviathan et al. 2023 eq. 1: E[tokens per verify step] = (1 − α^(γ+1)) / (1 − α); γ + 1 at α = 1."""
    alpha = min(max(alpha, 0.0), 1.0)
    if alpha >= 1.0 - 1e-9:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + _W * (new - old)


@dataclass
class RouteEstimates:
    """Running estimates of one client (ms unless named otherwise); None = not measured yet."""

    rtt_ms: float | None = None  # network round trip (verdict round trip − verifier queue and forward)
    draft_ms_per_token: float | None = None  # the draft's cost per drafted token on this device
    verify_ms: float | None = None  # a speculative block's queue + forward on the verifier
    cloud_step_ms: float | None = None  # time between two cloud-decoded tokens as they arrive
    accepted: float | None = None  # EWMA of accepted draft tokens per block (A)
    rejected: float | None = None  # EWMA of blocks ending in a rejection (R)
    load: float = 0.0  # the verifier's load hint at the last open
    hint_forward_ms: float = 0.0  # the verifier's recent forward pass at the last open
    _first_block: bool = True

    # ------------------------------------------------------------------ measurements
    def begin(self, client: "EdgeClient", opened: SessionOpened) -> None:
        """At a session's start: take the load hint, and measure the RTT once by a health probe when none is
        known (the backend's ``probe``/``check_health``; an in-process backend has neither: RTT 0)."""
        self.load, self.hint_forward_ms = float(opened.load), float(opened.forward_ms)
        if self.rtt_ms is not None:
            return
        probe = getattr(client.backend, "probe", None) or getattr(client.backend, "check_health", None)
        if probe is None:
            self.rtt_ms = 0.0
            return
        best = math.inf
        for _ in range(2):
            t0 = time.perf_counter()
            if probe(2.0):
                best = min(best, (time.perf_counter() - t0) * 1000)
        self.rtt_ms = best if math.isfinite(best) else None

    def new_generation(self) -> None:
        self._first_block = True

    def observe_block(self, block: DraftBlock, verdict: Verdict, round_trip_ms: float, draft_s: float) -> None:
        """One speculative block and its verdict (the first block of a generation carries the draft's prompt
        prefill: its draft time is not a per-token cost)."""
        gamma = block.num_speculative_tokens
        self.rtt_ms = _ewma(self.rtt_ms, max(0.0, round_trip_ms - verdict.forward_ms - verdict.queue_ms))
        self.verify_ms = _ewma(self.verify_ms, verdict.forward_ms + verdict.queue_ms)
        if gamma > 0 and draft_s > 0 and not self._first_block:
            self.draft_ms_per_token = _ewma(self.draft_ms_per_token, draft_s * 1000 / len(block))
        self._first_block = False
        if gamma > 0:
            n = min(verdict.num_accepted, gamma)
            self.accepted = _ewma(self.accepted, float(n))
            self.rejected = _ewma(self.rejected, 1.0 if n < gamma else 0.0)

    def observe_cloud(self, first: bool, since_last_ms: float, verdict: Verdict) -> None:
        """One cloud-decoded token, ``since_last_ms`` after the previous one (the first: after the call)."""
        if first:
            self.rtt_ms = _ewma(self.rtt_ms, max(0.0, since_last_ms - verdict.forward_ms - verdict.queue_ms))
        else:
            self.cloud_step_ms = _ewma(self.cloud_step_ms, since_last_ms)

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
        """Expected tokens/s of speculative blocks (module docstring); None until α and the draft cost are known."""
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
                "cloud_step_ms": self.cloud_step_ms, "alpha": self.alpha, "load": self.load,
                "hint_forward_ms": self.hint_forward_ms}
