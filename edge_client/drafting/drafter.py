"""Drafters: what proposes draft blocks on the edge. :class:`ModelDrafter` (the ONNX draft model) has every
optional capability of :mod:`edge_client.drafting.contract`, whose :class:`Drafter` protocol is re-exported here;
:class:`edge_client.drafting.ngram.NgramDrafter` (prompt lookup, no model) is the other one.

Drafting modes of :class:`ModelDrafter` (both lossless under the verifier's rejection rule,
docs/architecture.md "Lossless verification"):

- greedy drafting (greedy sessions, or ``draft_top_k <= 1``): each draft token is the argmax of the draft's
  logits; q is one-hot and only token ids travel (``DraftBlock.draft_probs is None``).
- top-k drafting (sampled sessions): q_i = the k most likely tokens of the draft's processed distribution
  (the session's SamplingParams as ``common.sampling.logits_to_probs`` applies them), renormalised, computed
  without a full probability row (``common.sampling.draft_topk_distribution``); the draft token is
  sampled from exactly that q with the counter-based stream ``uniform(seed, position, Stream.DRAFT_SAMPLE)``,
  ``position`` being the absolute index of the drafted token. q travels as (ids, probs) [γ, k].

The history-dependent processors of the session (logit_bias, penalties, min_tokens:
:mod:`common.logits_processors`) run on the draft's logits of every position first, with that position's own
history (the committed ids and the block's draft tokens before it), exactly as the verifier applies them to the
target's, so q is the distribution the draft sampled from and stays close to p.

The token drafted for absolute position t is a function of the committed prefix before t (through q_t) and of
``uniform(seed, t, DRAFT_SAMPLE)``, not of where the block began. For a bonus_drafted block
(``DraftBlock.bonus_drafted``, :mod:`common.rejection`; the client decides when) the client asks for γ + 1
tokens; when it is accepted whole, the KV of its tokens is kept for the next block (only the last one is fed).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from specdec_runtime.common.logits_processors import TokenHistory
from specdec_runtime.common.types import DEFAULT_DRAFT_TOP_K, DraftBlock, SamplingParams, StoppingCriteria
from specdec_runtime.edge_client.drafting.contract import Drafter
from specdec_runtime.edge_client.drafting.prefix_cache import DraftPrefixCache
from specdec_runtime.edge_client.drafting.turn import TurnHistory
from specdec_runtime.edge_client.drafting.step import DraftRows, below_confidence
from specdec_runtime.edge_client.drafting.grammar import draft_grammar_for, propose_constrained
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

__all__ = ["Drafter", "ModelDrafter", "PREFILL_CHUNK_TOKENS"]

# the draft ingests a long context in forward passes of at most this many tokens, split at absolute positions
# that are multiples of it: a concurrent prefill (edge_client.drafting.prefill) yields between them, and the KV of
# a position depends only on the tokens before it and on its chunk, never on timing (an int8 draft's logits
# change with how many tokens one forward pass feeds), so a prefill cut short anywhere and resumed, or a prefix
# restored from the draft's prefix cache at a chunk boundary, holds the same KV as one fed from scratch
PREFILL_CHUNK_TOKENS = 32


class ModelDrafter:
    """Drafts γ tokens per call from the committed prefix with an :class:`OnnxDraftModel`.

    KV-cache invariant after each :meth:`propose` sync: the draft model holds the keys/values of all committed
    tokens except the last one (plus the draft tokens it has fed since). On each call the cache is rolled back
    to the longest common prefix of the tokens it holds and the committed ids (at most ``len(committed) - 1``),
    the missing committed tokens are fed in one forward pass, then one forward pass per further draft token:
    γ forward passes per block in the steady state. Proactive drafting (drafting past an in-flight block on
    the bet that it is accepted) is just a call with the bet appended to the committed ids: the common prefix
    keeps everything already computed.

    Args:
        model: the draft model runner (owned by this drafter: do not feed it elsewhere).
        draft_top_k: k of top-k drafting for sampled sessions; <= 1 = greedy drafting always.
        valid_vocab_size: token ids at or past it (padded logit columns) are never drafted; None =
            ``min(model.vocab_size, len(model.tokenizer))``. Use the value of
            :func:`common.vocab.check_vocab_compatible`.
        prefix_cache_mb: bound of the draft's prefix cache, MiB (:mod:`edge_client.drafting.prefix_cache`: KV of
            prompt prefixes reused by new sessions that start with them); 0 = none.
    """

    def __init__(self, model: OnnxDraftModel, draft_top_k: int = DEFAULT_DRAFT_TOP_K,
                 valid_vocab_size: int | None = None, prefix_cache_mb: float = 0.0) -> None:
        self.model = model
        self.draft_top_k = int(draft_top_k)
        if valid_vocab_size is None:
            valid_vocab_size = min(model.vocab_size, len(model.tokenizer))
        if not 0 < valid_vocab_size <= model.vocab_size:
            raise ValueError(f"valid_vocab_size must be in [1, {model.vocab_size}], got {valid_vocab_size}")
        self.valid_vocab_size = int(valid_vocab_size)
        self._cached_ids: list[int] = []  # token ids whose KV the model holds, in order
        self._canonical = 0  # leading cached tokens fed in whole chunks from position 0 (storable snapshots)
        self.prefix_cache = DraftPrefixCache(prefix_cache_mb, PREFILL_CHUNK_TOKENS) if prefix_cache_mb > 0 else None
        self.model.reset()
        self._turn = TurnHistory()  # where the output starts, the ids min_tokens masks, the processors' counts
        self._grammar = None  # the generation's DraftGrammar (edge_client.drafting.grammar), when it has one

    def begin_turn(self, prompt_length: int, stopping: StoppingCriteria) -> None:
        """The generation (or conversation turn) about to be drafted: its prompt length (penalties over the output
        and min_tokens count from there) and stopping criteria (the ids min_tokens masks: the tokenizer's EOS
        unless ignore_eos, and the stop token ids). Without it the whole history counts as output."""
        self._turn.begin(prompt_length, stopping, getattr(self.model.tokenizer, "eos_token_id", None))

    def processor(self, sampling: SamplingParams, token_ids: list[int], vocab_size: int) -> TokenHistory | None:
        """The history-dependent processors' state brought to ``token_ids``, or None when the session has
        none (incremental: only the tokens that changed since the last call are counted)."""
        return self._turn.processor(sampling, token_ids, vocab_size)

    def reset(self) -> None:
        """Forget the draft KV cache (e.g. when a new session starts); the prefix cache stays."""
        self.model.reset()
        self._cached_ids = []
        self._canonical = 0

    def room(self, num_committed: int) -> int:
        """Draft tokens that fit after ``num_committed`` committed tokens within the draft's context
        (``max_position_embeddings``; unbounded when unknown): feeding the committed prefix and γ - 1 draft tokens
        uses num_committed + γ - 1 positions. 0 past the window: a draft shorter than the target stops drafting
        there (blocks of 0 draft tokens, the target decoding alone; lossless either way), where re-encoding a
        slid window would cost a full re-prefill per block."""
        context = self.model.max_position_embeddings
        if not context:
            return 1 << 30
        return max(0, int(context) - int(num_committed) + 1)

    def _cached_prefix(self, committed_token_ids) -> int:
        """Tokens of ``committed[:-1]`` whose KV the cache holds: the longest common prefix (the last committed
        token is always fed, it yields the logits)."""
        keep, limit = 0, min(len(committed_token_ids) - 1, len(self._cached_ids))
        while keep < limit and self._cached_ids[keep] == committed_token_ids[keep]:
            keep += 1
        return keep

    def uncached(self, committed_token_ids) -> int:
        """Tokens the next block must feed before the last committed one (its catch-up prefill): those of
        ``committed[:-1]`` past the cached prefix; 0 when caught up."""
        if not committed_token_ids:
            return 0
        return len(committed_token_ids) - 1 - self._cached_prefix(committed_token_ids)

    def _sync(self, committed_token_ids: list[int]) -> np.ndarray:
        """Bring the KV cache to ``committed[:-1]`` (+ nothing) and feed from there; return last-row logits."""
        keep = self._hold_prefix(committed_token_ids)
        logits = self._feed([int(t) for t in committed_token_ids[keep:]])[-1]  # >= 1 token: the last one at least
        if len(committed_token_ids) - keep > PREFILL_CHUNK_TOKENS:  # a prefill: a new context to remember
            self._remember()
        return logits

    def _hold_prefix(self, token_ids) -> int:
        """Bring the KV to the longest prefix of ``token_ids[:-1]`` it holds (rolled back), or to a longer one
        from the prefix cache (restored); its length."""
        if self.model.num_cached != len(self._cached_ids):  # the model was used behind our back
            self.reset()
        keep = self._cached_prefix(token_ids)
        if self.prefix_cache is not None and len(token_ids) - 1 - keep >= PREFILL_CHUNK_TOKENS:
            found = self.prefix_cache.lookup(token_ids, len(token_ids) - 1)
            if found is not None and found[0] > keep:
                self.model.restore(found[1])
                self._cached_ids = [int(t) for t in token_ids[: found[0]]]
                self._canonical = found[0]
                return found[0]
        self.model.rollback(keep)
        del self._cached_ids[keep:]
        self._canonical = min(self._canonical, keep - keep % PREFILL_CHUNK_TOKENS)
        return keep

    def _remember(self) -> None:
        """Store the KV of the whole chunks fed from position 0 in the prefix cache (when it lacks them)."""
        n = self._canonical
        if self.prefix_cache is not None and n >= PREFILL_CHUNK_TOKENS and \
                not self.prefix_cache.covers(self._cached_ids[:n]):
            self.prefix_cache.store(self._cached_ids[:n], self.model.snapshot(n))

    def _feed(self, token_ids: list[int]) -> np.ndarray:
        """Feed ``token_ids`` after the cached ones in chunks split at multiples of PREFILL_CHUNK_TOKENS
        (absolute positions); the logits [n_last_chunk, vocab] of the last chunk."""
        pos, logits = 0, None
        while pos < len(token_ids):
            start = self.model.num_cached
            n = min(len(token_ids) - pos, PREFILL_CHUNK_TOKENS - start % PREFILL_CHUNK_TOKENS)
            logits = self.model.forward(token_ids[pos:pos + n])
            self._cached_ids.extend(token_ids[pos:pos + n])
            if start == self._canonical and n == PREFILL_CHUNK_TOKENS:  # a whole chunk, after whole chunks
                self._canonical += n
            pos += n
        return logits

    def prefill_step(self, token_ids: list[int], whole_chunks: bool = False) -> int:
        """Feed the next chunk (at most PREFILL_CHUNK_TOKENS, up to the next chunk boundary) of
        ``token_ids[:-1]`` past the cached prefix: what a concurrent prefill calls until it returns 0, so that
        the next :meth:`propose` after ``token_ids`` feeds only the last token (and what came since).
        ``whole_chunks``: stop at the last chunk boundary (the rest is fed by that propose, in the chunks a
        prefill from scratch would have used: a seeded sampled generation's KV must not depend on timing).
        Returns the tokens fed (0: caught up)."""
        keep = self._hold_prefix(token_ids)
        target = len(token_ids) - 1
        if self.model.max_position_embeddings:  # past the draft's context it drafts nothing (room): no prefill
            target = min(target, int(self.model.max_position_embeddings))
        if whole_chunks:
            target -= target % PREFILL_CHUNK_TOKENS
        end = min(target, keep - keep % PREFILL_CHUNK_TOKENS + PREFILL_CHUNK_TOKENS)
        if end <= keep:
            self._remember()
            return 0
        self._feed([int(t) for t in token_ids[keep:end]])
        return end - keep

    def draft_grammar(self, sampling: SamplingParams):
        """The generation's :class:`edge_client.drafting.grammar.DraftGrammar` for ``sampling.grammar`` (made at
        the turn's first use, kept for the rest of it: drafting and device fallback share one matcher).

        Raises:
            InvalidRequestError: a spec the grammar engine refuses."""
        self._grammar = draft_grammar_for(self._grammar, sampling, self.model.tokenizer, *self._turn.turn)
        return self._grammar

    def next_token_logits(self, committed_token_ids: list[int]) -> np.ndarray:
        """The draft's raw logits [vocab_size] (float32) for the token after ``committed_token_ids`` (non-empty),
        reusing and then extending the KV cache as :meth:`propose` does (device fallback decoding,
        :mod:`edge_client.generation.fallback`).

        Raises:
            ValueError: empty ``committed_token_ids``.
        """
        if not committed_token_ids:
            raise ValueError("committed_token_ids must not be empty")
        return self._sync(committed_token_ids)

    def propose(
        self,
        committed_token_ids: list[int],
        num_speculative_tokens: int,
        sampling: SamplingParams,
        min_confidence: float = 0.0,
        should_stop: Callable[[], bool] | None = None,
    ) -> DraftBlock:
        """Draft ``num_speculative_tokens`` (γ) tokens after the committed prefix (the :class:`Drafter` contract).

        Confidence truncation (llama.cpp's ``--draft-p-min``; dSpark's confidence head): the block stops early,
        after at least one token, when the draft's most likely next token has probability (softmax of its raw
        logits) below ``min_confidence``; 0 disables it. The block may then hold fewer than γ tokens.
        ``should_stop``: checked before each token after the first; True ends the block there (proactive
        drafting stops drafting ahead once the verdict it bets on has arrived).

        Args:
            committed_token_ids: prompt + committed output ids (non-empty).
            num_speculative_tokens: γ >= 0 (0 returns an empty block).
            sampling: the session's SamplingParams (the same processing the verifier applies to p; its seed keys
                the DRAFT_SAMPLE stream, unused for greedy drafting).

        Returns:
            DraftBlock with γ draft ids (fewer when truncated or stopped); ``draft_probs`` None for greedy
            drafting, else SparseDraftProbs with
            ids int64 [γ, k] and probs float32 [γ, k] (each row the exact q the token was sampled from; rows
            are padded with zero-probability ids only when some q has fewer than k tokens); ``draft_ms`` the
            wall time of the call, ms.

        Raises:
            ValueError: empty ``committed_token_ids``, negative γ, or sampled drafting without a seed.
        """
        t0 = time.perf_counter()
        if not committed_token_ids:
            raise ValueError("committed_token_ids must not be empty")
        num_tokens = int(num_speculative_tokens)
        if num_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        num_tokens = min(num_tokens, self.room(len(committed_token_ids)))
        if num_tokens == 0:  # also past the draft's context: plain decoding (the target's token alone) from here
            return DraftBlock(draft_token_ids=[], draft_probs=None, draft_ms=(time.perf_counter() - t0) * 1e3)
        if sampling.grammar:  # structured output: masked drafting, forced tokens for free
            return propose_constrained(self, self.draft_grammar(sampling), committed_token_ids, num_tokens, sampling,
                                       min_confidence, should_stop, t0)
        rows = DraftRows(sampling, self.draft_top_k, self.valid_vocab_size, len(committed_token_ids))
        logits = self._sync(committed_token_ids)
        history = self.processor(sampling, committed_token_ids, len(logits))
        for i in range(num_tokens):
            if i > 0 and below_confidence(logits[: self.valid_vocab_size], min_confidence):
                break
            if i > 0 and should_stop is not None and should_stop():
                break
            if history is not None:  # this position's history: committed ids + tokens[:i] (pushed below)
                logits = history.apply(np.array(logits, dtype=np.float32))
            token = rows.draw(logits)
            if history is not None:
                history.push(token)
            if i + 1 < num_tokens:
                logits = self.model.forward([token])[-1]
                self._cached_ids.append(token)
        return rows.block(t0)
