"""Plain data types shared by the edge client and the cloud verifier.

Shapes use γ = num_speculative_tokens (draft tokens in one block) and k = top-k of top-k drafting.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import numpy as np


class FinishReason(str, enum.Enum):
    """Why a session stopped (same values as specdec.v1.FinishReason, lower-case)."""

    EOS = "eos"  # an EOS or stop token id was committed
    STOP_STRING = "stop_string"  # a stop string appeared in the generated text
    LENGTH = "length"  # max_new_tokens reached
    CONTEXT = "context"  # the target's context length reached


# A token-id slot that holds no token: a verdict's next_token_id when there is none, the padding of id arrays
# (draft top-k ids, candidate ids), a draft token where the block drafted none (its bonus position). The wire
# carries the same value (verifier.proto, Verdict.next_token_id).
NO_TOKEN = -1
MAX_TOP_LOGPROBS = 20  # most alternatives one committed token's logprobs may list (OpenAI's limit)
MAX_GRAMMAR_CHARS = 262_144  # a grammar spec as JSON, characters (its compiled size is bounded by the engine)
# The longest context of the models one would pair (128k tokens): a generation stops at the target's context
# anyway, so a longer max_new_tokens is a typo, refused rather than silently cut (and it must fit the wire's int32).
MAX_NEW_TOKENS = 131_072
# γ any verifier may be configured to accept at most (VerifierSettings.max_num_speculative_tokens, default 16);
# past a few dozen the acceptance of a whole block is ~0 and the block only costs draft and verify time.
MAX_NUM_SPECULATIVE_TOKENS = 64
# Token ids and counts travel as int32 (the wire's fields) and sit in the session store as little-endian int32.
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def check_int32(values, what: str) -> None:
    """Raises InvalidRequestError (INVALID_ARGUMENT; a ValueError) naming ``what`` at the first of ``values`` that
    does not fit in int32: the one check of the wire's and the session store's token ids."""
    for v in values:
        if not INT32_MIN <= int(v) <= INT32_MAX:
            from specdec_runtime.common.errors import InvalidRequestError  # here: types itself stays free of grpc

            raise InvalidRequestError(f"{what} {v} does not fit in int32")


@dataclass(frozen=True)
class SamplingParams:
    """Logits processing applied identically to draft_probs and target_probs, at every block position with
    that position's own history (:mod:`common.logits_processors` gives the order and the sources).

    temperature: 0 = greedy (argmax of the processed logits); > 0 = softmax(logits / temperature).
    top_k: keep the k most likely tokens (0 = off). top_p: nucleus mass in [0, 1] (1.0 = off; 0 = only the most
        likely token, HF's boundary rule taken to its limit, and what OpenAI clients mean by 0).
    seed: key of the counter-based random stream (common.sampling.uniform); None = unseeded.
    repetition_penalty: HF semantics over prompt + output ids, > 0 (1.0 = off).
    presence_penalty, frequency_penalty: OpenAI semantics over the turn's output ids (as vLLM), in [-2, 2]
        (0 = off).
    logit_bias: (token id, bias) pairs, bias in [-100, 100], sorted by id (a dict is accepted and normalised).
    min_tokens: EOS and stop token ids masked until that many tokens of the turn are generated (0 = off).
    min_p: drop tokens below min_p x the top probability, in [0, 1] (0 = off).
    logprobs: report each committed token's log-probability (raw log-softmax of the target);
        top_logprobs: that many alternatives too (0..MAX_TOP_LOGPROBS; needs logprobs).
    grammar: structured output, a :class:`common.grammar.GrammarSpec` as JSON ("" = none): the ids it forbids get
        -inf at every position before everything above (both sides; the turn's output must match it).
    drafter_invariant: sampled sessions: the drafter-invariant rule of :mod:`common.rejection` (the token at
        every position is target-only sampling's draw, whatever was drafted, so a seeded session's tokens do not
        depend on the draft, the route or its switch points); False: Algorithm 1 (more accepted tokens); None:
        the edge's route decides (on for seeded sampled ``auto`` and ``cloud-first`` generations, whose switch
        points timing decides), off on the verifier.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_p: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: str = ""
    drafter_invariant: bool | None = None

    def __post_init__(self) -> None:
        bias = self.logit_bias
        items = bias.items() if isinstance(bias, dict) else (bias or ())
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in items)))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def seeded(self, seed: int) -> "SamplingParams":
        """These parameters with ``seed`` (every other field kept)."""
        return dataclasses.replace(self, seed=int(seed))

    @property
    def has_history_processors(self) -> bool:
        """True when a processor depends on the token history (bias, penalties, min_tokens): they run per
        position before the history-free warpers."""
        return bool(self.logit_bias or self.repetition_penalty != 1.0 or self.presence_penalty
                    or self.frequency_penalty or self.min_tokens)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError, naming the field, on parameters that define no distribution or are out of range
        (``vocab_size``: logit_bias ids must be below it when given)."""
        _check(np.isfinite(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0",
               self.temperature)
        _check(self.top_k >= 0, "top_k", "must be >= 0 (0 = off)", self.top_k)
        _check(0.0 <= self.top_p <= 1.0, "top_p", "must be in [0, 1]", self.top_p)
        _check(self.seed is None or 0 <= self.seed < 2**64, "seed", "must be in [0, 2**64)", self.seed)
        _check(np.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               "must be > 0 (1 = off)", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(np.isfinite(value) and -2.0 <= value <= 2.0, name, "must be in [-2, 2]", value)
        for token_id, bias in self.logit_bias:
            _check(token_id >= 0 and (vocab_size is None or token_id < vocab_size), "logit_bias",
                   f"token id must be in [0, {vocab_size or 'vocab_size'})", token_id)
            _check(np.isfinite(bias) and -100.0 <= bias <= 100.0, "logit_bias", f"bias of token {token_id} must "
                   "be in [-100, 100]", bias)
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0", self.min_tokens)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        _check(0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]",
               self.top_logprobs)
        _check(self.logprobs or not self.top_logprobs, "top_logprobs", "needs logprobs", self.top_logprobs)
        _check(isinstance(self.grammar, str) and len(self.grammar) <= MAX_GRAMMAR_CHARS, "grammar",
               f"must be a grammar spec of at most {MAX_GRAMMAR_CHARS} characters", len(str(self.grammar)))


def _check(ok, name: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {value}")


@dataclass(frozen=True)
class StoppingCriteria:
    """When generation stops; applied to committed tokens only (earliest stop in a block wins)."""

    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raises ValueError: max_new_tokens outside [1, MAX_NEW_TOKENS], an empty stop string."""
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_new_tokens > MAX_NEW_TOKENS:
            raise ValueError(f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")


# k of top-k drafting (sampled sessions): q keeps the draft's k most likely tokens, and the wire carries k
# (id, probability) pairs per draft token.
DEFAULT_DRAFT_TOP_K = 8


@dataclass
class SparseDraftProbs:
    """Sparse draft distribution q of top-k drafting: the exact distribution the draft sampled from.

    token_ids: int64 [γ, k]; probs: float32 [γ, k], each row sums to 1 (common.sampling.normalize_sparse
    is applied on both sides before use, so float32 rounding on the wire changes nothing).
    """

    token_ids: np.ndarray  # [γ, k] int64
    probs: np.ndarray  # [γ, k] float32


@dataclass
class DraftBlock:
    """γ proposed token ids plus the draft probabilities needed to verify them.

    draft_probs None means greedy drafting: q is one-hot on each draft token.
    bonus_drafted: the last draft token was drafted for the bonus position (:mod:`common.rejection` explains
        the rule). Needs n >= 1; allows n <= max_num_speculative_tokens + 1.
    """

    draft_token_ids: list[int]  # [γ]
    draft_probs: SparseDraftProbs | None = None
    draft_ms: float = 0.0  # edge time spent drafting, ms
    bonus_drafted: bool = False
    num_forced_tokens: int = 0  # draft tokens a grammar forced (drafted without a draft forward pass; edge only)
    # [γ] the draft's probability of each drafted token (its confidence; greedy drafting too, where q is one-hot
    # for the rejection rule): what the verifier's adaptive verify length ranks positions by. None: not sent
    draft_confidence: list[float] | None = None
    # the target's features of the positions the verdict commits, asked for by a draft head
    # (common.features.FeatureRequest); None: not asked (nothing extra on the wire)
    features: object = None
    # the first position whose target features the client lacks (a draft head after a failover), asked with
    # ``features``: the verdict may carry the features a resume recomputed from there; None: not said
    features_from: int | None = None

    def __len__(self) -> int:
        return len(self.draft_token_ids)

    @property
    def scored_draft_token_ids(self) -> list[int]:
        """The draft tokens fed to the target after the last committed token: all of them, or all but the last
        of a bonus_drafted block (its last token stands at the position the last row scores)."""
        return self.draft_token_ids[:-1] if self.bonus_drafted else self.draft_token_ids

    @property
    def num_scored_positions(self) -> int:
        """Positions the target scores for the block (rows of its logits): γ + 1 for a classic block of γ draft
        tokens (the last row gives the bonus token), n for a bonus_drafted block of n draft tokens."""
        return len(self.scored_draft_token_ids) + 1

    @property
    def num_speculative_tokens(self) -> int:
        """Speculative positions the block fills (γ, as counted by acceptance metrics and adaptive γ): its
        draft tokens, less a bonus_drafted block's last one, which fills the bonus position."""
        return len(self.scored_draft_token_ids) if self.bonus_drafted else len(self.draft_token_ids)


@dataclass
class Verdict:
    """The verifier's answer to one draft block.

    num_accepted: accepted prefix length of the block (0..γ).
    next_token_id: recovered token (after a rejection) or bonus token (after a full block); NO_TOKEN (-1) when a stop
        inside the accepted prefix ended the session before it, or when a bonus_drafted block was accepted
        whole (it has no bonus token: its last draft token took that position).
    committed_token_ids: tokens this verdict commits (accepted prefix + next token, cut at the earliest stop).
    committed_length: prompt + output tokens committed after this verdict.
    num_verified_positions: None when the verifier judged the whole block; else m, 1 <= m <= len(block): it
        verified only the block's first m draft tokens (adaptive verification, docs/verification.md), as the
        bonus_drafted block of those m tokens (no bonus token), and the tokens after them were not judged (num_accepted <= m;
        all m accepted: next_token_id NO_TOKEN).
    """

    num_accepted: int
    next_token_id: int
    is_bonus: bool
    committed_token_ids: list[int]
    committed_length: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    queue_ms: float = 0.0
    forward_ms: float = 0.0
    batch_size: int = 1
    seq: int = 0
    # one per committed token when the session asked for logprobs (SamplingParams.logprobs), else None
    logprobs: list["TokenLogprobs"] | None = None
    num_verified_positions: int | None = None
    # common.features.FeatureBlock of the committed positions when the block asked for them, else None
    features: object = None


def check_verdict_counts(num_accepted: int, num_verified_positions: int | None, block_len: int) -> None:
    """Raises InvalidRequestError (a protocol error; a ValueError) unless a verdict's counts fit a block of
    ``block_len`` draft tokens: ``0 <= num_accepted <= block_len`` and, when the verifier verified a prefix only
    (``num_verified_positions`` not None), ``num_accepted <= num_verified_positions <= block_len``, at least 1.
    The one guard of the edge's reading of a verdict (the wire) and of its statistics."""
    from specdec_runtime.common.errors import InvalidRequestError  # here: types itself stays free of grpc

    if not 0 <= num_accepted <= block_len:
        raise InvalidRequestError(f"verdict accepts {num_accepted} tokens of a {block_len}-token block")
    verified = num_verified_positions
    if verified is not None and not (1 <= verified <= block_len and num_accepted <= verified):
        raise InvalidRequestError(f"verdict verifies {verified} positions of a {block_len}-token block and "
                                  f"accepts {num_accepted}")


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of one committed token under the target's raw distribution (log-softmax of its logits
    at that position, before logits processing: vLLM's default), float64.

    top_token_ids / top_logprobs: the ``top_logprobs`` most likely tokens, most likely first (ties: lower id).
    """

    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class ServedInfo:
    """What a verifier serves: its target and its limits (the server-wide fields of OpenSessionResponse)."""

    model_id: str
    tokenizer_fingerprint: str  # common.vocab.tokenizer_fingerprint of the target's tokenizer
    max_context_tokens: int  # tokens (prompt + output)
    max_num_speculative_tokens: int  # tokens: the largest draft block accepted
    vocab_size: int  # width of the target's logits
    verifier_id: str  # replica id
    ttl_s: int  # idle time after which a session is freed, s


@dataclass(frozen=True)
class SessionOpened(ServedInfo):
    """A verifier's answer to OpenSession (specdec.v1.OpenSessionResponse): :class:`ServedInfo` plus the session."""

    session_id: str = ""
    committed_length: int = 0  # tokens (= prompt length)
    seed: int = 0  # the seed the session draws with (requested, or picked by the verifier)
    load: float = 0.0  # load hint: unanswered batcher rows / max batch size at open (route choice)
    forward_ms: float = 0.0  # load hint: recent mean forward pass with verify rows, ms (0: none yet)
    features: object = None  # common.features.FeatureBlock of the prefilled prompt when asked, else None

    @classmethod
    def of(cls, info: ServedInfo, session_id: str, committed_length: int, seed: int,
           features: object = None) -> "SessionOpened":
        return cls(**dataclasses.asdict(info), session_id=session_id, committed_length=committed_length, seed=seed,
                   features=features)


@dataclass(frozen=True)
class OpenRequest:
    """An OpenSession request (specdec.v1.OpenSessionRequest) as both sides pass it whole: the edge's backends
    (``VerifierBackend.open_session``) and the verifier's servicer (``common.wire.open_request_from_proto``).

    Attributes:
        prompt_token_ids: the session's prompt, token ids (non-empty; a re-open: everything committed so far).
        sampling, stopping: the session's parameters.
        tokenizer_fingerprint: the edge tokenizer's fingerprint (``common.vocab``); "" = not sent (unchecked).
        num_output_tokens: how many of the last prompt ids are output already generated (a re-open after the
            verifier lost a session: it counts them for penalties, min_tokens and max_new_tokens); 0 = none.
        draft_name, draft_version: the delivered draft the session drafts with ("" = not said): the label of
            the verifier's per-version acceptance (cloud_verifier.drafts.ledger).
        features: a :class:`common.features.FeatureRequest` (the prompt's target features in the answer) or None.
    """

    prompt_token_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingCriteria
    tokenizer_fingerprint: str = ""
    num_output_tokens: int = 0
    draft_name: str = ""
    draft_version: str = ""
    features: object = None


@dataclass(frozen=True)
class ExtendRequest:
    """An ExtendSession request (specdec.v1.ExtendSessionRequest), passed whole like :class:`OpenRequest`.

    Attributes:
        session_id: the finished session to continue.
        committed_length: the committed length (tokens) the session must have (else ConflictError).
        appended_token_ids: the next turn's token ids, appended after them (prefilled on the verifier).
        sampling, stopping: the next turn's parameters; None = keep the session's.
        features: a :class:`common.features.FeatureRequest` (the features of the positions the turn's prefill
            feeds, in the answer) or None.
        features_from: with ``features``, the first position whose features the caller lacks (a failover: the
            answer may start there, :class:`DraftBlock`'s field) or None.
    """

    session_id: str
    committed_length: int
    appended_token_ids: list[int]
    sampling: SamplingParams | None = None
    stopping: StoppingCriteria | None = None
    features: object = None
    features_from: int | None = None
