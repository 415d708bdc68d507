"""How much of each queued block one batch step verifies: the verify-length policy of the batcher.

Glossary: a verify row of a block scores S = ``block.num_scored_positions`` positions when verified whole (γ + 1
for a classic block of γ draft tokens, n for a bonus_drafted block of n). Verifying it to m < S positions means
running the rejection rule on its first m draft tokens only, as the **bonus_drafted block of those m tokens**
(:func:`truncate_block`): m rows of logits, the m-th token judged like the others, no bonus token. So

- it is lossless by construction: it is an ordinary block (Leviathan et al. 2023, Algorithm 1 on a prefix, with
  the bonus_drafted departure of :mod:`common.rejection`); the tokens after m are simply not judged;
- a seeded session's tokens do not depend on m: the token at every absolute position t is the same function of
  (p_t, q_t, the session's draws at t) in the whole block and in any prefix of it, so whatever the load decided,
  the output is the one of the whole block (the edge re-sends the unjudged tail, drafted from the same prefix).

Expected committed tokens of a row verified to m positions, with α_i the calibrated acceptance of its i-th draft
token (:class:`~cloud_verifier.verify_policy.calibration.AcceptanceCalibration`):

    E(m) = 1 + Σ_{j=1..m-1} Π_{i≤j} α_i        (the same for classic and bonus_drafted blocks)

:class:`AdaptiveVerifyPolicy` chooses, over the whole batch, the m of every row that maximises expected committed
tokens per second of the step's whole cycle, Σ E(m_r) / (forward(R, T) + host + wait), R rows and T tokens in the
pass, host the step's time outside the forward pass and wait the verifier's wait for blocks before it (the
edges' drafting and round trip at low load, ≈ 0 under load: a cut there saves a little of a long cycle and costs
the session a round trip for its unjudged tail, so it is not made), from the cost
model (:class:`~cloud_verifier.verify_policy.cost.ForwardCostModel`): every row's extra positions ranked by their
marginal gain Π_{i≤j} α_i (which falls along a row, so any prefix of the ranking is a prefix of each row), the
best prefix of the ranking taken (the argmax over all prefixes, not the first local maximum: on a GPU the cost is
flat until the device fills, then linear). The greedy marginal-gain rule follows the verify-length choice that vLLM measured
under load (cumulative draft confidence against a profiled cost model).
"""

from __future__ import annotations

import threading

import numpy as np

from specdec_runtime.cloud_verifier.verify_policy.calibration import AcceptanceCalibration
from specdec_runtime.cloud_verifier.verify_policy.cost import ForwardCostModel
from specdec_runtime.common.acceptance import survival
from specdec_runtime.common.types import DraftBlock, SparseDraftProbs

__all__ = ["VERIFY_POLICIES", "AdaptiveVerifyPolicy", "VerifyPolicy", "draft_confidences", "make_verify_policy",
           "set_verify_lengths", "truncate_block"]

VERIFY_POLICIES = ("fixed", "adaptive")
TRIM_MIN_GAIN = 0.02  # a step is trimmed only when it expects ≥ 2 % more tokens/s than verifying every position
# a wait for blocks longer than this is an idle verifier (no sessions), not the edges' round trip: counted as this
MAX_WAIT_S = 1.0


def truncate_block(block: DraftBlock, num_positions: int) -> DraftBlock:
    """The block verified to its first ``num_positions`` scored positions: ``block`` itself when that is all of
    them, else the bonus_drafted block of its first ``num_positions`` draft tokens (their ``draft_probs`` rows and
    confidences), which scores exactly ``num_positions`` rows.

    Raises:
        ValueError: ``num_positions`` outside 1 .. ``block.num_scored_positions``.
    """
    if not 1 <= num_positions <= block.num_scored_positions:
        raise ValueError(f"num_positions {num_positions} outside 1..{block.num_scored_positions}")
    if num_positions == block.num_scored_positions:
        return block
    m = num_positions
    dp = block.draft_probs
    probs = None if dp is None else SparseDraftProbs(dp.token_ids[:m], dp.probs[:m])
    conf = None if block.draft_confidence is None else list(block.draft_confidence[:m])
    return DraftBlock(list(block.draft_token_ids[:m]), probs, block.draft_ms, bonus_drafted=True,
                      num_forced_tokens=min(block.num_forced_tokens, m), draft_confidence=conf)


def draft_confidences(block: DraftBlock) -> list[float | None]:
    """Per draft token its confidence: the edge's ``draft_confidence``, else q(x) of its ``draft_probs`` row
    (sampled drafting), else None (greedy drafting from an edge that sends none)."""
    if block.draft_confidence is not None:
        return [float(c) for c in block.draft_confidence]
    if block.draft_probs is None:
        return [None] * len(block.draft_token_ids)
    ids, q = np.asarray(block.draft_probs.token_ids), np.asarray(block.draft_probs.probs)
    hit = ids == np.asarray(block.draft_token_ids, dtype=ids.dtype)[:, None]  # [γ, k]
    return [float(c) for c in (q * hit).sum(axis=1)]


class VerifyPolicy:
    """``fixed``: every drafted position is verified. The base of every policy: it measures what the adaptive one
    decides from (the cost model, the calibration, verified and drafted positions), so a fixed-policy verifier
    reports them too. Subclasses override :meth:`choose`. Thread-safe (the batcher calls it in the target thread;
    reports read it elsewhere)."""

    name = "fixed"
    uses_cost_model = False  # its choice does not read the cost model (no prior, no background profile)

    def __init__(self, cost: ForwardCostModel | None = None, calibration: AcceptanceCalibration | None = None):
        self.cost = cost if cost is not None else ForwardCostModel()
        self.calibration = calibration if calibration is not None else AcceptanceCalibration()
        self.host_s = 0.0  # moving average of a step's host time outside the forward pass, s
        self.wait_s = 0.0  # moving average of the verifier's wait for blocks before a step (idle + collect), s
        self.drafted_positions = 0  # draft tokens of the verify rows (whole blocks)
        self.verified_positions = 0  # draft tokens that went through the rejection rule
        self._lock = threading.Lock()

    def choose(self, blocks: list[DraftBlock], fixed_tokens: int, fixed_rows: int = 0) -> list[int]:
        """Per block the positions to score this step, 1 <= m <= ``block.num_scored_positions``.

        ``blocks``: the step's verify rows (whole blocks, as queued); ``fixed_tokens``/``fixed_rows``: the pass's
        other rows (prefill chunks, blocks verified whole) and their tokens."""
        return [b.num_scored_positions for b in blocks]

    def estimates(self, block: DraftBlock) -> list[float]:
        """α_i of each draft token of ``block`` (calibrated, :meth:`AcceptanceCalibration.estimate`)."""
        return [self.calibration.estimate(c, i) for i, c in enumerate(draft_confidences(block))]

    def observe_step(self, rows: int, tokens: int, forward_s: float) -> None:
        """A forward pass of ``rows`` rows and ``tokens`` tokens took ``forward_s`` s (the cost model)."""
        self.cost.observe(rows, tokens, forward_s)

    def observe_host(self, host_s: float, wait_s: float = 0.0) -> None:
        """A step spent ``host_s`` s outside its forward pass, after the verifier had waited ``wait_s`` s for
        its blocks (idle since the last step, then collecting; at most :data:`MAX_WAIT_S`). Moving averages,
        weight 0.2."""
        wait_s = min(max(wait_s, 0.0), MAX_WAIT_S)
        with self._lock:
            self.host_s = host_s if not self.host_s else 0.8 * self.host_s + 0.2 * host_s
            self.wait_s = wait_s if not self.wait_s else 0.8 * self.wait_s + 0.2 * wait_s

    def observe_verdict(self, block: DraftBlock, num_judged: int, num_accepted: int) -> None:
        """The verdict on a whole ``block`` verified to its first ``num_judged`` draft tokens, ``num_accepted`` of
        them accepted: the calibration and the position counters."""
        self.calibration.observe(draft_confidences(block), self.estimates(block), num_judged, num_accepted)
        with self._lock:
            self.drafted_positions += len(block.draft_token_ids)
            self.verified_positions += num_judged

    def report(self) -> dict:
        """The policy's measurements (metrics, ``bench --replay``): cost model, host s, calibration, positions."""
        with self._lock:
            drafted, verified, host, wait = self.drafted_positions, self.verified_positions, self.host_s, self.wait_s
        return {"policy": self.name, "cost_model_s": self.cost.as_dict(), "host_s": round(host, 6),
                "wait_s": round(wait, 6),
                "calibration_error": self.calibration.calibration_error(), "calibration": self.calibration.table(),
                "drafted_positions": drafted, "verified_positions": verified}


class AdaptiveVerifyPolicy(VerifyPolicy):
    """``adaptive``: the per-row verify lengths that maximise the step's expected committed tokens per second
    (this module's docstring). Verifies whole blocks until the cost model has seen two passes."""

    name = "adaptive"
    uses_cost_model = True

    def __init__(self, *args, min_gain: float = TRIM_MIN_GAIN, **kwargs):
        super().__init__(*args, **kwargs)
        self.min_gain = min_gain

    def choose(self, blocks: list[DraftBlock], fixed_tokens: int, fixed_rows: int = 0) -> list[int]:
        full = [b.num_scored_positions for b in blocks]
        if not blocks or not self.cost or all(s == 1 for s in full):
            return full
        gains = []  # (marginal gain of the row's j-th extra position, j, row)
        for r, block in enumerate(blocks):  # the j-th extra position gains its probability of acceptance
            gains.extend((gain, j, r) for j, gain in enumerate(survival(self.estimates(block)[: full[r] - 1]), 1))
        gains.sort(key=lambda g: (-g[0], g[1]))
        base_tokens, rows = fixed_tokens + len(blocks), fixed_rows + len(blocks)
        cumulative = np.concatenate([[0.0], np.cumsum([g[0] for g in gains])])  # [len(gains) + 1]
        other_s = self.host_s + self.wait_s  # a step's cycle outside the forward pass: the cut does not shorten it
        rates = [(len(blocks) + cumulative[c]) / max(self.cost.cost_s(rows, base_tokens + c) + other_s, 1e-9)
                 for c in range(len(gains) + 1)]
        best = int(np.argmax(rates))
        if rates[best] < rates[-1] * (1 + self.min_gain):
            return full
        chosen = [1] * len(blocks)
        for _, _, r in gains[:best]:
            chosen[r] += 1
        return chosen


def set_verify_lengths(policy: VerifyPolicy, batch: list) -> None:
    """Apply ``policy`` to one batch step (``batch``: the step's :class:`cloud_verifier.work.Work` items): each
    verify row's ``block`` and ``tokens`` become the part of its queued ``full_block`` it verifies (all of it, or a
    prefix: :func:`truncate_block`; chosen again from the whole block when a row waits for KV pages). A classic
    block of a sampled Algorithm-1 session is always verified whole: for a seeded one a prefix would sample where
    the whole block judges (its edge keeps a timing-independent schedule: edge_client/generation/plan.py), and a
    session's record always holds a seed (the request's, or the one this verifier picked and the edge re-sends
    on a re-open), so a seed the user fixed is not told apart here. A bonus_drafted block's tokens do not depend
    on the cut, nor do a greedy or drafter-invariant session's."""
    fixed, verify = 0, []
    for w in batch:
        sampling = w.session.record.sampling
        if w.full_block is not None and (w.full_block.bonus_drafted or sampling.greedy
                                         or sampling.drafter_invariant):
            verify.append(w)
        else:
            fixed += len(w.tokens)
    if not verify:
        return
    for work, m in zip(verify, policy.choose([w.full_block for w in verify], fixed, len(batch) - len(verify))):
        work.block = truncate_block(work.full_block, m)
        work.tokens = [work.tokens[0], *work.block.scored_draft_token_ids]


def make_verify_policy(name: str) -> VerifyPolicy:
    """The policy named ``name`` (:data:`VERIFY_POLICIES`).

    Raises:
        ValueError: an unknown name.
    """
    if name == "fixed":
        return VerifyPolicy()
    if name == "adaptive":
        return AdaptiveVerifyPolicy()
    raise ValueError(f"unknown verify policy {name!r} (expected one of {', '.join(VERIFY_POLICIES)})")
