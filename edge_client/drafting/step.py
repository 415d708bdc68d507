"""The per-position draft step, one home for plain drafting (:meth:`edge_client.drafting.drafter.ModelDrafter.propose`) and
grammar-constrained drafting (:func:`edge_client.drafting.grammar.propose_constrained`): confidence truncation,
the draw (:func:`common.sampling.draft_token`: argmax, or a sample from the top-k of q), and the block's sparse q
rows (Leviathan et al. 2023: the verifier needs q of every drafted token to apply the rejection rule).
"""

from __future__ import annotations

import time

import numpy as np

from specdec_runtime.common.sampling import draft_token
from specdec_runtime.common.types import DraftBlock, SamplingParams, SparseDraftProbs

__all__ = ["DraftRows", "below_confidence", "stack_rows", "top_probability"]


def top_probability(logits: np.ndarray) -> float:
    """The most likely token's probability under softmax(logits) (logits [n], masked entries -inf; 0.0 when none
    is finite), float64 arithmetic."""
    finite = logits[np.isfinite(logits)]
    if not finite.size:
        return 0.0
    return 1.0 / float(np.sum(np.exp(finite.astype(np.float64) - float(np.max(finite)))))


def below_confidence(logits: np.ndarray, min_confidence: float) -> bool:
    """Confidence truncation (llama.cpp's draft-p-min): True when the most likely token's probability under
    softmax(logits) (logits [valid_vocab_size], masked entries -inf) is below ``min_confidence`` (0 = never)."""
    if min_confidence <= 0.0:
        return False
    return top_probability(logits) < min_confidence


class DraftRows:
    """The tokens of one block being drafted and, for a sampled session, each position's sparse q row.

    Args:
        sampling: the session's parameters; draft_top_k: k of top-k drafting (1 = greedy drafting).
        valid_vocab_size: ids the draft may propose (its tokenizer's), < the logits' width when padded.
        start: the absolute position of the block's first token (the draws of :func:`common.sampling.draft_token`
            are keyed by it and ``sampling.seed``: timing-independent).

    Raises:
        ValueError: a sampled session's ``sampling`` without a seed.
    """

    def __init__(self, sampling: SamplingParams, draft_top_k: int, valid_vocab_size: int, start: int):
        self.sampling, self.draft_top_k, self.valid = sampling, draft_top_k, valid_vocab_size
        self.start = start
        self.greedy = sampling.greedy or draft_top_k <= 1
        if not sampling.greedy and sampling.seed is None:
            raise ValueError("sampled drafting needs sampling.seed (the verifier picks one at session open)")
        self.tokens: list[int] = []
        self.rows_ids: list[np.ndarray] = []
        self.rows_q: list[np.ndarray] = []
        self.confidence: list[float] = []  # per token: its draft probability (DraftBlock.draft_confidence)

    def draw(self, logits: np.ndarray) -> int:
        """Draw the next position's token from the processed draft logits [>= valid_vocab_size]; record it."""
        token, ids, q = draft_token(logits, self.sampling, self.draft_top_k, self.valid,
                                    self.start + len(self.tokens))
        if not self.greedy:
            self.rows_ids.append(ids)
            self.rows_q.append(q)
            self.confidence.append(float(q[np.flatnonzero(ids == token)[0]]))
        else:  # q is one-hot for the rejection rule; the softmax probability of the argmax is the confidence
            self.confidence.append(top_probability(logits[: self.valid]))
        self.tokens.append(token)
        return token

    def force(self, token: int) -> None:
        """Record a token the grammar forces: its q row is one-hot on it (q = 1, so it is judged as drafted)."""
        if not self.greedy:
            self.rows_ids.append(np.array([token], dtype=np.int64))
            self.rows_q.append(np.array([1.0], dtype=np.float32))
        self.confidence.append(1.0)
        self.tokens.append(int(token))

    def block(self, t0: float, num_forced_tokens: int = 0) -> DraftBlock:
        """The DraftBlock of what was drafted (draft_ms from ``t0``, a time.perf_counter() reading)."""
        draft_probs = None if self.greedy or not self.tokens else stack_rows(self.rows_ids, self.rows_q)
        return DraftBlock(draft_token_ids=list(self.tokens), draft_probs=draft_probs,
                          draft_ms=(time.perf_counter() - t0) * 1e3, num_forced_tokens=num_forced_tokens,
                          draft_confidence=list(self.confidence) if self.tokens else None)


def stack_rows(rows_ids: list[np.ndarray], rows_q: list[np.ndarray]) -> SparseDraftProbs:
    """Stack per-position sparse q rows into [γ, k] arrays, k = the widest row.

    A narrower row (its distribution had fewer than k tokens of non-zero probability, e.g. under top-k/top-p
    sampling) is padded with distinct token ids outside its support and probability 0, so the dense q it
    denotes is unchanged.
    """
    k = max(len(r) for r in rows_ids)
    ids_out = np.empty((len(rows_ids), k), dtype=np.int64)
    q_out = np.zeros((len(rows_ids), k), dtype=np.float32)
    for r, (ids, q) in enumerate(zip(rows_ids, rows_q)):
        n = len(ids)
        ids_out[r, :n] = ids
        q_out[r, :n] = q
        if n < k:
            support = set(int(t) for t in ids)
            pad = [t for t in range(n + k) if t not in support][: k - n]
            ids_out[r, n:] = pad
    return SparseDraftProbs(token_ids=ids_out, probs=q_out)
