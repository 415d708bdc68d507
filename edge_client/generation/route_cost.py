"""The cost model behind ``route="auto"`` (edge_client.generation.routing): the expected time to finish the tokens left on
speculative decoding and on cloud decode, start-up included, from running estimates.

Speculative, steady (Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative Decoding",
eq. 1): with i.i.d. per-token acceptance α and γ draft tokens per block, a verify step commits
E = (1 − α^(γ+1)) / (1 − α) tokens in expectation; one step costs γ·c_draft + RTT + t_verify (proactive
drafting overlaps the draft with the round trip: max(γ·c_draft, RTT) + t_verify). Rate r_spec = E / step. Once
speculative blocks have run, their measured rate wins over the model: tokens committed per block / wall time per
block (verdict to verdict: drafting, the round trip, the verify, the edge's own work — what the model leaves out
or double counts, e.g. drafting ahead that overlaps the verify on a shared CPU), shifted by the change of RTT
since it was measured.

Speculative, starting (a generation's start, or a switch back from cloud decode): the draft must first ingest the
u tokens of context it has not seen (:func:`draft_unseen`: the prompt, or the tokens cloud decode committed),
at c_catchup ms per token (its prefill), and the first block cannot overlap drafting with a round trip:
T_spec(n, u) = u·c_catchup + (γ·c_draft + RTT + t_verify) + max(0, n − E) / r_spec, for n tokens left; a running
segment pays n / r_spec only.

Cloud decode (specdec.v1 Decode): a chunk of m tokens costs its first token's delay t_first (the call, one RTT,
the first verifier step; shifted by the change of RTT since measured) and m − 1 verifier steps t_step:
T_cloud(n) = Σ over the chunks that cover n of (t_first + (m − 1)·t_step). Before any cloud token: t_first =
RTT + t_step, t_step the verifier's forward pass (times 1 + floor(load) when it is saturated: a row waits for
the rows queued before it). Each new chunk (a switch to cloud, or the next chunk) pays t_first again.

α is estimated from blocks as A / (A + R): A accepted draft tokens, R blocks that ended in a rejection — the
maximum-likelihood estimate for acceptances that are i.i.d. until the first rejection (a block's accepted count is a
truncated geometric). c_catchup = (the segment's first block's draft_ms − its tokens × c_draft) / u: its first
forward pass feeds the u unseen tokens at once. Every estimate is a running mean of its first 1/w samples, then an
exponentially weighted one (weight w: 1/4 for the newest block, 1/8 for its wall time, 1/16 for the newest cloud
token, 1/4 for a start-up), so a short warm-up's first sample does not dominate; all are kept across generations of
one client (the device and the network change slowly), so the next generation's first choice is already informed
and no generation pays a probe: the RTT comes from the verdicts themselves (round trip − the verifier's queue and
forward times it reports).

Exploration (:meth:`RouteEstimates.explore_reason`): a route auto stops taking is never measured again, so a
cloud pick closer than EXPLORE_MARGIN whose speculative rate rests on few blocks (MIN_RATE_SAMPLES), or on none
of the last EXPLORE_AFTER_GENERATIONS generations, is overruled once: the generation starts cloud-first and hands
over when the draft is ready, and its blocks refresh the estimates (its loss is bounded by the margin; the usual
switch back to the cloud applies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from specdec_runtime.common.acceptance import expected_tokens
from specdec_runtime.common.types import SessionOpened, Verdict
from specdec_runtime.edge_client.drafting.contract import TracksContext
from specdec_runtime.edge_client.generation.context import GenerationContext
from specdec_runtime.edge_client.generation.observation import BlockObservation

__all__ = ["RouteEstimates", "draft_unseen", "expected_tokens_per_step", "route_reason"]

_W = 0.25  # weight of the newest block's observation (and of a start-up's)
_W_BLOCK = 1 / 8  # weight of the newest block's wall time (a loaded device's blocks swing by 2x)
_W_TOKEN = 1 / 16  # weight of the newest cloud token's (a chunk has dozens; one stalled token must not decide)
STEP_OVERHEAD_MS = 0.5  # edge + server Python per step beyond the forward pass, ms (a floor, not measured)
# auto explores speculation although the cost model picks the cloud when the pick is closer than EXPLORE_MARGIN
# and the speculative rate rests on fewer than MIN_RATE_SAMPLES blocks, or on none of the client's last
# EXPLORE_AFTER_GENERATIONS generations: a route auto stops taking is never measured again, so one slow start
# (a warm-up's first blocks) would otherwise decide every later generation
EXPLORE_MARGIN = 1.25
MIN_RATE_SAMPLES = 16
EXPLORE_AFTER_GENERATIONS = 16


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """E[tokens per verify step] with the same acceptance ``alpha`` at each of ``gamma`` positions (Leviathan et
    al. 2023 eq. 1: (1 − α^(γ+1)) / (1 − α); γ + 1 at α = 1): :func:`common.acceptance.expected_tokens`."""
    return expected_tokens([alpha] * gamma)


def route_reason(mode: str, mode_ms: float, other: str, other_ms: float, tokens_left: int) -> str:
    """The reason reported for a choice between the routes: both expected finish times (ms in, s out)."""
    return f"expected {mode_ms / 1000:.2f} s {mode} vs {other_ms / 1000:.2f} s {other} for {tokens_left} tokens"


def draft_unseen(drafter, token_ids: Sequence[int]) -> int:
    """Tokens of ``token_ids`` the draft must ingest before it drafts after them, beyond the last one (which every
    block feeds): those past the longest prefix it holds KV for (``ModelDrafter.uncached``); 0 without a drafter
    or when it is caught up; all but the last for a drafter that keeps no such record (one with nothing to
    prefill, e.g. prompt lookup, is then measured at ~0 ms per token)."""
    if drafter is None or not token_ids:
        return 0
    return drafter.uncached(token_ids) if isinstance(drafter, TracksContext) else len(token_ids) - 1


@dataclass
class RouteEstimates:
    """Running estimates of one client (ms unless named otherwise); None = not measured yet."""

    rtt_ms: float | None = None  # network round trip (verdict round trip − verifier queue and forward)
    draft_ms_per_token: float | None = None  # c_draft: the draft's cost per drafted token on this device
    catchup_ms_per_token: float | None = None  # c_catchup: the draft's cost per unseen token it ingests
    verify_ms: float | None = None  # a speculative block's queue + forward on the verifier
    cloud_step_ms: float | None = None  # time between two cloud-decoded tokens as they arrive
    cloud_first_ms: float | None = None  # a Decode call to its first token
    cloud_first_rtt_ms: float | None = None  # the RTT estimate when cloud_first_ms was last updated
    block_wall_ms: float | None = None  # wall time of a speculative block, verdict to verdict
    tokens_per_block: float | None = None  # tokens committed per speculative block
    block_rtt_ms: float | None = None  # the RTT estimate when block_wall_ms was last updated
    accepted: float | None = None  # EWMA of accepted draft tokens per block (A)
    rejected: float | None = None  # EWMA of blocks ending in a rejection (R)
    load: float = 0.0  # the verifier's load hint at the last open
    hint_forward_ms: float = 0.0  # the verifier's recent forward pass at the last open
    generations_since_blocks: int = 0  # auto / cloud-first generations begun since the last speculative block
    _unseen: int | None = None  # tokens the draft had to ingest before the segment's first block (None: not first)
    _pending: tuple[float, int, int] | None = None  # a first block's (draft_ms, tokens, unseen) until c_draft is known
    _counts: dict = field(default_factory=dict)  # samples taken per estimate

    def _update(self, name: str, value: float, weight: float) -> None:
        """A running mean over the first 1/weight samples, an exponentially weighted one after."""
        n = self._counts.get(name, 0) + 1
        self._counts[name] = n
        old = getattr(self, name)
        setattr(self, name, value if old is None else old + max(weight, 1.0 / n) * (value - old))

    # ------------------------------------------------------------------ measurements
    def begin(self, client: GenerationContext, opened: SessionOpened) -> None:
        """At a session's start: take the verifier's load hint (no probe: the RTT is learnt from the verdicts,
        and is None until the first one of this client)."""
        self.load, self.hint_forward_ms = float(opened.load), float(opened.forward_ms)
        self.generations_since_blocks += 1

    def begin_segment(self, unseen: int) -> None:
        """A speculative segment starts: its first block carries the draft's catch-up over ``unseen`` tokens
        (:func:`draft_unseen`), not a per-token drafting cost."""
        self._unseen = max(0, int(unseen))

    def observe_block(self, obs: BlockObservation, wall_ms: float | None = None) -> None:
        """One speculative block and its verdict (:class:`edge_client.generation.observation.BlockObservation`;
        the draft's cost per token is the block's own ``draft_ms`` when set, else the edge's ``draft_s``).
        ``wall_ms``: the block's wall time since the previous verdict (None for the first block of a segment: it
        carries the draft's catch-up; the block that finishes a generation is no rate sample either: it is cut
        to the tokens left)."""
        block, verdict = obs.block, obs.verdict
        gamma = obs.num_speculative_tokens
        self.generations_since_blocks = 0
        self._update("rtt_ms", obs.network_ms, _W)
        self._update("verify_ms", verdict.forward_ms + verdict.queue_ms, _W)
        draft_ms = block.draft_ms if block.draft_ms > 0 else obs.draft_s * 1000
        if gamma > 0 and draft_ms > 0:
            if not self._unseen:  # a block after a verdict, or a segment's first with nothing to catch up
                self._update("draft_ms_per_token", draft_ms / len(block), _W)
            else:
                self._pending = (draft_ms, len(block), self._unseen)
        self._unseen = None
        if self._pending is not None and self.draft_ms_per_token is not None:
            first_ms, n, unseen = self._pending
            self._pending = None
            self._update("catchup_ms_per_token", max(0.0, first_ms - n * self.draft_ms_per_token) / unseen, _W)
        if gamma > 0:
            n = obs.num_accepted
            self._update("accepted", float(n), _W)
            self._update("rejected", 1.0 if n < gamma else 0.0, _W)
        if wall_ms is not None and wall_ms > 0 and not verdict.finished:  # a last block is cut to the tokens left
            self._update("block_wall_ms", wall_ms, _W_BLOCK)
            self._update("tokens_per_block", float(len(verdict.committed_token_ids)), _W_BLOCK)
            self.block_rtt_ms = self.rtt_ms

    def observe_cloud(self, first: bool, since_last_ms: float, verdict: Verdict) -> None:
        """One cloud-decoded token, ``since_last_ms`` after the previous one (the first: after the call)."""
        if first:
            self._update("rtt_ms", max(0.0, since_last_ms - verdict.forward_ms - verdict.queue_ms), _W)
            self._update("cloud_first_ms", since_last_ms, _W)
            self.cloud_first_rtt_ms = self.rtt_ms
        else:
            self._update("cloud_step_ms", since_last_ms, _W_TOKEN)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A concurrent prefill of the draft (edge_client.drafting.prefill) fed ``num_tokens`` in ``seconds``: a
        sample of c_catchup."""
        if num_tokens > 0 and seconds > 0:
            self._update("catchup_ms_per_token", 1000 * seconds / num_tokens, _W)

    # ------------------------------------------------------------------ predictions
    @property
    def alpha(self) -> float | None:
        if self.accepted is None or self.rejected is None:
            return None
        total = self.accepted + self.rejected
        return self.accepted / total if total > 0 else 1.0

    def _gamma(self, client: GenerationContext) -> int:
        return max(1, int(client.num_speculative_tokens))

    def speculative_tokens_per_s(self, client: GenerationContext) -> float | None:
        """r_spec, expected tokens/s of a running speculative segment (module docstring): measured blocks' rate
        when there are some, else the model; None until either is known."""
        if self.block_wall_ms is not None and self.tokens_per_block is not None:
            shift = (self.rtt_ms or 0.0) - (self.block_rtt_ms or 0.0)  # the network changed since
            return 1000 * self.tokens_per_block / max(self.block_wall_ms + shift, 1e-3)
        alpha, gamma = self.alpha, self._gamma(client)
        if alpha is None or self.draft_ms_per_token is None or self.rtt_ms is None:
            return None
        draft = gamma * self.draft_ms_per_token
        rtt, verify = self.rtt_ms, self._verify_ms()
        step = (max(draft, rtt) if client.proactive else draft + rtt) + verify + STEP_OVERHEAD_MS
        return 1000 * expected_tokens_per_step(alpha, gamma) / max(step, 1e-3)

    def speculative_finish_ms(self, client: GenerationContext, tokens_left: int, unseen: int | None) -> float | None:
        """T_spec, ms to commit ``tokens_left`` more tokens speculatively: a running segment (``unseen`` None) at
        r_spec; a starting one (``unseen``: :func:`draft_unseen`) pays the draft's catch-up and a first block
        without overlap first (module docstring). None until r_spec is known."""
        rate = self.speculative_tokens_per_s(client)
        if rate is None:
            return None
        n = max(0, int(tokens_left))
        if unseen is None:
            return 1000 * n / rate
        gamma, c_draft = self._gamma(client), self.draft_ms_per_token or 0.0
        catchup = self.catchup_ms_per_token if self.catchup_ms_per_token is not None else c_draft
        first = gamma * c_draft + (self.rtt_ms or 0.0) + self._verify_ms() + STEP_OVERHEAD_MS
        per_block = self.tokens_per_block or expected_tokens_per_step(self.alpha or 0.0, gamma)
        return max(0, unseen) * catchup + first + 1000 * max(0.0, n - per_block) / rate

    def _verify_ms(self) -> float:
        return self.verify_ms if self.verify_ms is not None else self._forward_ms()

    def _forward_ms(self) -> float:
        known = self.verify_ms if self.verify_ms is not None else self.hint_forward_ms
        return known * (1 + math.floor(max(0.0, self.load)))

    def _cloud_step(self) -> float | None:
        if self.cloud_step_ms is not None:
            return self.cloud_step_ms
        return self._forward_ms() + STEP_OVERHEAD_MS if (self.verify_ms or self.hint_forward_ms) else None

    def _cloud_first(self) -> float | None:
        if self.rtt_ms is None or self._cloud_step() is None:
            return None
        if self.cloud_first_ms is None:
            return self.rtt_ms + self._cloud_step()
        return max(0.0, self.cloud_first_ms + self.rtt_ms - (self.cloud_first_rtt_ms or 0.0))

    def cloud_step_expected_ms(self) -> float | None:
        """Expected ms between two cloud tokens (module docstring); None until known."""
        return self._cloud_step()

    def cloud_first_expected_ms(self) -> float | None:
        """Expected ms from a Decode call to its first token; None until the RTT and a step time are known."""
        return self._cloud_first()

    def cloud_tokens_per_s(self, chunk: int) -> float | None:
        """Expected tokens/s of one cloud chunk of ``chunk`` tokens, its first token's delay included; None until
        the RTT and a verifier step time are known."""
        finish = self.cloud_finish_ms(chunk, chunk)
        return None if finish is None else 1000 * max(1, chunk) / max(finish, 1e-3)

    def cloud_finish_ms(self, tokens_left: int, chunk: int, max_chunk: int | None = None) -> float | None:
        """T_cloud, ms to commit ``tokens_left`` tokens by cloud decode in chunks of ``chunk`` tokens, doubling up
        to ``max_chunk`` (None: one chunk for the rest); each chunk pays the first token's delay (module
        docstring). None until the RTT and a verifier step time are known."""
        step, first = self._cloud_step(), self._cloud_first()
        if step is None or first is None:
            return None
        n, total, m = max(0, int(tokens_left)), 0.0, max(1, int(chunk))
        while n > 0:
            size = n if max_chunk is None else min(n, m)
            total += first + (size - 1) * step
            n, m = n - size, min(m * 2, max_chunk or m)
        return total

    def choose(self, client: GenerationContext, tokens_left: int, unseen: int, chunk: int, max_chunk: int | None = None
               ) -> tuple[str, str]:
        """The first mode of an ``auto`` generation and why: the one expected to finish ``tokens_left`` sooner,
        start-up included (``unseen``: the draft's catch-up, :func:`draft_unseen`), when both are known; cloud
        when it beats even a perfect draft (α = 1, free drafting and catch-up: (γ + 1) tokens per RTT + verify);
        else speculative (its first blocks measure the draft)."""
        cloud = self.cloud_finish_ms(tokens_left, chunk, max_chunk)
        spec = self.speculative_finish_ms(client, tokens_left, unseen)
        if cloud is not None and spec is not None:
            mode = "cloud" if cloud < spec else "speculative"
            return mode, route_reason("cloud", cloud, "speculative", spec, tokens_left)
        if cloud is not None and self.rtt_ms is not None:
            gamma = self._gamma(client)
            bound = tokens_left / (gamma + 1) * (self.rtt_ms + self._forward_ms() + STEP_OVERHEAD_MS)
            if cloud < bound:
                return "cloud", f"expected {cloud / 1000:.2f} s cloud beats a perfect draft's {bound / 1000:.2f} s"
        return "speculative", "draft not measured yet: speculative blocks measure it"

    def explore_reason(self, spec_ms: float | None, cloud_ms: float | None) -> str | None:
        """Why ``auto`` should run speculatively although cloud decode is expected to finish sooner (``spec_ms``,
        ``cloud_ms``: the two expected finish times of :meth:`choose`): the pick is closer than EXPLORE_MARGIN and
        the speculative rate is thin (fewer than MIN_RATE_SAMPLES blocks measured) or stale (no block in the last
        EXPLORE_AFTER_GENERATIONS generations). None: exploit the pick. The loss is bounded by the margin, and by
        the switch back to the cloud the fresh blocks may call for."""
        if spec_ms is None or cloud_ms is None or spec_ms > EXPLORE_MARGIN * cloud_ms:
            return None
        samples = self._counts.get("block_wall_ms", 0)
        close = f"speculative expected {spec_ms / 1000:.2f} s vs {cloud_ms / 1000:.2f} s cloud"
        if samples < MIN_RATE_SAMPLES:
            return f"exploring: {close}, from {samples} blocks only"
        if self.generations_since_blocks > EXPLORE_AFTER_GENERATIONS:
            return f"exploring: {close}, no block in {self.generations_since_blocks - 1} generations"
        return None

    def to_json(self) -> dict:
        return {"rtt_ms": self.rtt_ms, "draft_ms_per_token": self.draft_ms_per_token,
                "catchup_ms_per_token": self.catchup_ms_per_token, "verify_ms": self.verify_ms,
                "cloud_step_ms": self.cloud_step_ms, "cloud_first_ms": self.cloud_first_ms,
                "block_wall_ms": self.block_wall_ms, "tokens_per_block": self.tokens_per_block, "alpha": self.alpha,
                "load": self.load, "hint_forward_ms": self.hint_forward_ms}
