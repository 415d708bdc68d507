"""Logits processing and counter-based randomness, shared by the draft (edge) and target (cloud) sides.

Both sides call :func:`logits_to_probs` with the same :class:`~common.types.SamplingParams`, so the draft
distribution (draft_probs, q) and the target distribution (target_probs, p) are processed identically
(temperature, then top-k, then top-p, as HF transformers' logits warpers order them).

Randomness is counter-based (Philox, Salmon et al. 2011, as in numpy/JAX/cuRAND): a draw is a pure
function of (seed, position, stream). A seeded session is therefore reproducible, independent of batching,
and a session resumed on another verifier replica makes the same draws.
"""

from __future__ import annotations

import enum

import numpy as np

from common.types import SamplingParams, SparseDraftProbs


class Stream(enum.IntEnum):
    """Independent random streams of one session (the Philox counter's second word)."""

    ACCEPT = 0  # verifier: acceptance test u < p(x)/q(x)
    TARGET_SAMPLE = 1  # verifier: recovered / bonus token, and target-only sampling
    DRAFT_SAMPLE = 2  # edge: sampling of draft tokens


_MASK64 = (1 << 64) - 1


def uniform(seed: int, position: int, stream: Stream) -> float:
    """One U[0, 1) draw for token ``position`` (absolute index in the sequence) of ``stream``.

    A pure function of its arguments (Philox-4x64 keyed by ``seed``; counter = (position, stream, 0, 0)).
    """
    bitgen = np.random.Philox(key=seed & _MASK64, counter=[position, int(stream), 0, 0])
    return float(np.random.Generator(bitgen).random())


def logits_to_probs(
    logits: np.ndarray,  # [n, vocab_size] float32
    params: SamplingParams,
    valid_vocab_size: int | None = None,
) -> np.ndarray:  # [n, vocab_size] float64
    """Processed probabilities of each row: temperature, top-k, top-p, then softmax (float64).

    Greedy params (temperature 0) give the one-hot distribution of the argmax.
    ``valid_vocab_size``: columns at or past it (padded embedding rows) get probability 0.
    """
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim == 1:
        logits = logits[None, :]
    if valid_vocab_size is not None and valid_vocab_size < logits.shape[-1]:
        logits = logits.copy()
        logits[:, valid_vocab_size:] = -np.inf
    n, vocab = logits.shape
    if params.greedy:
        probs = np.zeros_like(logits)
        probs[np.arange(n), np.argmax(logits, axis=-1)] = 1.0
        return probs
    scaled = logits / params.temperature
    if 0 < params.top_k < vocab:
        kth = np.partition(scaled, vocab - params.top_k, axis=-1)[:, vocab - params.top_k][:, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    scaled = scaled - scaled.max(axis=-1, keepdims=True)
    probs = np.exp(scaled)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        # HF TopPLogitsWarper semantics: drop the tokens whose ascending cumulative mass is <= 1 - top_p,
        # always keeping the most likely one.
        order = np.argsort(probs, axis=-1, kind="stable")  # ascending
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        cum = np.cumsum(sorted_probs, axis=-1)
        drop_sorted = cum <= (1.0 - params.top_p)
        drop_sorted[:, -1] = False
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample_from(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF sample of one token from a (possibly unnormalized) distribution ``probs`` [vocab_size].

    Deterministic in ``u`` (U[0,1)); never returns a token of probability 0.

    Raises:
        ValueError: if ``probs`` has no positive mass.
    """
    cum = np.cumsum(probs, dtype=np.float64)
    total = cum[-1]
    if not total > 0:
        raise ValueError("cannot sample from a distribution with no mass")
    idx = int(np.searchsorted(cum, u * total, side="right"))
    idx = min(idx, len(cum) - 1)
    while probs[idx] <= 0:  # guard against float edge cases at the top end
        idx -= 1
    return idx


def normalize_sparse(probs: np.ndarray) -> np.ndarray:
    """Float64 renormalisation of wire (float32) sparse probabilities [..., k]; both sides use it."""
    probs = np.asarray(probs, dtype=np.float64)
    return probs / probs.sum(axis=-1, keepdims=True)


def topk_draft_distribution(
    probs: np.ndarray,  # [vocab_size] float64, processed draft probabilities of one position
    k: int,
) -> tuple[np.ndarray, np.ndarray]:  # ([k] int64 token ids, [k] float32 probs)
    """The sparse q of top-k drafting: the draft's k most likely tokens, renormalised.

    The draft must then sample from ``normalize_sparse(returned probs)`` so that q on the wire is exactly
    the distribution it sampled from. Zero-probability entries are dropped (k may shrink).
    """
    k = max(1, min(k, int(np.count_nonzero(probs > 0))))
    ids = np.argpartition(probs, len(probs) - k)[len(probs) - k :]
    ids = ids[np.argsort(-probs[ids], kind="stable")]
    top = probs[ids]
    return ids.astype(np.int64), (top / top.sum()).astype(np.float32)


def dense_draft_probs(
    draft_token_ids: list[int],  # [γ]
    draft_probs: SparseDraftProbs | None,
    position: int,
    vocab_size: int,
) -> np.ndarray:  # [vocab_size] float64
    """Dense q at block position ``position``: one-hot for greedy drafting, else the sparse top-k q."""
    q = np.zeros(vocab_size, dtype=np.float64)
    if draft_probs is None:
        q[draft_token_ids[position]] = 1.0
    else:
        q[draft_probs.token_ids[position]] = normalize_sparse(draft_probs.probs[position])
    return q
