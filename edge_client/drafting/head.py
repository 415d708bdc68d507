"""A drafter fed by the verifier's hidden states (:class:`HeadDrafter`): an EAGLE-style draft head
(:class:`edge_client.drafting.head_model.OnnxHead`) drafting from the target's features of the committed
positions, which the verifier sends with its answers (:mod:`common.features`), and from its own features for the
positions it drafts itself (Li et al. 2024, "EAGLE"; Li et al. 2025, "EAGLE-3").

The head's sequence is the committed one shifted by a token: entry t is (token x_{t+1}, feature f_t) and its
output predicts x_{t+2}, where f_t is the target's hidden state after x_t. After a verdict the verifier has sent
f_0 .. f_{n-2} for the n committed tokens, so every committed entry uses the target's feature; the entries of
the tokens it drafts (and of tokens not yet verified, when drafting proactively) use the head's own output of the
entry before. Those are recomputed with the target's features once they arrive: on each call the head's KV cache
is rolled back to the entries computed from target features whose tokens still match.

A reduced draft vocabulary (EAGLE-3's d2t) is scattered into the target's with -inf elsewhere before the
session's logits processing, so q is 0 outside it and the rejection rule stays exact (Leviathan et al. 2023).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from specdec_runtime.common.logits_processors import TokenHistory
from specdec_runtime.common.types import DEFAULT_DRAFT_TOP_K, DraftBlock, SamplingParams, StoppingCriteria
from specdec_runtime.edge_client.drafting.grammar import draft_grammar_for, propose_constrained
from specdec_runtime.edge_client.drafting.head_model import OnnxHead
from specdec_runtime.edge_client.drafting.turn import TurnHistory
from specdec_runtime.edge_client.drafting.step import DraftRows, below_confidence

__all__ = ["HeadDrafter"]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class HeadDrafter:
    """Drafts γ tokens per call with an :class:`OnnxHead` from the target's features (:meth:`observe_features`).

    Capabilities (:mod:`edge_client.drafting.contract`): ``Resettable``, ``HistoryProcessing``, ``UsesFeatures``,
    ``ConstrainsGrammar`` (structured output: masked drafting, forced tokens for free, as ModelDrafter); not
    ``DecodesAlone`` (without the target's features the head drafts poorly: device decoding needs a model that
    decodes alone, a standalone draft beside the head: ``EdgeClient(device_drafter=...)``).

    Args:
        head: the head runner (owned by this drafter).
        draft_top_k: k of top-k drafting for sampled sessions; <= 1 = greedy drafting always.
    """

    def __init__(self, head: OnnxHead, draft_top_k: int = DEFAULT_DRAFT_TOP_K) -> None:
        self.model = head
        self.draft_top_k = int(draft_top_k)
        self.valid_vocab_size = head.vocab_size
        self.feature_request = head.feature_request
        self._turn = TurnHistory()  # where the output starts, the ids min_tokens masks, the processors' counts
        self._grammar = None  # the generation's DraftGrammar (edge_client.drafting.grammar), when it has one
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget the KV cache and every feature received."""
        self.model.reset()
        self._entry_ids: list[int] = []  # x_0 .. x_m: entries 0..m-1 are (x_{t+1}, feature t)
        self._final_entries = 0  # leading entries that no later answer changes (see _sync)
        self._outputs = np.zeros((0, self.model.hidden_size), np.float32)  # the head's own feature per entry
        self._feature_ids: list[int] = []  # the tokens the features below belong to
        self._features = np.zeros((0, self.model.hidden_size), np.float32)  # head-width, position 0 ..
        self._known = np.zeros(0, bool)  # per position: the target's feature is there (False: a gap)

    def observe_features(self, committed_token_ids: list[int], block) -> None:
        """Take the target's features ``block`` (a common.features.FeatureBlock; None: nothing) sent for
        ``committed_token_ids`` (the committed ids after the answer that carried it). Vectors past what is held
        are appended (fused to the head's width); a block that starts past them leaves a gap (positions no answer
        covered, e.g. decoded in the cloud): the head's own features stand there for good."""
        if block is None or block.num_positions == 0:
            return
        start = int(block.start_position)
        held = min(len(self._features), _common_prefix(self._feature_ids, list(committed_token_ids)))
        fused = self.model.fuse(block.decode())
        gap = max(0, start - held)
        self._features = np.concatenate([self._features[: min(start, held)],
                                         np.zeros((gap, fused.shape[1]), np.float32), fused])
        self._known = np.concatenate([self._known[: min(start, held)], np.zeros(gap, bool),
                                      np.ones(len(fused), bool)])
        self._feature_ids = [int(t) for t in committed_token_ids[: len(self._features)]]

    def features_missing_from(self, committed_token_ids: list[int]) -> int | None:
        """The first position of ``committed_token_ids`` without a resolved feature when positions before the
        last lack theirs (a verdict read back from the store after a failover): what the next block says in
        ``DraftBlock.features_from``, so the replica that recomputed them sends them. None when every position
        but the last is resolved (the next verdict brings the last one's)."""
        held = self._target_features_for([int(t) for t in committed_token_ids])
        return held if held < len(committed_token_ids) - 1 else None

    def begin_turn(self, prompt_length: int, stopping: StoppingCriteria) -> None:
        """The generation about to be drafted (penalties and min_tokens count its output from there)."""
        self._turn.begin(prompt_length, stopping, getattr(self.model.tokenizer, "eos_token_id", None))

    def processor(self, sampling: SamplingParams, token_ids: list[int], vocab_size: int) -> TokenHistory | None:
        """The history-dependent processors' state brought to ``token_ids`` (None when the session has none)."""
        return self._turn.processor(sampling, token_ids, vocab_size)

    def draft_grammar(self, sampling: SamplingParams):
        """The generation's :class:`edge_client.drafting.grammar.DraftGrammar` for ``sampling.grammar`` (made at
        the turn's first use, kept for the rest of it).

        Raises:
            InvalidRequestError: a spec the grammar engine refuses."""
        self._grammar = draft_grammar_for(self._grammar, sampling, self.model.tokenizer, *self._turn.turn)
        return self._grammar

    def _logits_after(self, committed: list[int]) -> Callable[[list[int]], np.ndarray]:
        """The head's full-vocabulary logits after ``committed`` + the tokens drafted so far, as
        :func:`edge_client.drafting.grammar.propose_constrained` asks for them: synced to ``committed`` on the
        first call, then one step per drafted (or grammar-forced) token, each fed the head's own feature."""
        state: dict = {}

        def next_logits(token_ids: list[int]) -> np.ndarray:
            if not state:
                state["logits"], state["own"] = self._sync(committed)
                state["fed"] = len(committed)
            for token in token_ids[state["fed"]:]:
                state["logits"], state["own"] = self._step(int(token), state["own"])
            state["fed"] = len(token_ids)
            return self.model.full_vocab_logits(state["logits"])

        return next_logits

    # ------------------------------------------------------------------ the head's KV cache
    def _target_features_for(self, committed: list[int]) -> int:
        """How many leading positions of ``committed`` are resolved: the target's feature, or a gap for good."""
        return min(len(self._features), _common_prefix(self._feature_ids, committed))

    def _sync(self, committed: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Bring the head to entries 0 .. n-2 of ``committed`` (n >= 2); the last entry's (logits, own feature).
        Entries of resolved positions are final (the target's feature, or the head's own in a gap: no answer
        will change them) and kept across calls; the others are recomputed once their features arrive."""
        n = len(committed)
        known = self._target_features_for(committed)
        keep = min(_common_prefix(self._entry_ids, committed) - 1, self._final_entries, known, n - 2)
        keep = max(keep, 0)
        self.model.rollback(keep)
        self._outputs = self._outputs[:keep]
        self._final_entries = keep
        self._entry_ids = [int(t) for t in committed[: keep + 1]]
        logits, own = None, None
        upto, t = min(known, n - 1), keep  # resolved entries keep .. upto-1: runs of target features in one pass
        while t < upto:
            end = t
            while end < upto and self._known[end]:
                end += 1
            if end > t:
                out_logits, out_own = self.model.forward(committed[t + 1: end + 1], self._features[t:end])
                self._append(committed[t + 1: end + 1], out_own)
                logits, own, t = out_logits[-1], out_own[-1], end
            else:  # a gap: the entry before's own output, for good
                logits, own = self._step(int(committed[t + 1]), self._own_feature(t))
                t += 1
        self._final_entries = max(keep, upto)
        for t in range(max(upto, keep), n - 1):  # no target feature (yet): the entry before's own output
            logits, own = self._step(int(committed[t + 1]), self._own_feature(t))
        return logits, own

    def _own_feature(self, t: int) -> np.ndarray:
        """The head's own feature for entry t: entry t-1's output (zeros for the first entry)."""
        return self._outputs[t - 1] if t > 0 else np.zeros(self.model.hidden_size, np.float32)

    def _append(self, tokens, outputs: np.ndarray) -> None:
        self._entry_ids.extend(int(t) for t in tokens)
        self._outputs = np.concatenate([self._outputs, outputs])

    def _step(self, token: int, feature: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits, own = self.model.forward([token], feature[None])
        self._append([token], own)
        return logits[-1], own[-1]

    def uncached(self, committed_token_ids: list[int]) -> int:
        """Entries the next block must feed before drafting (``TracksContext``)."""
        if len(committed_token_ids) < 2:
            return 0
        keep = min(_common_prefix(self._entry_ids, committed_token_ids) - 1, self._final_entries)
        return max(0, len(committed_token_ids) - 1 - max(keep, 0))

    # ------------------------------------------------------------------ drafting
    def propose(self, committed_token_ids: list[int], num_speculative_tokens: int, sampling: SamplingParams,
                min_confidence: float = 0.0, should_stop: Callable[[], bool] | None = None) -> DraftBlock:
        """Draft up to γ tokens after the committed prefix (the :class:`edge_client.drafting.contract.Drafter`
        contract): greedy (argmax) or top-k drafting of the head's distribution over the target's vocabulary
        (draft logits at their target ids, -inf elsewhere, then the session's processing), confidence truncation
        as :class:`edge_client.drafting.drafter.ModelDrafter`. The block asks for the target's features
        (``DraftBlock.features``). A one-token context drafts nothing (the head has no entry yet).

        Returns:
            DraftBlock: ids [n <= γ]; draft_probs None (greedy) or SparseDraftProbs ids/probs [n, k]; draft_ms.

        Raises:
            ValueError: empty ``committed_token_ids``, negative γ, or sampled drafting without a seed.
        """
        t0 = time.perf_counter()
        if not committed_token_ids:
            raise ValueError("committed_token_ids must not be empty")
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        committed = [int(t) for t in committed_token_ids]
        num_tokens = int(num_speculative_tokens)
        context = self.model.max_position_embeddings
        if context:
            num_tokens = min(num_tokens, max(0, context - len(committed)))
        if num_tokens == 0 or len(committed) < 2:
            return DraftBlock([], draft_ms=(time.perf_counter() - t0) * 1e3, features=self.feature_request)
        if sampling.grammar:  # structured output: masked drafting, forced tokens without a head step
            block = propose_constrained(self, self.draft_grammar(sampling), committed, num_tokens, sampling,
                                        min_confidence, should_stop, t0, next_logits=self._logits_after(committed))
            block.features = self.feature_request
            return block
        rows = DraftRows(sampling, self.draft_top_k, self.valid_vocab_size, len(committed))
        draft_logits, own = self._sync(committed)
        history = self.processor(sampling, committed, self.valid_vocab_size)
        for i in range(num_tokens):
            logits = self.model.full_vocab_logits(draft_logits)
            if i > 0 and (below_confidence(logits, min_confidence) or (should_stop is not None and should_stop())):
                break
            if history is not None:
                logits = history.apply(logits)
            token = rows.draw(logits)
            if history is not None:
                history.push(token)
            if i + 1 < num_tokens:
                draft_logits, own = self._step(token, own)
        block = rows.block(t0)
        block.features = self.feature_request
        return block
