"""N-gram (prompt lookup) drafter: proposes the continuation of the latest earlier match of the context's last
n tokens. Needs no model (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` proposer; llama.cpp's
lookup decoding). Greedy drafting: q is one-hot on each proposed token, so only ids travel and verification is
lossless for greedy and sampled sessions alike.

Sampled sessions draft token by token: the token proposed for absolute position t is the lookup's first token
after ``context[:t]`` (the prefix committed, plus the tokens drafted before it in the block), a function of
that prefix alone. With bonus_drafted blocks (``DraftBlock.bonus_drafted``, :mod:`common.rejection`) this
keeps a seeded sampled session's output independent of where blocks begin: a continuation copied from the
match found at the block's start would make the one-hot q at t depend on that start. Greedy sessions copy the
whole continuation of one match (their output does not depend on the proposal).
"""

from __future__ import annotations

import time

import numpy as np

from specdec_runtime.common.types import DraftBlock, SamplingParams


class NgramDrafter:
    """Prompt-lookup drafter.

    Args:
        max_ngram: longest suffix n-gram to look up, tokens (tried first).
        min_ngram: shortest suffix n-gram to look up, tokens.
        max_lookback: only the last ``max_lookback`` context tokens are searched (bounds the cost per block).

    Raises:
        ValueError: ``min_ngram < 1`` or ``max_ngram < min_ngram``.
    """

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_lookback: int = 4096):
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_lookback = max_lookback

    def reset(self) -> None:
        """Nothing to forget: a proposal is a function of the committed ids alone
        (:class:`edge_client.drafting.contract.Resettable`, asked by seeded sampled generations)."""

    def lookup(self, context: list[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` tokens that followed the latest earlier occurrence of the longest matching
        suffix n-gram of ``context`` (empty if none)."""
        ctx = np.asarray(context[-self.max_lookback :], dtype=np.int64)
        n_ctx = len(ctx)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            suffix = ctx[n_ctx - n :]
            # windows ending before the suffix itself: starts 0 .. n_ctx - n - 1
            windows = np.lib.stride_tricks.sliding_window_view(ctx[: n_ctx - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # latest match; continuation starts after it
                return ctx[start : start + num_tokens].tolist()
        return []

    def propose(
        self, committed_token_ids: list[int], num_speculative_tokens: int, sampling: SamplingParams,
        min_confidence: float = 0.0, should_stop=None,
    ) -> DraftBlock:
        """Draft up to ``num_speculative_tokens`` (γ) tokens by prompt lookup (the
        :class:`edge_client.drafting.drafter.Drafter` contract): fewer, or none, when the match is short or absent.

        Greedy drafting: ``draft_probs`` is None (q one-hot). A greedy ``sampling`` copies the continuation of
        one match; a sampled one looks up each token after the prefix so far (module docstring: the token at
        each position is a function of the prefix before it): the seed is unused; so are ``min_confidence``
        (no probabilities to truncate on) and ``should_stop`` (a lookup takes microseconds).
        ``draft_ms``: the wall time of the call, ms.
        """
        t0 = time.perf_counter()
        if num_speculative_tokens <= 0:
            tokens: list[int] = []
        elif sampling.greedy:
            tokens = self.lookup(committed_token_ids, num_speculative_tokens)
        else:
            context, tokens = list(committed_token_ids), []
            while len(tokens) < num_speculative_tokens:
                nxt = self.lookup(context, 1)
                if not nxt:
                    break
                tokens.append(nxt[0])
                context.append(nxt[0])
        return DraftBlock(draft_token_ids=tokens, draft_probs=None, draft_ms=(time.perf_counter() - t0) * 1e3)
