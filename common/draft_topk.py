"""The sparse q of top-k drafting (sampled sessions, the edge side): the draft's k most likely tokens,
renormalised, from a processed row (:func:`draft_topk_from_probs`) or straight from raw logits without a full
probability row (:func:`draft_topk_distribution`). Exported by :mod:`common.sampling` as well.
"""

from __future__ import annotations

import numpy as np

from specdec_runtime.common.logits import logits_to_probs
from specdec_runtime.common.types import SamplingParams

_DRAFT_MAX_TIED = 4096  # draft_topk_distribution: more tokens tied at its k-th largest logit go the reference's way


def draft_topk_from_probs(
    probs: np.ndarray,  # [vocab_size] float64, processed draft probabilities of one position
    k: int,
) -> tuple[np.ndarray, np.ndarray]:  # ([k'] int64 token ids, [k'] float32 probs), k' = min(k, tokens with p > 0)
    """The sparse q of top-k drafting: the draft's k most likely tokens, renormalised.

    The draft must then sample from ``normalize_sparse(returned probs)`` so that q on the wire is exactly
    the distribution it sampled from. Zero-probability entries are dropped (k may shrink).

    Ties: of the tokens tied with the k-th largest probability, the lowest ids are taken; the result is
    ordered most likely first, equal probabilities by ascending id (the first k of a stable descending sort).
    Only the edge runs this (the verifier gets ids and q on the wire), so the rule is for reproducibility,
    not for losslessness. No full-vocabulary sort: the k-th largest value comes from ``np.partition`` over
    the tokens of positive probability only (after top-k/top-p most of a row is 0, and tens of thousands of
    equal keys make introselect ~30x slower), then two comparison passes pick the ids.
    """
    probs = np.asarray(probs)
    positive = probs > 0  # [vocab_size]
    num_positive = int(np.count_nonzero(positive))
    if num_positive == 0:  # no mass: the argmax, with probability nan (as the full sort gave)
        ids = np.array([int(np.argmax(probs))], dtype=np.int64)
    else:
        cand = None if num_positive == len(probs) else np.flatnonzero(positive)  # [num_positive] ascending ids
        vals = probs if cand is None else probs[cand]  # [num_positive]
        k = max(1, min(k, num_positive))
        if k < num_positive:
            v = np.partition(vals, num_positive - k)[num_positive - k]  # k-th largest probability
            above = np.flatnonzero(vals > v)
            sel = np.concatenate([above, np.flatnonzero(vals == v)[: k - len(above)]])  # ties: lowest ids
        else:
            sel = np.arange(num_positive)
        sel = sel[np.lexsort((sel, -vals[sel]))]  # most likely first, ties by ascending id
        ids = (sel if cand is None else cand[sel]).astype(np.int64)
    top = probs[ids]
    return ids, (top / top.sum()).astype(np.float32)


def draft_topk_distribution(
    logits: np.ndarray,  # [vocab_size] float32, the draft's raw logits of one position
    params: SamplingParams,  # sampled (temperature > 0)
    k: int,  # top-k drafting's k, >= 1
    valid_vocab_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # ([k'] int64 token ids, [k'] float32 probs), 1 <= k' <= k
    """The sparse q of top-k drafting straight from raw logits: what
    ``draft_topk_from_probs(logits_to_probs(logits, params, valid_vocab_size)[0], k)`` gives, without a
    full-vocabulary probability row.

    Only the k most likely tokens of the processed distribution are needed, and top-p keeps a prefix of the
    tokens sorted most likely first (token j is kept iff the mass of the tokens before it is < top_p, the
    first always), so the k most likely tokens, their probabilities and the softmax normaliser decide it:
    one partial selection of the raw logits (the k largest; ties with the k-th: the lowest ids), one pass of
    exp over the row for the normaliser (float32, summed in float64; over the top-k-kept tokens when top-k is
    on), and a cumulative sum of k numbers. About 0.3 ms for 49,152 tokens against about 1 ms for the full
    row.

    Where it departs from the reference: the top-p decision at a candidate is taken on the descending
    cumulative sum of k float64 probabilities, the reference's on the ascending sum of the whole row, and the
    normaliser's exp is float32; they differ by rounding only, so the kept prefix can differ only when the
    mass of the tokens before a candidate is within ~1e-7 of top_p, and q's probabilities by ~1e-7. Either
    way q stays exactly the distribution the draft samples from (it samples from this q), which is all
    losslessness asks of the draft (:class:`edge_client.drafting.drafter.Drafter`); the verifier's target_probs keep
    the reference's exact semantics. Rows that are not finite, and greedy params, go through the reference.
    """
    logits = np.asarray(logits)
    if logits.ndim != 1:
        raise ValueError(f"logits must be one row [vocab_size], got shape {logits.shape}")
    row = logits[:valid_vocab_size] if valid_vocab_size is not None else logits
    n = len(row)
    k = max(1, min(int(k), n))
    m = float(row.max())
    if params.greedy or not np.isfinite(m):  # NaN anywhere makes the max NaN
        return _draft_q_by_full_row(logits, params, k, valid_vocab_size)
    # G: the tokens whose logit is >= the k-th largest, in the reference's top-p order (most likely first,
    # ties: highest id first); top-p keeps a prefix of that order, and q's k tokens are among G's kept ones
    v = np.partition(row, n - k)[n - k] if k < n else row.min()
    g = np.flatnonzero(row >= v)  # [>= k] ascending ids
    if len(g) > _DRAFT_MAX_TIED:  # thousands of equal logits: the reference's full row
        return _draft_q_by_full_row(logits, params, k, valid_vocab_size)
    g = g[np.lexsort((-g, -row[g]))]
    scaled_max = np.float64(m) / params.temperature  # the reference's row max of float64(logits) / temperature
    top = np.exp(row[g].astype(np.float64) / params.temperature - scaled_max)  # [len(g)] unnormalised
    scratch = np.empty(n, dtype=np.float64)
    np.divide(row, params.temperature, out=scratch, dtype=np.float64)  # the reference's scaled logits
    if 0 < params.top_k < n:  # top-k of the processed distribution: logits >= its k-th largest (ties kept)
        kth = np.partition(row, n - params.top_k)[n - params.top_k]
        top[row[g] < kth] = 0.0
        np.copyto(scratch, -np.inf, where=row < kth)
    scratch -= scaled_max
    # the normaliser: exp in float32 (vectorised; float64 exp is scalar libm on many CPUs, ~4x slower), summed
    # in float64: within ~1e-7 of the reference's, which only rounds q (the draft samples from the q it sends)
    z = float(np.exp(scratch.astype(np.float32), dtype=np.float32).sum(dtype=np.float64))
    probs = top / z  # [len(g)] processed probabilities before top-p
    keep = int(np.count_nonzero(probs > 0))  # positive ones first (most likely first)
    if params.top_p < 1.0:  # token j is kept iff the mass before it is < top_p (the first always)
        keep = min(keep, 1 + int(np.count_nonzero(np.cumsum(probs[:-1]) < params.top_p)))
    if params.min_p > 0.0 and keep:  # min-p keeps a prefix too: probabilities >= min_p x the top one
        keep = int(np.count_nonzero(probs[:keep] >= params.min_p * probs[0]))
    if keep == 0:  # everything underflowed: the reference's answer (the argmax)
        return _draft_q_by_full_row(logits, params, k, valid_vocab_size)
    kept_ids, kept = g[:keep], probs[:keep]
    order = np.lexsort((kept_ids, -kept))[:k]  # draft_topk_from_probs's order: most likely, then lowest id
    ids, q = kept_ids[order].astype(np.int64), kept[order]
    total = q.sum()
    return ids, (q / total).astype(np.float32)


def _draft_q_by_full_row(
    logits: np.ndarray, params: SamplingParams, k: int, valid_vocab_size: int | None
) -> tuple[np.ndarray, np.ndarray]:  # ([k'] int64 ids, [k'] float32 probs)
    """draft_topk_distribution's fallback: the full processed row, then its top k."""
    return draft_topk_from_probs(logits_to_probs(logits[None, :], params, valid_vocab_size)[0], k)
