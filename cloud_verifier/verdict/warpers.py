"""Logits processing of many verify positions at once, as torch tensor ops where the logits are (CPU or CUDA):
temperature → top-k → top-p → min-p → softmax, with the semantics of :func:`common.logits.logits_to_probs`
(HF's warper order and boundary rules, our tie rule; its oracle is ``specdec.logits_reference``).

Two paths, chosen per position:

- :func:`sparse_probs`, the fast path: the ``num_candidates`` most likely tokens of each position (found by
  :func:`cloud_verifier.verdict.scan.scan_logits`, the one pass over the raw logits) carry the whole
  processed distribution whenever top-k, top-p or min-p keep only tokens among them, which they prove per
  position: the kept set must end at a candidate strictly more likely than the least likely candidate (so no
  token outside, and none tied with one outside, can be kept), and every top-p decision must be the same for
  both bounds of the softmax normaliser the scan gives and further than ``_TOP_P_TOL`` from 1 − top_p
  (otherwise the dense path decides, as :mod:`common.top_p` leaves such rows to the full sort). Cost: the
  scan, instead of float64 passes, a sort and a cumsum over the vocabulary.
- :func:`dense_probs`, the general path: the reference's arithmetic over the whole vocabulary (float64, a full
  stable sort for top-p), for the positions the fast path cannot decide (wide nuclei, ties at its edge,
  top_k >= num_candidates, temperature alone).

Both give ``target_probs`` as float64; they equal the reference's up to the order of float64 sums (a few ulps),
which can move a top-p, min-p or acceptance decision only where it lies within rounding of its boundary.
"""

from __future__ import annotations

import torch

from specdec_runtime.cloud_verifier.verdict.scan import Scan

# A top-p decision is the fast path's only where its estimated ascending cumulative mass is further than this
# from 1 - top_p, for both bounds of the normaliser: the estimate and the reference's cumsum differ by the order
# of float64 sums (< 3.1·vocab_size·2**-53, 1.7e-11 at 49,152 tokens; common/top_p.py has the argument).
_TOP_P_TOL = 1e-9


def sparse_probs(
    scan: Scan,  # the candidates and normalisers of the sampled positions
    vocab: int,  # valid vocabulary size
    temperature: torch.Tensor,  # [num_sampled] float64, > 0
    top_k: torch.Tensor,  # [num_sampled] int64, 0 = off
    top_p: torch.Tensor,  # [num_sampled] float64, 1 = off
    min_p: torch.Tensor,  # [num_sampled] float64, 0 = off
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The processed distribution of each sampled position restricted to its candidates, and whether it is
    exact.

    Returns (ids [num_sampled, c] int64, probs [num_sampled, c] float64, decided [num_sampled] bool, z_open
    [num_sampled] bool): candidate token ids, most likely first (ties: higher id first, the reverse of the
    reference's ascending order), and their target_probs (0 for dropped ones). Where ``decided`` is False the
    position needs :func:`dense_probs`, unless ``z_open``: there the scan's bounds on the normaliser leave a
    top-p decision open, and with the exact normaliser (:func:`exact_normaliser`) the fast path may decide.
    """
    c = scan.cand_logits.shape[1]
    scaled = scan.cand_logits.double() / temperature[:, None]  # [n, c] the reference's float64(logits) / T
    # top-k: keep scaled >= the k-th largest (ties kept); exact here when the k-th is above the last candidate
    has_k = (top_k > 0) & (top_k < vocab)
    kth = scaled.gather(1, (top_k.clamp(1, c) - 1)[:, None])  # [n, 1]
    outside = scan.outside_logit.double() / temperature  # [n] >= every scaled logit outside the candidates
    decided = ~has_k | ((top_k < c) & (outside < kth[:, 0]))
    keep_k = ~has_k[:, None] | (scaled >= kth)  # [n, c]
    e = torch.where(keep_k, torch.exp(scaled - scaled[:, :1]), 0.0)  # [n, c] exp(scaled - max)
    # the normaliser: exact over the candidates where top-k leaves only them, else known within the scan's
    # bounds: a top-p decision is the fast path's only where both bounds give it (min-p and the renormalised
    # probabilities do not depend on it)
    z_k = e.sum(-1)
    z_low, z_high = torch.where(has_k, z_k, scan.z_low), torch.where(has_k, z_k, scan.z_high)  # [n]
    ids, probs = _by_prob_then_id_descending(scan.cand_ids, e / z_low[:, None])  # [n, c]
    least = torch.exp(outside - scaled[:, 0]) / z_low  # [n] no token outside the candidates is more likely
    complete = has_k & decided
    _, ok_high, kept_high = _top_p_sparse(probs * (z_low / z_high)[:, None], top_p, least, complete)
    probs, ok_p, kept = _top_p_sparse(probs, top_p, least, complete)
    z_open = ok_p & ~(ok_high & (kept == kept_high))  # decided by the exact normaliser only
    ok_p &= ~z_open
    has_p = top_p < 1.0
    probs, ok_m = _min_p_sparse(probs, min_p, least, inside=has_k | has_p)
    any_warper = has_k | has_p | (min_p > 0)  # temperature alone keeps every token: dense
    return ids, probs, decided & ok_p & ok_m & any_warper, z_open & decided & ok_m


def exact_normaliser(
    logits: torch.Tensor,  # [n, vocab_size] float32 (valid vocabulary)
    max_logit: torch.Tensor,  # [n] float32
    temperature: torch.Tensor,  # [n] float64
) -> torch.Tensor:  # [n] float64
    """sum(exp(float64(logits) / T - max / T)) over the vocabulary, the reference's normaliser up to the order of
    the sum. Row by row in one reused float64 buffer on a CPU (in cache, no page faults), at once on a GPU."""
    if logits.device.type != "cpu":
        scaled = logits.double() / temperature[:, None]
        return torch.exp(scaled - (max_logit.double() / temperature)[:, None]).sum(-1)
    out = torch.empty(logits.shape[0], dtype=torch.float64)
    buf = torch.empty(logits.shape[1], dtype=torch.float64)
    for i in range(logits.shape[0]):
        t = temperature[i]
        buf.copy_(logits[i]).div_(t).sub_(max_logit[i].double() / t).exp_()
        out[i] = buf.sum()
    return out


def _by_prob_then_id_descending(ids: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort [n, c] candidates by (prob descending, id descending): the reverse of the reference's ascending
    (prob, id) order, so ties straddling a top-p boundary fall as they do there."""
    by_id = torch.argsort(ids, dim=-1, descending=True)
    ids, probs = ids.gather(1, by_id), probs.gather(1, by_id)
    probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    return ids.gather(1, order), probs


def _top_p_sparse(
    probs: torch.Tensor,  # [n, c] float64, descending (ties: higher id first)
    top_p: torch.Tensor,  # [n] float64
    least: torch.Tensor,  # [n] float64: no token outside the candidates is more likely
    complete: torch.Tensor,  # [n] bool: tokens outside the candidates have probability 0 (top-k)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # (probs [n, c] renormalised where top-p applies,
    # ok [n] bool, number of tokens kept [n] int64)
    """HF's top-p rule on the candidates: the reference drops a token whose ascending cumulative mass,
    1 − (mass of the more likely tokens), is <= 1 − top_p; the most likely token is always kept."""
    n, c = probs.shape
    has_p = top_p < 1.0
    thresh = (1.0 - top_p)[:, None]
    exclusive = torch.cumsum(probs, dim=-1) - probs  # [n, c] mass of the tokens before each
    est = 1.0 - exclusive  # the reference's cumulative mass at each candidate, up to rounding
    rank = torch.arange(c, device=probs.device)
    keep = (est > thresh) | (rank == 0)  # a prefix of the ranks (est does not increase)
    num_kept = keep.sum(-1)  # [n]
    first_dropped = probs.gather(1, num_kept.clamp(max=c - 1)[:, None])[:, 0]
    inside = complete | ((num_kept < c) & (first_dropped > least))
    near = ((est - thresh).abs() <= _TOP_P_TOL) & (rank >= 1)
    ok = ~has_p | (inside & ~near.any(-1))
    kept = torch.where(keep, probs, 0.0)
    kept = kept / kept.sum(-1, keepdim=True)
    return torch.where(has_p[:, None], kept, probs), ok, num_kept


def _min_p_sparse(
    probs: torch.Tensor,  # [n, c] float64, descending
    min_p: torch.Tensor,  # [n] float64
    least: torch.Tensor,  # [n] float64 (before top-p)
    inside: torch.Tensor,  # [n] bool: top-k or top-p already leave nothing outside the candidates
) -> tuple[torch.Tensor, torch.Tensor]:  # (probs [n, c], ok [n] bool)
    """min-p (HF MinPLogitsWarper, after top-p): drop tokens below min_p × the top probability, renormalise."""
    has_m = min_p > 0.0
    bar = min_p * probs[:, 0]  # [n]
    kept = torch.where(probs < bar[:, None], 0.0, probs)
    kept = kept / kept.sum(-1, keepdim=True)
    ok = ~has_m | inside | (least < bar)
    return torch.where(has_m[:, None], kept, probs), ok


def dense_probs(
    logits: torch.Tensor,  # [num_tokens, vocab_size] float32 raw logits (valid vocabulary only)
    temperature: torch.Tensor,  # [num_tokens] float64, > 0
    top_k: torch.Tensor,  # [num_tokens] int64
    top_p: torch.Tensor,  # [num_tokens] float64
    min_p: torch.Tensor,  # [num_tokens] float64
) -> torch.Tensor:  # [num_tokens, vocab_size] float64 target_probs
    """The reference's logits processing (``specdec.logits_reference.logits_to_probs_reference``) as tensor ops,
    per position with its own parameters: float64(logits) / T, top-k (ties with the k-th kept), softmax, top-p
    by a full stable ascending sort (ties: ascending id), min-p; each step renormalises only where it applies."""
    n, vocab = logits.shape
    scaled = logits.double() / temperature[:, None]  # [n, vocab]
    has_k = (top_k > 0) & (top_k < vocab)
    for k in torch.unique(top_k[has_k]).tolist():  # one selection per distinct k (usually one)
        rows = has_k & (top_k == k)
        kth = torch.topk(scaled[rows], int(k), dim=-1).values[:, -1:]  # [r, 1]
        scaled[rows] = torch.where(scaled[rows] < kth, float("-inf"), scaled[rows])
    scaled -= scaled.max(-1, keepdim=True).values
    probs = torch.exp(scaled)
    probs /= probs.sum(-1, keepdim=True)
    has_p = top_p < 1.0
    if bool(has_p.any()):
        sorted_probs, order = torch.sort(probs, dim=-1, stable=True)  # ascending, ties by ascending id
        drop_sorted = torch.cumsum(sorted_probs, dim=-1) <= (1.0 - top_p)[:, None]
        drop_sorted[:, -1] = False
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        kept = torch.where(drop, 0.0, probs)
        probs = torch.where(has_p[:, None], kept / kept.sum(-1, keepdim=True), probs)
    has_m = min_p > 0.0
    if bool(has_m.any()):
        kept = torch.where(probs < (min_p[:, None] * probs.max(-1, keepdim=True).values), 0.0, probs)
        probs = torch.where(has_m[:, None], kept / kept.sum(-1, keepdim=True), probs)
    return probs
