"""Logits processing and counter-based randomness, shared by the draft (edge) and target (cloud) sides.

Both sides call :func:`logits_to_probs` with the same :class:`~common.types.SamplingParams`, so the draft
distribution (draft_probs, q) and the target distribution (target_probs, p) are processed identically
(temperature, then top-k, then top-p, as HF transformers' logits warpers order them). Its home is
:mod:`common.logits` (the exact top-p step: :mod:`common.top_p`); the sparse q of top-k drafting,
:func:`draft_topk_from_probs` and :func:`draft_topk_distribution`, lives in :mod:`common.draft_topk`. All three
are exported here too.

Randomness is counter-based (Philox, Salmon et al. 2011, as in numpy/JAX/cuRAND): a draw is a pure
function of (seed, position, stream). A seeded session is therefore reproducible, independent of batching,
and a session resumed on another verifier replica makes the same draws.
"""

from __future__ import annotations

import enum

import numpy as np

from specdec_runtime.common.draft_topk import draft_topk_distribution, draft_topk_from_probs
from specdec_runtime.common.draws import gumbel_argmax
from specdec_runtime.common.logits import logits_to_probs
from specdec_runtime.common.types import SparseDraftProbs

__all__ = ["Stream", "dense_draft_probs", "draft_token", "draft_topk_distribution", "logits_to_probs", "normalize_sparse",
           "sample_from", "draft_topk_from_probs", "uniform"]


class Stream(enum.IntEnum):
    """Independent random streams of one session (the Philox counter's second word)."""

    ACCEPT = 0  # verifier: acceptance test u < p(x)/q(x)
    TARGET_SAMPLE = 1  # verifier: recovered / bonus token, and target-only sampling
    DRAFT_SAMPLE = 2  # edge: sampling of draft tokens
    GUMBEL = 3  # both: per token id (the counter's third word), drafter-invariant sessions (common.draws)


_MASK64 = (1 << 64) - 1


def uniform(seed: int, position: int, stream: Stream) -> float:
    """One U[0, 1) draw for token ``position`` (absolute index in the sequence) of ``stream``.

    A pure function of its arguments (Philox-4x64 keyed by ``seed``; counter = (position, stream, 0, 0)).
    """
    bitgen = np.random.Philox(key=seed & _MASK64, counter=[position, int(stream), 0, 0])
    return float(np.random.Generator(bitgen).random())


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


def draft_token(
    logits: np.ndarray,  # [vocab_size] the draft's logits at one position, history processors already applied
    sampling,  # common.types.SamplingParams; its seed keys the draw (set for a sampled session)
    draft_top_k: int,
    valid_vocab_size: int,
    position: int,  # absolute position of the drafted token, tokens
) -> tuple[int, np.ndarray | None, np.ndarray | None]:  # (token id, [k] ids, [k] float32 q) or (id, None, None)
    """The draft's token at one position: the argmax of the valid ids (greedy), or a draw from its top-k q
    (:func:`draft_topk_distribution`) with ``uniform(sampling.seed, position, Stream.DRAFT_SAMPLE)``, returned with that
    q so it goes on the wire as exactly the distribution the token was drawn from. A drafter-invariant session
    (:mod:`common.rejection`) draws it from q with the verifier's own Gumbel noise (:func:`gumbel_argmax`,
    ``Stream.GUMBEL``): the coupling that makes it the target's draw as often as q is close to p."""
    if sampling.greedy:
        return int(np.argmax(logits[:valid_vocab_size])), None, None
    ids, q = draft_topk_distribution(logits, sampling, draft_top_k, valid_vocab_size)
    seed = sampling.seed
    if sampling.drafter_invariant:
        return gumbel_argmax(ids, normalize_sparse(q), seed, position, Stream.GUMBEL), ids, q
    j = sample_from(normalize_sparse(q), uniform(seed, position, Stream.DRAFT_SAMPLE))
    return int(ids[j]), ids, q
