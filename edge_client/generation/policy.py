"""The speculation policy of the edge client: how many tokens to draft per step, when to stop a block early,
and whether to draft the next block before the verdict on the current one arrives.

None of the three changes what is committed, in a greedy session or in a seeded sampled one (every block is
verified by the same rejection rule, whatever its length or the moment it was drafted); they change only how
fast. For a seeded sampled session with adaptive γ or proactive drafting this rests on bonus_drafted blocks
(``DraftBlock.bonus_drafted``; the rule: :mod:`common.rejection`; when the client uses them:
:class:`edge_client.client.EdgeClient`). The client switches each one on or off:

- **Adaptive num_speculative_tokens** (``adaptive=True``): :class:`AdaptiveNumSpeculativeTokens` picks γ per
  verify step, 1 ≤ γ ≤ max_num_speculative_tokens, to maximise committed tokens per second.
- **Confidence truncation** (``min_confidence=P``): a block stops early, after at least one token, when the
  draft's most likely next token has probability below P (llama.cpp's ``--draft-p-min``). It needs the draft's
  logits token by token, so it is implemented inside the drafter: the ``min_confidence`` argument of
  :meth:`edge_client.drafting.drafter.Drafter.propose` (:meth:`edge_client.drafting.drafter.ModelDrafter.propose`; the n-gram
  drafter has no probabilities and ignores it). The client only passes its setting through.
- **Proactive drafting** (``proactive=True``): :class:`ProactiveBet` drafts the next block while the current
  one is in flight, betting that it is fully accepted and that the bonus token is the one the draft predicts
  (a bonus_drafted block has no bonus token: the bet is only that all its tokens are accepted).

Adaptive γ and proactive drafting depend on timing; the output does not (see above), so a seeded session gives
the same tokens with them on or off, for any γ.

Model of adaptive γ (Leviathan et al. 2023, §3.4, extended with per-position acceptance and the network):
with α_i the probability that block position i is accepted given positions < i were, the expected tokens
committed by a block of γ draft tokens is

    E[tokens | γ] = 1 + Σ_{k=1..γ} Π_{i<k} α_i        (= (1 − α^(γ+1)) / (1 − α) for i.i.d. α)

and its expected wall time, measured on the edge, is

    T(γ) = γ · t_draft + t_verify(γ) + t_rtt,   t_verify(γ) = a + b · γ   (target forward, fitted online)

With bonus_drafted blocks γ counts the speculative positions only (the block carries γ + 1 draft tokens; its
last position yields exactly one token, as the bonus position does), so E[tokens | γ] is unchanged and the
draft term becomes (γ + 1) · t_draft (``bonus_drafted=True``).

γ* = argmax_{1 ≤ γ ≤ γ_max} E[tokens | γ] / T(γ). All quantities are exponential moving averages of what
the client measures: per-position acceptance counts, draft ms per token, the verifier's forward ms per block
(Verdict.forward_ms), and the round trip minus the forward (network + queueing). Until enough steps are
seen, γ_max is used.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from specdec_runtime.common.acceptance import expected_tokens
from specdec_runtime.common.types import DraftBlock, SparseDraftProbs
from specdec_runtime.edge_client.generation.observation import BlockObservation

__all__ = ["AdaptiveNumSpeculativeTokens", "ProactiveBet", "concat_blocks", "slice_block"]


@dataclass
class AdaptiveNumSpeculativeTokens:
    """Online controller of num_speculative_tokens (γ), the model in this module's docstring.

    Args:
        max_num_speculative_tokens: upper bound on γ, >= 1 (the client's setting, capped by the verifier's).
        ema: weight of a new observation in the moving averages (0 < ema <= 1).
        warmup_steps: steps at max_num_speculative_tokens before adapting.
        bonus_drafted: blocks carry one draft token more than γ (bonus_drafted blocks): the draft runs γ + 1
            steps per block. :meth:`observe` still takes γ (speculative positions) and the accepted count
            among them.

    Raises:
        ValueError: max_num_speculative_tokens < 1.
    """

    max_num_speculative_tokens: int
    ema: float = 0.1
    warmup_steps: int = 3
    bonus_drafted: bool = False
    accept: list[float] = field(default_factory=list)  # α_i estimates, per position
    draft_ms_per_token: float = 0.0
    rtt_ms: float = 0.0  # round trip minus target forward (network + queueing), ms
    verify_base_ms: float = 0.0  # a: forward ms of a block of 0 draft tokens
    verify_ms_per_token: float = 0.0  # b: extra forward ms per draft token
    steps: int = 0
    verified: float = 0.0  # moving average of the positions the verifier judged per block
    trimming: float = 0.0  # moving average of the fraction of blocks the verifier verified only a prefix of
    _fwd: dict = field(default_factory=dict)  # block length -> EMA of forward ms

    def __post_init__(self):
        if self.max_num_speculative_tokens < 1:
            raise ValueError(f"max_num_speculative_tokens must be >= 1, got {self.max_num_speculative_tokens}")
        self.accept = [0.8] * self.max_num_speculative_tokens

    def _avg(self, old: float, new: float, first: bool) -> float:
        return new if first else (1 - self.ema) * old + self.ema * new

    def observe(self, num_speculative_tokens: int, num_accepted: int, draft_ms: float | None,
                round_trip_ms: float, forward_ms: float, num_verified: int | None = None) -> None:
        """Record one verify step.

        Args:
            num_speculative_tokens: length of the block sent, tokens.
            num_accepted: draft tokens the verifier accepted (0..num_speculative_tokens).
            draft_ms: edge time spent drafting the block (γ + 1 tokens with ``bonus_drafted``), ms; None when
                that time was hidden and is no
                per-token cost (drafted ahead behind an earlier round trip, or the first block, whose time
                includes the draft's prefill of the whole prompt).
            round_trip_ms: block sent → verdict available, ms.
            forward_ms: the target forward pass that verified the block, ms (Verdict.forward_ms).
            num_verified: the verifier judged only the block's first ``num_verified`` positions
                (Verdict.num_verified_positions; None: all): positions past them are no observation, and γ is
                kept near what the verifier verifies (:meth:`next_num_speculative_tokens`).
        """
        n = num_speculative_tokens
        first = self.steps == 0
        self.steps += 1
        judged = n if num_verified is None else min(n, num_verified)
        self.verified = self._avg(self.verified, float(judged), first)
        self.trimming = self._avg(self.trimming, float(judged < n), first)
        # per-position conditional acceptance: positions < num_accepted accepted, position num_accepted rejected
        for i in range(min(judged, self.max_num_speculative_tokens)):
            if i < num_accepted:
                self.accept[i] = (1 - self.ema) * self.accept[i] + self.ema
            elif i == num_accepted:
                self.accept[i] = (1 - self.ema) * self.accept[i]
                break
        drafted = n + 1 if self.bonus_drafted else n
        if drafted > 0 and draft_ms is not None:
            self.draft_ms_per_token = self._avg(self.draft_ms_per_token, draft_ms / drafted, first)
        self.rtt_ms = self._avg(self.rtt_ms, max(0.0, round_trip_ms - forward_ms), first)  # BlockObservation.overhead_ms
        self._fwd[n] = self._avg(self._fwd.get(n, forward_ms), forward_ms, n not in self._fwd)
        if len(self._fwd) >= 2:  # least-squares line through the per-length averages
            xs, ys = zip(*self._fwd.items())
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            var = sum((x - mx) ** 2 for x in xs)
            b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
            self.verify_ms_per_token = max(0.0, b)
            self.verify_base_ms = max(0.0, my - self.verify_ms_per_token * mx)
        else:
            self.verify_base_ms = forward_ms

    def observe_block(self, obs: BlockObservation) -> None:
        """Record one verify step from its observation (:mod:`edge_client.generation.observation`)."""
        self.observe(obs.num_speculative_tokens, obs.num_accepted, obs.draft_ms_per_block, obs.round_trip_ms,
                     obs.verdict.forward_ms, obs.verdict.num_verified_positions)

    def expected_tokens(self, num_speculative_tokens: int) -> float:
        """E[tokens committed | γ] under the per-position acceptance estimates, tokens."""
        return expected_tokens(self.accept[:num_speculative_tokens])

    def expected_ms(self, num_speculative_tokens: int) -> float:
        """T(γ): expected wall time of a verify step with a block of γ tokens, ms."""
        n = num_speculative_tokens
        drafted = n + 1 if self.bonus_drafted else n
        return drafted * self.draft_ms_per_token + self.verify_base_ms + n * self.verify_ms_per_token + self.rtt_ms

    def next_num_speculative_tokens(self) -> int:
        """γ for the next block, in [1, max_num_speculative_tokens]."""
        if self.steps < self.warmup_steps:
            return self.max_num_speculative_tokens
        best, best_rate = 1, -1.0
        for n in range(1, self.max_num_speculative_tokens + 1):
            rate = self.expected_tokens(n) / max(self.expected_ms(n), 1e-6)
            if rate > best_rate:
                best, best_rate = n, rate
        if self.trimming > 0.5:  # the verifier keeps verifying a prefix: draft about that much (one to grow)
            best = min(best, max(1, math.ceil(self.verified) + 1))
        return best


def slice_block(block: DraftBlock, num_tokens: int, start: int = 0) -> DraftBlock:
    """Draft tokens ``start .. num_tokens - 1`` of ``block``, with their ``draft_probs`` rows and ``draft_ms``.

    ``block`` itself when that is all of it (``start == 0`` and ``len(block) <= num_tokens``).
    """
    if start == 0 and len(block) <= num_tokens:
        return block
    dp = block.draft_probs
    probs = None if dp is None else SparseDraftProbs(dp.token_ids[start:num_tokens], dp.probs[start:num_tokens])
    conf = None if block.draft_confidence is None else list(block.draft_confidence[start:num_tokens])
    return DraftBlock(list(block.draft_token_ids[start:num_tokens]), probs, block.draft_ms, block.bonus_drafted,
                      draft_confidence=conf)


def concat_blocks(a: DraftBlock, b: DraftBlock) -> DraftBlock:
    """``a`` followed by ``b`` (drafted right after it): ids, ``draft_probs`` rows (rows of different k padded
    with distinct zero-probability ids outside their support: the same q), ``draft_ms`` summed."""
    if not len(b):
        return a
    pa, pb = a.draft_probs, b.draft_probs
    probs = None
    if pa is not None and pb is not None:
        k = max(pa.token_ids.shape[1], pb.token_ids.shape[1])

        def widen(dp: SparseDraftProbs) -> SparseDraftProbs:
            n, w = dp.token_ids.shape
            if w == k:
                return dp
            ids = np.zeros((n, k), dtype=np.int64)
            q = np.zeros((n, k), dtype=np.float32)
            ids[:, :w], q[:, :w] = dp.token_ids, dp.probs
            for r in range(n):
                support = set(int(t) for t in dp.token_ids[r])
                ids[r, w:] = [t for t in range(w + k) if t not in support][: k - w]
            return SparseDraftProbs(ids, q)

        wa, wb = widen(pa), widen(pb)
        probs = SparseDraftProbs(np.concatenate([wa.token_ids, wb.token_ids]), np.concatenate([wa.probs, wb.probs]))
    conf = None
    if a.draft_confidence is not None and b.draft_confidence is not None:
        conf = list(a.draft_confidence) + list(b.draft_confidence)
    return DraftBlock(list(a.draft_token_ids) + list(b.draft_token_ids), probs, a.draft_ms + b.draft_ms,
                      a.bonus_drafted, draft_confidence=conf)


ProposeAhead = Callable[[list[int], int, Callable[[], bool]], DraftBlock]
"""``propose(committed_token_ids, num_speculative_tokens, should_stop) -> DraftBlock``: the session's drafter
with its sampling parameters, seed and min_confidence bound (see :meth:`edge_client.drafting.drafter.Drafter.propose`)."""


class ProactiveBet:
    """Proactive drafting: draft the next block while the current one is in flight.

    The bet: the block in flight is fully accepted and the verifier's bonus token is the token the draft
    predicts after it. While the verdict travels, :meth:`place` drafts ``1 + n`` tokens after
    ``committed + block``: the first is the bonus guess, the other ``n`` the next block. At the next step,
    :meth:`take` returns that block when the committed ids are exactly ``committed + block + [guess]`` (the
    bet won: the round trip was spent drafting, not waiting), and None otherwise (the bet is dropped and the
    client drafts from the committed ids as usual). A bonus_drafted block (``block.bonus_drafted``) already
    holds the draft's guess for the bonus position and a full verdict adds no token: the bet is then that the
    committed ids become exactly ``committed + block``, and the ``n`` tokens drafted after it (the next
    bonus_drafted block, its own last token included) are the prepared block. Either way the prepared block
    holds the tokens the client would have drafted from those committed ids (same drafter, same positions,
    same seeded draws), so taking it changes the speed only, never the output. Drafting ahead stops at the
    first token after the verdict arrives (``should_stop``), so a lost bet delays the next block by at most one draft forward pass.

    Verification stays lossless: the verifier checks whatever block it gets against the committed prefix the
    block extends; the bet only decides which block that is. Drafting ahead is an ordinary call of the drafter
    with the bet appended to the committed ids (:class:`edge_client.drafting.drafter.ModelDrafter` keeps the KV cache
    of their common prefix, so a won bet costs no recomputation).

    Args:
        propose: drafts a block after the given ids (:data:`ProposeAhead`).
    """

    def __init__(self, propose: ProposeAhead) -> None:
        self._propose = propose
        self._extends: list[int] | None = None  # the committed ids the prepared block extends
        self._block: DraftBlock | None = None
        self._cut = False  # drafting ahead came back short with the verdict in: cut by its arrival
        self.last_extend_s = 0.0  # wall time :meth:`take` spent completing a cut block, s

    def take(self, committed_token_ids: list[int], num_speculative_tokens: int) -> DraftBlock | None:
        """The prepared block, cut to ``num_speculative_tokens``, when it extends exactly ``committed_token_ids``
        (a hit); None otherwise. Either way the bet is spent.

        A prepared block that drafting ahead stopped short because the verdict arrived is completed to
        ``num_speculative_tokens`` by drafting its missing tokens now (``last_extend_s``: the time spent), so a
        hit sends the block the client would have drafted anyway; one the drafter itself ended early
        (confidence truncation, no proposal) is sent as it is."""
        extends, block, cut = self._extends, self._block, self._cut
        self._extends = self._block = None
        self._cut = False
        self.last_extend_s = 0.0
        if block is None or extends != committed_token_ids:
            return None
        block = slice_block(block, num_speculative_tokens)
        if cut and len(block) < num_speculative_tokens:
            t0 = time.perf_counter()
            more = self._propose(list(committed_token_ids) + list(block.draft_token_ids),
                                 num_speculative_tokens - len(block), lambda: False)
            self.last_extend_s = time.perf_counter() - t0
            block = concat_blocks(block, more)
        return block

    def place(self, committed_token_ids: list[int], block: DraftBlock, max_num_speculative_tokens: int,
              capacity: int, should_stop: Callable[[], bool]) -> float:
        """Draft ahead of ``block`` (just sent after ``committed_token_ids``) and keep the result for :meth:`take`.

        Args:
            committed_token_ids: the committed ids the block in flight extends.
            block: the block in flight (non-empty); when ``block.bonus_drafted`` no bonus guess is drafted
                and the prepared block is a bonus_drafted block too (``max_num_speculative_tokens + 1`` tokens
                at most).
            max_num_speculative_tokens: longest block to prepare (speculative tokens γ), tokens.
            capacity: prompt + output tokens the session may reach (max_new_tokens and the verifier's context
                limit); nothing is drafted when a won bet would leave no room for a draft token.
            should_stop: True once the verdict on ``block`` has arrived (``future.done``).

        Returns:
            Wall time spent drafting ahead, s (0.0 when nothing was drafted).
        """
        bet = list(committed_token_ids) + list(block.draft_token_ids)
        if block.bonus_drafted:
            # no guess to draft: the next bonus_drafted block after the bet, γ <= the room a verdict leaves
            room = capacity - len(bet) - 1
            if room < 0:
                return 0.0
            t0 = time.perf_counter()
            wanted = min(max_num_speculative_tokens, room) + 1
            ahead = self._propose(bet, wanted, should_stop)
            elapsed_s = time.perf_counter() - t0
            if len(ahead) >= 1:
                ahead.bonus_drafted = True
                # short while the verdict is in: cut by its arrival (completed at take)
                self._extends, self._block = bet, ahead
                self._cut = len(ahead) < wanted and should_stop()
            return elapsed_s
        room = capacity - len(bet) - 2  # the bonus guess, and the next verdict's own token
        if room <= 0:
            return 0.0
        t0 = time.perf_counter()
        wanted = 1 + min(max_num_speculative_tokens, room)
        ahead = self._propose(bet, wanted, should_stop)
        elapsed_s = time.perf_counter() - t0
        if len(ahead) >= 2:  # the guess and at least one draft token
            self._extends = bet + [ahead.draft_token_ids[0]]
            self._block = slice_block(ahead, len(ahead), start=1)
            self._cut = len(ahead) < wanted and should_stop()
        return elapsed_s
