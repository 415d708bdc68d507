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


@dataclass(frozen=True)
class SamplingParams:
    """Logits processing applied identically to draft_probs and target_probs.

    temperature: 0 = greedy (argmax); > 0 = softmax(logits / temperature).
    top_k: keep the k most likely tokens (0 = off). top_p: nucleus mass (1.0 = off).
    seed: key of the counter-based random stream (common.sampling.uniform); None = unseeded.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> None:
        """Raise ValueError on parameters that define no distribution."""
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")


@dataclass(frozen=True)
class StoppingCriteria:
    """When generation stops; applied to committed tokens only (earliest stop in a block wins)."""

    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
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
    next_token_id: recovered token (after a rejection) or bonus token (after a full block); -1 when a stop
        inside the accepted prefix ended the session before it, or when a bonus_drafted block was accepted
        whole (it has no bonus token: its last draft token took that position).
    committed_token_ids: tokens this verdict commits (accepted prefix + next token, cut at the earliest stop).
    committed_length: prompt + output tokens committed after this verdict.
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

    @classmethod
    def of(cls, info: ServedInfo, session_id: str, committed_length: int, seed: int) -> "SessionOpened":
        return cls(**dataclasses.asdict(info), session_id=session_id, committed_length=committed_length, seed=seed)
