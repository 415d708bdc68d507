"""Conversions between the wire messages (specdec.v1, protos/common/v1/verifier.proto) and common.types.

Used by both sides: the verifier's gRPC servicer (cloud_verifier.serving.servicer) and the edge's gRPC backend
(edge_client.transport.grpc_backend). Incoming requests convert to typed results (:class:`OpenRequest`,
:class:`ExtendRequest`, :class:`BlockRequest`). Structural problems of incoming messages (ragged top-k rows,
counts that do not match, ids outside int32) raise :class:`~common.errors.InvalidRequestError`; the shape of
``draft_probs`` has one check for every side, :func:`check_draft_probs_shape`; semantic checks (vocabulary,
block length, probabilities that are not a distribution) are the verifier's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specdec_runtime.common.errors import InvalidRequestError
from specdec_runtime.common.feature_wire import (
    feature_block_from_proto, feature_block_to_proto, feature_request_from_proto, feature_request_to_proto,
)
from specdec_runtime.common.types import (
    DraftBlock, ExtendRequest, FinishReason, OpenRequest, SamplingParams, SessionOpened, SparseDraftProbs,
    StoppingCriteria, TokenLogprobs, Verdict, check_int32, check_verdict_counts,
)
from specdec_runtime.common.v1 import verifier_pb2 as pb

# Largest gRPC message either side sends or accepts, bytes. The largest legitimate one is a top-k draft block:
# γ ≤ 16 rows × k ≤ vocab (49152 for SmolLM2) × ~10 bytes ≈ 8 MiB; prompts and session info are far smaller.
MAX_MESSAGE_BYTES = 32 * 1024 * 1024

# ---------------------------------------------------------------------------------------------- enums

FINISH_REASON_TO_PROTO: dict[FinishReason | None, int] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP_STRING: pb.FINISH_REASON_STOP_STRING,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CONTEXT: pb.FINISH_REASON_CONTEXT,
}
FINISH_REASON_FROM_PROTO: dict[int, FinishReason | None] = {v: k for k, v in FINISH_REASON_TO_PROTO.items()}


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    return FINISH_REASON_TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """None for FINISH_REASON_UNSPECIFIED (and for values this side does not know)."""
    return FINISH_REASON_FROM_PROTO.get(value)


# ---------------------------------------------------------------------------------------------- params


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """Every field; top_p is always sent (present), so 0 keeps its meaning (the most likely token only)."""
    msg = pb.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,  # None: unset
        has_seed=params.seed is not None,  # for peers that read has_seed only (the proto's comment)
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        min_tokens=params.min_tokens,
        min_p=params.min_p,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
        grammar=params.grammar,
    )
    if params.drafter_invariant is not None:  # unset: the verifier's default (off)
        msg.drafter_invariant = bool(params.drafter_invariant)
    for token_id, bias in params.logit_bias:
        msg.logit_bias[int(token_id)] = float(bias)
    return msg


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """The proto's one meaning per sentinel: top_p unset = 1.0 (off), present 0 = the most likely token only;
    repetition_penalty unset = 1.0 (off; a present 0 stays 0 and is refused by validation); seed unset gives
    None unless an older peer's has_seed says it is 0; every other field's proto3 default is its neutral
    value."""
    return SamplingParams(
        temperature=float(msg.temperature),
        top_k=int(msg.top_k),
        top_p=float(msg.top_p) if msg.HasField("top_p") else 1.0,
        seed=int(msg.seed) if msg.HasField("seed") or msg.has_seed else None,
        repetition_penalty=float(msg.repetition_penalty) if msg.HasField("repetition_penalty") else 1.0,
        presence_penalty=float(msg.presence_penalty),
        frequency_penalty=float(msg.frequency_penalty),
        logit_bias=dict(msg.logit_bias),
        min_tokens=int(msg.min_tokens),
        min_p=float(msg.min_p),
        logprobs=bool(msg.logprobs),
        top_logprobs=int(msg.top_logprobs),
        grammar=str(msg.grammar),
        drafter_invariant=bool(msg.drafter_invariant) if msg.HasField("drafter_invariant") else None,
    )


def stopping_to_proto(stopping: StoppingCriteria) -> pb.StoppingCriteria:
    return pb.StoppingCriteria(
        max_new_tokens=stopping.max_new_tokens,
        stop_token_ids=list(stopping.stop_token_ids),
        stop_strings=list(stopping.stop_strings),
        ignore_eos=stopping.ignore_eos,
    )


def stopping_from_proto(msg: pb.StoppingCriteria) -> StoppingCriteria:
    return StoppingCriteria(
        max_new_tokens=int(msg.max_new_tokens),
        stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
        stop_strings=tuple(msg.stop_strings),
        ignore_eos=bool(msg.ignore_eos),
    )


# ---------------------------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class BlockRequest:
    """A draft block as sent (:func:`block_from_proto`): its session, ``seq``, the committed length (tokens) it
    extends, and the block."""

    session_id: str
    seq: int
    committed_length: int
    block: DraftBlock


# ---------------------------------------------------------------------------------------------- sessions


def open_request_to_proto(
    prompt_token_ids: list[int],
    sampling: SamplingParams,
    stopping: StoppingCriteria,
    tokenizer_fingerprint: str = "",
    client_id: str = "",
    num_output_tokens: int = 0,
    draft_name: str = "",
    draft_version: str = "",
    features=None,
) -> pb.OpenSessionRequest:
    """``features``: a common.features.FeatureRequest, or None (the field stays unset)."""
    check_int32(prompt_token_ids, "prompt token id")
    check_int32([num_output_tokens], "num_output_tokens")
    msg = pb.OpenSessionRequest(
        prompt_token_ids=[int(t) for t in prompt_token_ids],
        sampling=sampling_to_proto(sampling),
        stopping=stopping_to_proto(stopping),
        tokenizer_fingerprint=tokenizer_fingerprint,
        client_id=client_id,
        num_output_tokens=int(num_output_tokens),
        draft_name=draft_name,
        draft_version=draft_version,
    )
    if features is not None:
        msg.features.CopyFrom(feature_request_to_proto(features))
    return msg


def open_request_from_proto(msg: pb.OpenSessionRequest) -> OpenRequest:
    """The request's fields; missing sampling/stopping messages give the defaults."""
    sampling = sampling_from_proto(msg.sampling) if msg.HasField("sampling") else SamplingParams()
    stopping = stopping_from_proto(msg.stopping) if msg.HasField("stopping") else StoppingCriteria()
    features = feature_request_from_proto(msg.features) if msg.HasField("features") else None
    return OpenRequest(list(msg.prompt_token_ids), sampling, stopping, msg.tokenizer_fingerprint,
                       msg.num_output_tokens, msg.draft_name, msg.draft_version, features)


def session_opened_to_proto(opened: SessionOpened) -> pb.OpenSessionResponse:
    fields = {f.name: getattr(opened, f.name) for f in dataclasses.fields(SessionOpened) if f.name != "features"}
    msg = pb.OpenSessionResponse(**fields)
    if opened.features is not None:
        msg.features.CopyFrom(feature_block_to_proto(opened.features))
    return msg


def session_opened_from_proto(msg: pb.OpenSessionResponse) -> SessionOpened:
    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(SessionOpened) if f.name != "features"}
    features = feature_block_from_proto(msg.features) if msg.HasField("features") else None
    return SessionOpened(**fields, features=features)


def extend_request_to_proto(
    session_id: str,
    committed_length: int,
    appended_token_ids: list[int],
    sampling: SamplingParams | None = None,
    stopping: StoppingCriteria | None = None,
    features=None,
    features_from: int | None = None,
) -> pb.ExtendSessionRequest:
    """ExtendSession request; ``sampling``/``stopping`` None are left unset (the session's are kept), and so are
    ``features`` (a common.features.FeatureRequest) and ``features_from`` (a position) when None."""
    check_int32(appended_token_ids, "appended token id")
    msg = pb.ExtendSessionRequest(session_id=session_id, committed_length=int(committed_length),
                                  appended_token_ids=[int(t) for t in appended_token_ids])
    if sampling is not None:
        msg.sampling.CopyFrom(sampling_to_proto(sampling))
    if stopping is not None:
        msg.stopping.CopyFrom(stopping_to_proto(stopping))
    if features is not None:
        msg.features.CopyFrom(feature_request_to_proto(features))
    if features_from is not None:
        msg.features_from = int(features_from)
    return msg


def extend_request_from_proto(msg: pb.ExtendSessionRequest) -> ExtendRequest:
    """The request's fields; an unset sampling/stopping message gives None."""
    sampling = sampling_from_proto(msg.sampling) if msg.HasField("sampling") else None
    stopping = stopping_from_proto(msg.stopping) if msg.HasField("stopping") else None
    features = feature_request_from_proto(msg.features) if msg.HasField("features") else None
    features_from = int(msg.features_from) if msg.HasField("features_from") else None
    return ExtendRequest(msg.session_id, int(msg.committed_length), list(msg.appended_token_ids), sampling, stopping,
                         features, features_from)


# ---------------------------------------------------------------------------------------------- blocks


def block_to_proto(session_id: str, seq: int, committed_length: int, block: DraftBlock) -> pb.DraftBlock:
    """The wire form of a draft block (draft_probs None = greedy drafting: no probabilities travel)."""
    msg = pb.DraftBlock(
        session_id=session_id,
        seq=int(seq),
        committed_length=int(committed_length),
        draft_token_ids=[int(t) for t in block.draft_token_ids],
        draft_ms=float(block.draft_ms),
        bonus_drafted=bool(block.bonus_drafted),
        draft_confidence=[float(c) for c in block.draft_confidence or ()],
    )
    if block.draft_probs is not None:
        ids = np.asarray(block.draft_probs.token_ids)
        probs = np.asarray(block.draft_probs.probs, dtype=np.float32)
        check_draft_probs_shape(ids, probs, len(block.draft_token_ids))
        msg.draft_probs.extend(
            pb.SparseDistribution(token_ids=row_ids.tolist(), probs=row_probs.tolist())
            for row_ids, row_probs in zip(ids, probs)
        )
    if block.features is not None:
        msg.features.CopyFrom(feature_request_to_proto(block.features))
    if block.features_from is not None:
        msg.features_from = int(block.features_from)
    return msg


def block_from_proto(msg: pb.DraftBlock) -> BlockRequest:
    """The draft block of a wire message, with its session, seq and committed length.

    Raises:
        InvalidRequestError: ``draft_probs`` of the wrong shape (:func:`check_draft_probs_shape`).
    """
    draft_ids = list(msg.draft_token_ids)
    draft_probs = None
    if len(msg.draft_probs):
        gamma = len(draft_ids)
        rows = msg.draft_probs
        k = check_draft_probs_shape([r.token_ids for r in rows], [r.probs for r in rows], gamma)
        ids = np.array([row.token_ids for row in rows], dtype=np.int64).reshape(gamma, k)
        probs = np.array([row.probs for row in rows], dtype=np.float32).reshape(gamma, k)
        draft_probs = SparseDraftProbs(token_ids=ids, probs=probs)
    confidence = None
    if len(msg.draft_confidence):
        confidence = [float(c) for c in msg.draft_confidence]
        if len(confidence) != len(draft_ids) or not all(0.0 <= c <= 1.0 for c in confidence):
            raise InvalidRequestError(f"draft_confidence must hold one value in [0, 1] per draft token "
                                      f"({len(draft_ids)}), got {len(confidence)}")
    features = feature_request_from_proto(msg.features) if msg.HasField("features") else None
    features_from = int(msg.features_from) if msg.HasField("features_from") else None
    block = DraftBlock(draft_token_ids=draft_ids, draft_probs=draft_probs, draft_ms=float(msg.draft_ms),
                       bonus_drafted=bool(msg.bonus_drafted), draft_confidence=confidence, features=features,
                       features_from=features_from)
    return BlockRequest(msg.session_id, int(msg.seq), int(msg.committed_length), block)


def check_draft_probs_shape(token_ids: np.ndarray | Sequence[Sequence], probs: np.ndarray | Sequence[Sequence],
                            num_draft_tokens: int) -> int:
    """Check that sparse draft probabilities are [γ, k]: one row (k token ids, k probabilities) per draft
    token, every row of one k >= 1. ``token_ids``, ``probs``: arrays [γ, k], or sequences of rows (a wire
    message's rows, which may be ragged); ``num_draft_tokens``: γ. Returns k (0 for no rows).

    The one shape check of ``draft_probs``: the edge before sending, the wire on receipt and the verifier's
    block validation (cloud_verifier.session.validation) all call it.

    Raises:
        InvalidRequestError: not two-dimensional, or not one row per draft token; a row whose token ids and
            probabilities differ in number; rows of different k, or k = 0.
    """
    id_lengths, prob_lengths = _row_lengths(token_ids), _row_lengths(probs)
    if id_lengths is None or prob_lengths is None or len(id_lengths) != num_draft_tokens \
            or len(prob_lengths) != num_draft_tokens:
        shape = np.shape(token_ids) if id_lengths is None else (len(id_lengths), *id_lengths[:1])
        raise InvalidRequestError(
            f"draft_probs must have one sparse distribution per draft token ({num_draft_tokens}), got shape "
            f"{tuple(shape)} (need one per token, or none for greedy drafting)"
        )
    k = id_lengths[0] if id_lengths else 0
    for i, (num_ids, num_probs) in enumerate(zip(id_lengths, prob_lengths)):
        if num_ids != num_probs:
            raise InvalidRequestError(f"draft_probs[{i}] has {num_ids} token ids and {num_probs} probs")
        if num_ids != k or k == 0:
            raise InvalidRequestError(f"draft_probs rows must share one k >= 1 (row 0 has {k}, row {i} "
                                      f"has {num_ids})")
    return k


def _row_lengths(rows: np.ndarray | Sequence[Sequence]) -> list[int] | None:
    """The length of each row; None for an array that is not two-dimensional."""
    if isinstance(rows, np.ndarray):
        return [rows.shape[1]] * rows.shape[0] if rows.ndim == 2 else None
    return [len(r) for r in rows]


# ---------------------------------------------------------------------------------------------- verdicts


def verdict_to_proto(verdict: Verdict, seq: int | None = None) -> pb.Verdict:
    """``seq``: the block's seq (defaults to ``verdict.seq``)."""
    msg = pb.Verdict(
        seq=int(verdict.seq if seq is None else seq),
        num_accepted=int(verdict.num_accepted),
        next_token_id=int(verdict.next_token_id),
        is_bonus=bool(verdict.is_bonus),
        committed_length=int(verdict.committed_length),
        finished=bool(verdict.finished),
        finish_reason=finish_reason_to_proto(verdict.finish_reason if verdict.finished else None),
        queue_ms=float(verdict.queue_ms),
        forward_ms=float(verdict.forward_ms),
        batch_size=int(verdict.batch_size),
        logprobs=logprobs_to_proto(verdict.logprobs),
        num_verified_positions=verdict.num_verified_positions,  # None: unset (the whole block)
    )
    if verdict.features is not None:
        msg.features.CopyFrom(feature_block_to_proto(verdict.features))
    return msg


def verdict_from_proto(msg: pb.Verdict, draft_token_ids: list[int], committed_length: int) -> Verdict:
    """Rebuild the verdict of a block sent with ``draft_token_ids`` at ``committed_length`` (tokens).

    committed_token_ids = accepted prefix + next token (when not -1: -1 after a stop inside the accepted
    prefix, or after a bonus_drafted block accepted whole), cut to the committed growth reported by the
    verifier (``msg.committed_length - committed_length``: the earliest stop wins).

    Raises:
        InvalidRequestError: a verdict inconsistent with its block (protocol error).
    """
    n = int(msg.num_accepted)
    verified = int(msg.num_verified_positions) if msg.HasField("num_verified_positions") else None
    check_verdict_counts(n, verified, len(draft_token_ids))
    tokens = [int(t) for t in draft_token_ids[:n]]
    if msg.next_token_id >= 0:
        tokens.append(int(msg.next_token_id))
    grown = int(msg.committed_length) - int(committed_length)
    if not (0 <= grown <= len(tokens)):
        raise InvalidRequestError(
            f"verdict committed length {msg.committed_length} inconsistent with block at {committed_length} "
            f"({len(tokens)} tokens accepted + next)"
        )
    return Verdict(
        num_accepted=n,
        next_token_id=int(msg.next_token_id),
        is_bonus=bool(msg.is_bonus),
        committed_token_ids=tokens[:grown],
        committed_length=int(msg.committed_length),
        finished=bool(msg.finished),
        finish_reason=finish_reason_from_proto(msg.finish_reason) if msg.finished else None,
        queue_ms=float(msg.queue_ms),
        forward_ms=float(msg.forward_ms),
        batch_size=int(msg.batch_size),
        seq=int(msg.seq),
        logprobs=logprobs_from_proto(msg.logprobs)[:grown] if msg.logprobs else None,
        num_verified_positions=verified,
        features=feature_block_from_proto(msg.features) if msg.HasField("features") else None,
    )


def logprobs_to_proto(logprobs) -> list[pb.TokenLogprobs]:
    """Wire ``TokenLogprobs`` of :class:`~common.types.TokenLogprobs` (None: [])."""
    return [pb.TokenLogprobs(logprob=lp.logprob, top_token_ids=list(lp.top_token_ids),
                             top_logprobs=list(lp.top_logprobs)) for lp in logprobs or ()]


def logprobs_from_proto(msgs) -> list[TokenLogprobs]:
    """:class:`~common.types.TokenLogprobs` of wire ``TokenLogprobs`` messages, in order."""
    return [TokenLogprobs(float(lp.logprob), tuple(int(t) for t in lp.top_token_ids),
                          tuple(float(x) for x in lp.top_logprobs)) for lp in msgs]


def session_logprobs(info: pb.SessionInfo, start: int, end: int) -> list[TokenLogprobs] | None:
    """The logprobs of committed positions [``start``, ``end``) of a GetSession answer (its ``output_logprobs``
    count from ``prompt_length``); None when it does not hold them all (the session did not ask for logprobs, or
    a verifier without the field answered)."""
    first, last = start - int(info.prompt_length), end - int(info.prompt_length)
    if first < 0 or last > len(info.output_logprobs) or last < first:
        return None
    return logprobs_from_proto(info.output_logprobs[first:last])
