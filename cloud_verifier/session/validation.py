"""Validation of what edges send: the OpenSession request and each draft block.

Plain functions, called before anything changes: a request or block that fails a check raises (one-line
message) and nothing is reserved or committed for it. :func:`validate_block` runs the block checks in this
order (the first failing one raises):

1. the session can take a block: not finished, no other block of it in flight;
2. the block extends the session's committed length and its ``seq`` is the last one + 1;
3. its length is at most ``max_num_speculative_tokens`` (a ``bonus_drafted`` block: 1 to
   ``max_num_speculative_tokens + 1``, the same positions scored) and fits the session's KV capacity;
4. its token ids are in the vocabulary;
5. its ``draft_probs`` (top-k drafting) have one sparse distribution q per draft token, are distributions, and
   each draft token is in the support of its q (the rejection rule divides by q(x)).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from specdec_runtime.common.errors import ContextLengthError, InvalidRequestError, PreconditionError
from specdec_runtime.common.sampling import normalize_sparse
from specdec_runtime.common.types import DraftBlock, SamplingParams, ServedInfo, StoppingCriteria
from specdec_runtime.common.wire import check_draft_probs_shape

if TYPE_CHECKING:
    from specdec_runtime.cloud_verifier.session.state import Session

PROB_SUM_TOLERANCE = 1e-3  # |sum(q) - 1| allowed for a sparse draft distribution on the wire
# smallest positive temperature: below it logits / temperature can overflow float64 (no distribution); 0 = greedy
MIN_TEMPERATURE = 1e-30


def check_token_ids(ids: list[int], what: str, valid_vocab_size: int) -> None:
    """Every id must be in [0, valid_vocab_size) (padded logit columns are not tokens).

    Raises:
        InvalidRequestError: a token id outside the vocabulary (``what`` names the list in the message).
    """
    if ids and (min(ids) < 0 or max(ids) >= valid_vocab_size):
        bad = next(t for t in ids if t < 0 or t >= valid_vocab_size)
        raise InvalidRequestError(f"{what} token id {bad} is outside the vocabulary [0, {valid_vocab_size})")


def check_open_request(
    prompt: list[int],
    sampling: SamplingParams,
    stopping: StoppingCriteria,
    tokenizer_fingerprint: str,
    info: ServedInfo,
    valid_vocab_size: int,
    num_output_tokens: int = 0,
) -> None:
    """Check an OpenSession request (``prompt``: token ids; ``tokenizer_fingerprint``: "" = not checked;
    ``num_output_tokens``: the last prompt ids that are output already generated).

    Raises:
        InvalidRequestError: empty prompt; prompt token id outside the vocabulary; bad sampling or stopping
            parameters (a positive temperature below :data:`MIN_TEMPERATURE` included); prompt of
            ``info.max_context_tokens`` tokens or more (no room to generate); num_output_tokens < 0, not below the
            prompt's length or not below max_new_tokens.
        PreconditionError: the tokenizer fingerprint differs from the target's.
    """
    if not prompt:
        raise InvalidRequestError("empty prompt: at least one token id is needed")
    check_token_ids(prompt, "prompt", valid_vocab_size)
    check_generation_params(sampling, stopping, valid_vocab_size)
    if not 0 <= num_output_tokens < len(prompt) or (num_output_tokens and num_output_tokens >= stopping.max_new_tokens):
        raise InvalidRequestError(
            f"num_output_tokens must be in [0, {min(len(prompt), stopping.max_new_tokens)}) (below the prompt's "
            f"{len(prompt)} ids and max_new_tokens {stopping.max_new_tokens}), got {num_output_tokens}")
    if tokenizer_fingerprint and info.tokenizer_fingerprint and tokenizer_fingerprint != info.tokenizer_fingerprint:
        raise PreconditionError(
            f"tokenizer fingerprint {tokenizer_fingerprint} does not match the target's "
            f"{info.tokenizer_fingerprint} ({info.model_id}): draft and target must share a vocabulary"
        )
    max_ctx = info.max_context_tokens
    if len(prompt) >= max_ctx:
        raise InvalidRequestError(f"prompt of {len(prompt)} tokens leaves no room in the context of {max_ctx} tokens")


def check_generation_params(sampling: SamplingParams, stopping: StoppingCriteria,
                            valid_vocab_size: int | None = None) -> None:
    """Check a session's sampling and stopping parameters (OpenSession and ExtendSession); nothing is opened or
    changed when they fail (INVALID_ARGUMENT, the message names the field).

    Raises:
        InvalidRequestError: a parameter out of range (SamplingParams/StoppingCriteria.validate: penalties,
            logit_bias values and ids below ``valid_vocab_size``, min_tokens, min_p, top_logprobs included), or a
            positive temperature below :data:`MIN_TEMPERATURE` (use 0 for greedy).
    """
    try:
        sampling.validate(valid_vocab_size)
        stopping.validate()
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    if 0 < sampling.temperature < MIN_TEMPERATURE:
        raise InvalidRequestError(
            f"temperature {sampling.temperature:g} is below {MIN_TEMPERATURE:g}: use 0 for greedy"
        )


def check_extend_request(
    committed_length: int,
    appended: list[int],
    sampling: SamplingParams,
    stopping: StoppingCriteria,
    info: ServedInfo,
    valid_vocab_size: int,
) -> None:
    """Check an ExtendSession request against the session's ``committed_length`` (tokens) before anything
    changes (``appended``: the token ids to append).

    Raises:
        InvalidRequestError: no appended tokens; an id outside the vocabulary; bad sampling or stopping
            parameters (a positive temperature below :data:`MIN_TEMPERATURE` included).
        ContextLengthError: ``committed_length + len(appended)`` reaches ``info.max_context_tokens`` (OUT_OF_RANGE:
            no room to generate).
    """
    if not appended:
        raise InvalidRequestError("appended_token_ids is empty: at least one token id is needed")
    check_token_ids(appended, "appended", valid_vocab_size)
    check_generation_params(sampling, stopping, valid_vocab_size)
    total = committed_length + len(appended)
    if total >= info.max_context_tokens:
        raise ContextLengthError(
            f"conversation of {total} tokens ({committed_length} committed + {len(appended)} appended) leaves no room "
            f"in the context of {info.max_context_tokens} tokens"
        )


def validate_block(
    session: Session, seq: int, committed_length: int, block: DraftBlock, info: ServedInfo, valid_vocab_size: int
) -> None:
    """All checks of one draft block of ``session`` (see the module docstring for the order).

    ``committed_length``: the length (tokens) the block extends; ``info``: the verifier's limits
    (``max_num_speculative_tokens``, ``vocab_size``). Called under the session table's lock.

    Raises:
        PreconditionError: the session already finished.
        InvalidRequestError: any other failed check (nothing committed changes).
    """
    check_session_ready(session)
    check_block_position(session, seq, committed_length)
    check_block_length(len(block.draft_token_ids), committed_length, session.kv.capacity,
                       info.max_num_speculative_tokens, bonus_drafted=block.bonus_drafted)
    check_token_ids(block.draft_token_ids, "draft", valid_vocab_size)
    if block.draft_probs is not None:
        check_draft_probs(block, info.vocab_size)


def check_session_ready(session: Session) -> None:
    """The session takes a block now: it has not finished and has no block queued or in a forward pass.

    Raises:
        PreconditionError: the session already finished.
        InvalidRequestError: another block of the session is in flight.
    """
    r = session.record
    if r.finished or session.stop.finished:
        reason = r.finish_reason or session.stop.finish_reason
        raise PreconditionError(f"session {r.session_id} already finished ({reason.value})")
    if session.busy:
        raise InvalidRequestError(f"session {r.session_id} already has a block in flight")


def check_block_position(session: Session, seq: int, committed_length: int) -> None:
    """The block extends the session's committed length (tokens) and its ``seq`` is the last committed block's
    plus one (the proto: "Must increase by one per block"). ``last_seq`` is part of the session's record in the
    store, so the rule holds across replicas: a block retried on another replica after a failure (same seq) is
    accepted there when the failed replica had not committed it, and refused (then reconciled by the edge from
    GetSession) when it had.

    Raises:
        InvalidRequestError: committed length differs (stale or duplicate block); seq is not the last one + 1
            (a repeated, older or skipped seq).
    """
    r = session.record
    if committed_length != r.committed_length:
        raise InvalidRequestError(
            f"block extends committed length {committed_length}, but session {r.session_id} has {r.committed_length}"
        )
    if seq != r.last_seq + 1:
        raise InvalidRequestError(
            f"block seq {seq} is not the last seq {r.last_seq} + 1 (seq increases by one per block)"
        )


def check_block_length(num_draft_tokens: int, committed_length: int, capacity: int,
                       max_num_speculative_tokens: int, bonus_drafted: bool = False) -> None:
    """A block of ``num_draft_tokens`` tokens (γ, or γ + 1 for a bonus_drafted block) is at most
    ``max_num_speculative_tokens`` long and fits the session's KV ``capacity`` (tokens: prompt + max_new_tokens,
    capped by the context) after ``committed_length`` tokens.

    A ``bonus_drafted`` block (its last token drafted for the bonus position, common.rejection) holds 1 to
    ``max_num_speculative_tokens + 1`` tokens: the target scores ``num_draft_tokens`` positions, as many as for a
    classic block of ``num_draft_tokens - 1``, and that is the length checked against the capacity.

    Raises:
        InvalidRequestError: block too long; an empty bonus_drafted block; past the session's limit.
    """
    if bonus_drafted:
        if num_draft_tokens < 1:
            raise InvalidRequestError("a bonus_drafted block needs at least one draft token")
        if num_draft_tokens > max_num_speculative_tokens + 1:
            raise InvalidRequestError(f"bonus_drafted block of {num_draft_tokens} tokens is longer than the maximum "
                                      f"{max_num_speculative_tokens} + 1")
    elif num_draft_tokens > max_num_speculative_tokens:
        raise InvalidRequestError(
            f"block of {num_draft_tokens} tokens is longer than the maximum {max_num_speculative_tokens}")
    # positions past the committed length the block's forward pass writes
    reach = DraftBlock([0] * num_draft_tokens, bonus_drafted=bonus_drafted).num_scored_positions - 1
    if committed_length + reach > capacity:
        raise InvalidRequestError(
            f"block of {num_draft_tokens} tokens at committed length {committed_length} passes the session's limit of "
            f"{capacity} tokens (max_new_tokens / context)"
        )


def check_draft_probs(block: DraftBlock, vocab_size: int) -> None:
    """``block.draft_probs`` (sparse: token_ids and probs, both [γ, k]) are the distributions q the draft
    sampled from: one row per draft token, ids in [0, vocab_size), no id twice in a row, probabilities finite,
    ≥ 0 and summing to 1 (± ``PROB_SUM_TOLERANCE``), and q(x_i) > 0 for each draft token x_i.

    Raises:
        InvalidRequestError: wrong shape (:func:`common.wire.check_draft_probs_shape`); id outside the
            vocabulary; not a distribution; a repeated id; a draft token with draft probability 0.
    """
    dp = block.draft_probs
    ids, probs = np.asarray(dp.token_ids), np.asarray(dp.probs, dtype=np.float64)
    check_draft_probs_shape(ids, probs, len(block.draft_token_ids))
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise InvalidRequestError("draft_probs token id outside the vocabulary")
    if not np.all(np.isfinite(probs)) or (probs < 0).any():
        raise InvalidRequestError("draft_probs are not a distribution: negative or non-finite values")
    sums = probs.sum(axis=-1)
    if np.any(np.abs(sums - 1.0) > PROB_SUM_TOLERANCE):
        raise InvalidRequestError(f"draft_probs are not a distribution: rows sum to {sums.round(4).tolist()}")
    for i, x in enumerate(block.draft_token_ids):
        row = ids[i]
        if len(np.unique(row)) != len(row):
            raise InvalidRequestError(f"draft_probs row {i} repeats a token id")
        q_x = normalize_sparse(probs[i])[row == x]
        if q_x.size == 0 or not q_x[0] > 0:
            raise InvalidRequestError(f"draft token {x} at block position {i} has draft probability 0")
