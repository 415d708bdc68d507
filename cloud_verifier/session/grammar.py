"""The verifier's grammar of a session (:class:`SessionGrammar`): built from the spec the session record carries,
checked at OpenSession/ExtendSession, and applied to every verify row before the rest of the logits pipeline.

The verifier is the authority: at each scored position of a block the ids outside the grammar get −inf
(:func:`mask_row_logits`), so a draft token the grammar forbids has target probability 0 and the rejection rule
rejects it by itself (Leviathan et al. 2023, Algorithm 1 with the constrained p). The matcher follows the
COMMITTED output only: each block first brings it to the committed ids (:meth:`GrammarMatcher.sync`, O(tokens
committed since)), advances along the block's draft ids to build one mask per position and rolls back at once
(:meth:`GrammarMatcher.block_masks`). The committed ids move only with a successful store commit
(``Session.confirm``), so a refused or unanswered commit never leaves the matcher past the committed prefix — the
roll-back to the accepted prefix is the next block's sync. A replica that resumes the session replays the
committed output of the turn (the spec travels with the record).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec_runtime.common.errors import InvalidRequestError
from specdec_runtime.common.grammar import CompiledGrammar, GrammarMatcher, GrammarSpec, compile_grammar, grammar_tokenizer
from specdec_runtime.common.types import DraftBlock

__all__ = ["SessionGrammar", "register_target", "check_grammar", "session_grammar", "mask_row_logits",
           "apply_session_grammar"]

# model id → (the target's tokenizer, its EOS ids): set by each Verifier for the model it serves, read by the verify
# step (a session names its model in its record; the tokenizer is the target's, whichever replica resumes it)
_TARGETS: dict[str, tuple[object, frozenset[int]]] = {}


def register_target(model_id: str, tokenizer, eos_token_ids) -> None:
    """Make ``model_id``'s tokenizer and EOS ids known to the sessions' grammars (Verifier construction)."""
    if tokenizer is not None:
        _TARGETS[model_id] = (tokenizer, frozenset(int(t) for t in eos_token_ids))


def _target(model_id: str) -> tuple[object, frozenset[int]]:
    try:
        return _TARGETS[model_id]
    except KeyError:
        raise InvalidRequestError(f"structured output needs the tokenizer of {model_id!r}, not loaded") from None


@dataclass
class SessionGrammar:
    """A session's grammar on this replica: the spec (JSON, as the record keeps it), its compiled form and the
    matcher over the turn's output (committed ids from ``start``, the turn's prompt length)."""

    spec_json: str
    compiled: CompiledGrammar
    matcher: GrammarMatcher
    start: int


def compile_spec(spec_json: str, tokenizer, eos_token_ids) -> CompiledGrammar:
    """The compiled grammar of ``spec_json`` (:meth:`GrammarSpec.to_json` text) for the target's tokenizer.

    Raises:
        InvalidRequestError: a malformed spec, or one the engine refuses (its message: a bad schema, regex or
            grammar, or one over the compile budget) — INVALID_ARGUMENT on the wire, 400 at edge-serve.
    """
    try:
        spec = GrammarSpec.from_json(spec_json)
        return compile_grammar(spec, grammar_tokenizer(tokenizer, sorted(eos_token_ids)))
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None


def check_grammar(spec_json: str, model_id: str, stopping) -> None:
    """OpenSession/ExtendSession validation of a grammar spec ("" = none) for the model ``model_id`` serves
    (:func:`register_target`), with the EOS ids the turn's ``stopping`` gives it (as the verify step does).
    Raises InvalidRequestError: the engine's message."""
    if spec_json:
        tokenizer, eos = _target(model_id)
        stop_ids = (frozenset() if stopping.ignore_eos else eos) | frozenset(int(t) for t in stopping.stop_token_ids)
        compile_spec(spec_json, tokenizer, stop_ids or eos)


def session_grammar(current: SessionGrammar | None, spec_json: str, start: int, tokenizer,
                    eos_token_ids) -> SessionGrammar | None:
    """The session's grammar for the record's spec and turn start: ``current`` when it is that one, else a new
    matcher (None when the record has no grammar). Raises InvalidRequestError (see :func:`compile_spec`)."""
    if not spec_json:
        return None
    if current is not None and current.spec_json == spec_json and current.start == start:
        return current
    compiled = compile_spec(spec_json, tokenizer, eos_token_ids)
    return SessionGrammar(spec_json, compiled, compiled.matcher(), start)


def apply_session_grammar(session, block: DraftBlock, logits: torch.Tensor) -> torch.Tensor:
    """A verify row's logits masked by its session's grammar (``record.sampling.grammar``; built on the session
    on first use, replayed over the turn's committed output): :func:`mask_row_logits`. Returned as given when the
    session has none. The EOS ids the grammar allows at its end: the turn's stop ids (EOS unless ignore_eos, and
    stop_token_ids), else the model's EOS."""
    record = session.record
    spec = record.sampling.grammar
    if not spec:
        session.grammar = None
        return logits
    tokenizer, eos = _target(record.model_id)
    stop_ids = getattr(session.stop, "stop_token_ids", None) or eos
    session.grammar = session_grammar(session.grammar, spec, record.prompt_length, tokenizer, stop_ids or eos)
    return mask_row_logits(session.grammar, record.committed_token_ids, block, logits)


def mask_row_logits(grammar: SessionGrammar, committed_token_ids: list[int], block: DraftBlock,
                    logits: torch.Tensor) -> torch.Tensor:
    """``logits`` [block.num_scored_positions, vocab_size] with the ids the grammar forbids at each position set
    to −inf, in place; row i's mask is the grammar's state after the committed output + the block's first i draft
    ids (rows after a forbidden draft id: unmasked, never used by the verdict).

    Raises:
        InvalidRequestError: the committed output does not match the grammar (a record whose spec changed
            under it: nothing of the block is verified).
    """
    m = grammar.matcher
    try:
        m.sync(committed_token_ids[grammar.start:])
    except ValueError as e:
        raise InvalidRequestError(f"the committed output does not match the session's grammar: {e}") from None
    rows, width = int(logits.shape[0]), int(logits.shape[-1])
    masks = m.block_masks(block.draft_token_ids[:max(0, rows - 1)] if rows else [], width)[:rows]  # [rows, width]
    allowed = torch.from_numpy(np.ascontiguousarray(masks)).to(logits.device)
    return logits.masked_fill_(~allowed, float("-inf"))
