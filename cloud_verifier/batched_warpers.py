"""Logits processing of many verify positions at once, as torch tensor ops where the logits are (CPU or CUDA):
temperature → top-k → top-p → min-p → softmax, with the semantics of :func:`common.logits.logits_to_probs`
(HF's warper order and boundary rules, our tie rule; its oracle is ``specdec.logits_reference``).

Two paths, chosen per position:

- :func:`sparse_probs`, the fast path: the ``num_candidates`` most likely tokens of each position (one
  ``torch.topk`` over the raw logits) carry the whole processed distribution whenever top-k, top-p or min-p
  keep only tokens among them, which they prove per position: the kept set must end at a candidate strictly
  more likely than the least likely candidate (so no token outside, and none tied with one outside, can be
  kept), and no top-p decision may lie within ``_TOP_P_TOL`` of 1 − top_p (there the dense path decides, as
  :mod:`common.top_p` leaves such rows to the full sort). Cost: the top-k selection and, without top-k, one
  float32 exp pass for the softmax normaliser, instead of float64 passes, a sort and a cumsum over the
  vocabulary.
- :func:`dense_probs`, the general path: the reference's arithmetic over the whole vocabulary (float64, a full
  stable sort for top-p), for the positions the fast path cannot decide (wide nuclei, ties at its edge,
  top_k >= num_candidates, temperature alone).

Both give ``target_probs`` as float64; they equal the reference's up to the order of float64 sums (a few ulps),
which can move a top-p, min-p or acceptance decision only where it lies within rounding of its boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

NUM_CANDIDATES = 64  # tokens the fast path keeps per position: real nuclei at top-p 0.9, T 0.7 have 1-57
# A top-p decision is the fast path's only where its estimated ascending cumulative mass is further than this
# from 1 - top_p: the normaliser comes from a float32 pass (relative error ~1e-6 at 49,152 tokens).
_TOP_P_TOL = 1e-5


@dataclass
class Scan:
    """What one pass over the full logits gives, per position (the only full-vocabulary passes of the fast
    path): the guard's input, the greedy argmax, the candidates and the softmax normaliser."""

    max_logit: torch.Tensor  # [num_tokens] float32 (NaN: some NaN logit; +inf; -inf: no finite logit)
    argmax: torch.Tensor  # [num_tokens] int64 (lowest id among ties; meaningful for greedy positions)
    cand_logits: torch.Tensor  # [num_sampled, c] float32, descending
    cand_ids: torch.Tensor  # [num_sampled, c] int64
    normaliser: torch.Tensor  # [num_sampled] float64: sum(exp((logits - max) / T)) over the vocabulary


def scan_logits(
    rows: list[torch.Tensor],  # per verify row [positions, vocab_size] float32, one device
    valid_vocab_size: int,
    sampled: np.ndarray,  # [num_tokens] bool: positions of sampled (not greedy) rows
    temperature: np.ndarray,  # [num_tokens] float64 (used where sampled)
    num_candidates: int = NUM_CANDIDATES,
) -> Scan:
    """One pass over all rows' logits: row by row on a CPU (no copy of the logits; one reused scratch buffer:
    fresh [num_tokens, vocab_size] temporaries cost more in page faults than the arithmetic here), all rows in
    one chunk on a GPU."""
    dev = rows[0].device
    c = min(num_candidates, valid_vocab_size)
    if dev.type != "cpu":  # one chunk: a few kernels for the whole batch
        rows = [torch.cat(rows)] if len(rows) > 1 else rows
    scratch = torch.empty((max(r.shape[0] for r in rows), valid_vocab_size), device=dev)  # reused: no faults
    parts: list[tuple] = []
    start = 0
    for x in rows:  # on a CPU one verify row at a time (~1 MB): no copy of the logits, temporaries in cache
        n = x.shape[0]
        parts.append(_scan_chunk(x[:, :valid_vocab_size], sampled[start:start + n], temperature[start:start + n],
                                 c, scratch[:n]))
        start += n
    return Scan(*(torch.cat([p[j] for p in parts]) for j in range(5)))


def _scan_chunk(
    x: torch.Tensor,  # [n, vocab_size] float32 (valid vocabulary)
    sampled: np.ndarray,  # [n] bool
    temperature: np.ndarray,  # [n] float64
    c: int,
    scratch: torch.Tensor,  # [n, vocab_size] float32, overwritten
) -> tuple:  # the Scan fields of these n positions (candidates and normaliser: of the sampled ones)
    dev = x.device
    max_logit = x.amax(-1)  # [n]
    argmax = x.argmax(-1) if not sampled.all() else torch.zeros(x.shape[0], dtype=torch.int64, device=dev)
    if not sampled.any():
        empty = torch.empty((0, c), device=dev)
        return max_logit, argmax, empty, empty.long(), torch.empty(0, dtype=torch.float64, device=dev)
    m = max_logit
    if not sampled.all():
        at = torch.from_numpy(np.flatnonzero(sampled)).to(dev)
        x, m = x.index_select(0, at), max_logit.index_select(0, at)
        scratch = scratch[: x.shape[0]]
    cand_logits, cand_ids = torch.topk(x, c, dim=-1)  # [s, c] descending by logit (ties: any order)
    t32 = torch.from_numpy(temperature[sampled]).to(dev).float()[:, None]
    torch.sub(x, m[:, None], out=scratch).div_(t32).exp_()  # exp((logits - max) / T) in float32
    normaliser = scratch.sum(-1, dtype=torch.float64)  # [s]
    return max_logit, argmax, cand_logits, cand_ids, normaliser


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

    Returns (ids [num_sampled, c] int64, probs [num_sampled, c] float64, decided [num_sampled] bool): candidate
    token ids, most likely first (ties: higher id first, the reverse of the reference's ascending order), and
    their target_probs (0 for dropped ones). Where ``decided`` is False the position needs :func:`dense_probs`.
    """
    c = scan.cand_logits.shape[1]
    scaled = scan.cand_logits.double() / temperature[:, None]  # [n, c] the reference's float64(logits) / T
    # top-k: keep scaled >= the k-th largest (ties kept); exact here when the k-th is above the last candidate
    has_k = (top_k > 0) & (top_k < vocab)
    kth = scaled.gather(1, (top_k.clamp(1, c) - 1)[:, None])  # [n, 1]
    decided = ~has_k | ((top_k < c) & (scaled[:, -1] < kth[:, 0]))
    keep_k = ~has_k[:, None] | (scaled >= kth)  # [n, c]
    e = torch.where(keep_k, torch.exp(scaled - scaled[:, :1]), 0.0)  # [n, c] exp(scaled - max)
    # the normaliser: exact over the candidates where top-k leaves only them, else the float32 pass's (only
    # top-p decisions further than _TOP_P_TOL from their boundary depend on it; the rest renormalise)
    z = torch.where(has_k, e.sum(-1), scan.normaliser)  # [n]
    ids, probs = _by_prob_then_id_descending(scan.cand_ids, e / z[:, None])  # [n, c]
    least = probs[:, -1]  # [n] every token outside the candidates is at most this likely
    probs, ok_p = _top_p_sparse(probs, top_p, least, complete=has_k & decided)
    has_p = top_p < 1.0
    probs, ok_m = _min_p_sparse(probs, min_p, least, inside=has_k | has_p)
    any_warper = has_k | has_p | (min_p > 0)  # temperature alone keeps every token: dense
    return ids, probs, decided & ok_p & ok_m & any_warper


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
) -> tuple[torch.Tensor, torch.Tensor]:  # (probs [n, c] renormalised where top-p applies, ok [n] bool)
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
    return torch.where(has_p[:, None], kept, probs), ok


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
