"""Drafting under a grammar (:func:`propose_constrained`, called by :meth:`ModelDrafter.propose` when the
generation has a grammar): the draft masks its own logits with the session's grammar before argmax/sampling, and
drafts the tokens the grammar forces FOR FREE.

- The mask is the same the verifier applies to the target's logits (:mod:`common.grammar`, one engine, one
  tokenizer): ids outside the grammar get −inf first, then the session's history-dependent processors and the
  warpers, so q is exactly the distribution the draft drew from and it never proposes what the grammar forbids.
- A forced token: where the mask leaves exactly one id, the target's processed probability of it is 1, so the
  draft appends it to the block without a draft forward pass (q one-hot on it) and keeps going; the tokens of a
  run of forced positions are fed to the draft model together with the next unforced one (one forward pass for
  them all). ``num_forced`` of the block is reported in :attr:`ConstrainedBlock.num_forced`.

Lossless by the rejection rule either way (Leviathan et al. 2023: any q works when it is the one drawn from); the
free tokens only change speed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from specdec_runtime.common.errors import InvalidRequestError
from specdec_runtime.common.grammar import (CompiledGrammar, GrammarMatcher, GrammarSpec, apply_mask, compile_grammar,
                            grammar_tokenizer)
from specdec_runtime.common.types import DraftBlock, SamplingParams
from specdec_runtime.edge_client.drafting.step import DraftRows, below_confidence

__all__ = ["DraftGrammar", "draft_grammar_for", "propose_constrained"]


@dataclass
class DraftGrammar:
    """The generation's grammar on the edge: its matcher over the output from ``start`` (the turn's prompt
    length), and the number of forced tokens the last block drafted for free."""

    compiled: CompiledGrammar
    start: int
    matcher: GrammarMatcher | None = None
    spec_json: str = ""
    last_num_forced: int = 0

    def __post_init__(self) -> None:
        if self.matcher is None:
            self.matcher = self.compiled.matcher()


def draft_grammar_for(current: DraftGrammar | None, sampling: SamplingParams, tokenizer, prompt_length: int,
                      stop_ids) -> DraftGrammar:
    """The drafter's grammar for ``sampling.grammar`` over the turn whose output starts at ``prompt_length``:
    ``current`` when it is that one, else compiled (cached per spec and tokenizer). EOS ids: ``stop_ids`` (the
    turn's EOS + stop token ids), else the tokenizer's EOS.

    Raises:
        InvalidRequestError: a spec the engine refuses (its message)."""
    if current is not None and current.spec_json == sampling.grammar and current.start == prompt_length:
        return current
    eos = sorted(stop_ids) or [int(tokenizer.eos_token_id)]
    try:
        compiled = compile_grammar(GrammarSpec.from_json(sampling.grammar), grammar_tokenizer(tokenizer, eos))
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    return DraftGrammar(compiled, int(prompt_length), spec_json=sampling.grammar)


def _empty(t0: float) -> DraftBlock:
    return DraftBlock(draft_token_ids=[], draft_probs=None, draft_ms=(time.perf_counter() - t0) * 1e3)


def propose_constrained(drafter, grammar: DraftGrammar, committed_token_ids: list[int], num_tokens: int,
                        sampling: SamplingParams, min_confidence: float, should_stop,
                        t0: float, next_logits=None) -> DraftBlock:
    """:meth:`ModelDrafter.propose` under ``grammar`` (γ = ``num_tokens`` > 0 already capped to the draft's
    room). Same contract and return value (draft ids [n] with n <= γ, sparse q rows for top-k drafting, a forced
    position's row one-hot on its id; the per-position step: :mod:`edge_client.drafting.step`); the block ends early
    at an EOS, when the grammar allows nothing, at confidence truncation or ``should_stop``.

    ``drafter``: the :class:`edge_client.drafting.drafter.ModelDrafter` that drafts (its model, ``processor``,
    ``draft_top_k`` and ``valid_vocab_size``). ``next_logits(token_ids)``: the draft's logits [vocab] after
    ``token_ids`` (committed + drafted so far); None: ``drafter.next_token_logits`` (a draft head, which cannot
    decode alone, gives its own). Returns an empty block when the committed prefix does not match the grammar
    (the verifier decides then)."""
    next_logits = drafter.next_token_logits if next_logits is None else next_logits
    m = grammar.matcher
    grammar.last_num_forced = 0
    try:
        m.sync(committed_token_ids[grammar.start:])
    except ValueError:
        return _empty(t0)
    valid = drafter.valid_vocab_size
    rows = DraftRows(sampling, drafter.draft_top_k, valid, len(committed_token_ids))
    processor = drafter.processor  # the history-dependent processors (a ModelDrafter always has them)
    history = None
    num_forced = 0
    for i in range(num_tokens):
        if m.has_ended:
            break  # nothing is drafted after EOS (a block, or a proactive bet, that ended with it)
        if i > 0 and should_stop is not None and should_stop():
            break
        forced = m.single_allowed()
        if forced is not None and forced < valid:
            token = forced
            num_forced += 1
            rows.force(token)
        else:
            # feeds what is unfed
            logits = np.array(next_logits(committed_token_ids + rows.tokens), dtype=np.float32)
            allowed = m.mask(len(logits))
            allowed[valid:] = False
            if not np.isfinite(logits[allowed]).any():  # nothing allowed, or only what the draft gives q = 0
                break
            if processor is not None and history is None:
                history = processor(sampling, committed_token_ids + rows.tokens, len(logits))
            if history is not None:
                history.apply(logits, allowed)
            else:
                apply_mask(logits, allowed)
            if i > 0 and below_confidence(logits[:valid], min_confidence):
                break
            token = rows.draw(logits)
        if history is not None:
            history.push(token)
        m.advance([token])
    grammar.last_num_forced = num_forced
    return rows.block(t0, num_forced)
