"""The session store's contract: :class:`SessionRecord`, the abstract :class:`SessionStore`, and the errors and
checks both implementations share (the package's face, :mod:`cloud_verifier.store`, describes the semantics)."""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field

from specdec_runtime.common.errors import (
    ConflictError,
    InvalidRequestError,
    PreconditionError,
    SessionNotFoundError,
    StaleSessionError,
)
from specdec_runtime.common.types import FinishReason, SamplingParams, StoppingCriteria, TokenLogprobs, check_int32


@dataclass
class SessionRecord:
    """Metadata of one session (what the store keeps; the KV cache stays in the verifier)."""

    session_id: str
    verifier_id: str  # replica holding the session's KV cache
    model_id: str
    prompt_length: int  # tokens before the current turn's output: the prompt, or the conversation after ExtendSession
    committed_token_ids: list[int]  # prompt + committed output, tokens
    sampling: SamplingParams
    stopping: StoppingCriteria
    seed: int  # key of the session's counter-based random stream
    created_at: float  # unix time, s
    last_seen_at: float  # unix time, s
    finished: bool = False
    finish_reason: FinishReason | None = None
    last_seq: int = 0  # seq of the last committed block
    tenant_id: str = ""  # tenant that opened the session (its API key's); "" when authentication is off
    # the delivered draft it drafts with, "name@version" ("" = not said): its acceptance counts under that version
    # on whichever replica holds it (cloud_verifier.drafts.ledger)
    draft_label: str = ""
    # with sampling.logprobs: one per committed output token of the current turn (committed_token_ids from
    # prompt_length on), committed with them; empty otherwise. A client whose verdict was lost reads them here.
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def __post_init__(self) -> None:
        # the draws read sampling.seed: it is always the session's seed (the request's, or the one the verifier
        # picked and stored beside it)
        if self.sampling.seed != self.seed:
            self.sampling = self.sampling.seeded(self.seed)

    @property
    def committed_length(self) -> int:
        """Prompt + committed output, tokens."""
        return len(self.committed_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Committed output tokens (after the prompt)."""
        return self.committed_token_ids[self.prompt_length :]


class SessionStore(abc.ABC):
    """Where session metadata lives. All methods are thread-safe.

    ``ttl_s``: session time-to-live without activity, seconds.
    """

    ttl_s: float

    @abc.abstractmethod
    def create(self, record: SessionRecord) -> None:
        """Store a new session. Raises ValueError if the id exists."""

    @abc.abstractmethod
    def get(self, session_id: str) -> SessionRecord | None:
        """The session's record (a fresh copy), or None when unknown or expired."""

    @abc.abstractmethod
    def append_committed(
        self,
        session_id: str,
        expected_length: int,
        token_ids: list[int],
        seq: int,
        finished: bool,
        finish_reason: FinishReason | None,
        now: float,
        verifier_id: str | None = None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> int:
        """Atomic compare-and-append of committed tokens; returns the new committed length (tokens).

        ``logprobs``: one per token of ``token_ids`` when the session asked for logprobs (None: none), appended
        to the record's ``output_logprobs`` in the same atomic write as the tokens (they cannot diverge).

        Appends ``token_ids`` only if the stored committed length equals ``expected_length`` (tokens) and, when
        ``verifier_id`` is given, only if that replica still holds the session (a replica that lost it to a
        claim or gave it up cannot commit); records ``seq``, ``finished``/``finish_reason`` and ``now`` (unix s)
        as last-seen, and refreshes the TTL of all the session's keys. Idempotent: the same commit again (block
        ``seq``'s ``token_ids`` are already the stored tail after ``expected_length``: its first answer was lost)
        returns the committed length as the first call did and appends nothing.

        Raises:
            SessionNotFoundError: the session is unknown or expired.
            InvalidRequestError: the stored length differs (a stale or duplicate block); nothing changes.
            StaleSessionError: the session is held by another replica than ``verifier_id``, or by none (given
                up); nothing changes.
            PreconditionError: the session already finished; nothing changes.
        """

    @abc.abstractmethod
    def extend(
        self,
        session_id: str,
        expected_length: int,
        token_ids: list[int],
        sampling: SamplingParams,
        stopping: StoppingCriteria,
        now: float,
        verifier_id: str,
    ) -> int:
        """Atomic compare-and-append of a conversation's next turn (ExtendSession); returns the new committed
        length (tokens).

        Only if the stored committed length equals ``expected_length`` (tokens), replica ``verifier_id`` holds
        the session, and the session is finished or has no output in its current turn (committed length =
        ``prompt_length``): appends ``token_ids``, makes the new committed length the ``prompt_length`` (the new
        turn's output starts there), replaces ``sampling``, ``stopping`` and the seed (``sampling.seed``, set: the
        verifier fills it before the store sees a turn), clears the finish state
        and the output logprobs, keeps ``last_seq`` (block seqs go on), records ``now`` (unix s) as last-seen
        and refreshes the TTL.

        Raises:
            SessionNotFoundError: the session is unknown or expired.
            ConflictError: the stored length differs (ABORTED); nothing changes.
            PreconditionError: the session is generating (not finished, output committed); nothing changes.
            StaleSessionError: another replica holds the session, or none does; nothing changes.
        """

    @abc.abstractmethod
    def touch(self, session_id: str, now: float) -> bool:
        """Mark activity at ``now`` (unix s) and refresh the TTL; False when the session is gone."""

    @abc.abstractmethod
    def delete(self, session_id: str, verifier_id: str | None = None) -> bool:
        """Remove the session; True if it existed. With ``verifier_id``: only if that replica holds it (a
        reaper must not delete a session another replica has claimed meanwhile)."""

    @abc.abstractmethod
    def claim(self, session_id: str, verifier_id: str, now: float) -> bool:
        """Make ``verifier_id`` the holder of the session (resume on another replica), atomically moving it
        between the replicas' session sets; refreshes the TTL. False when the session is gone."""

    @abc.abstractmethod
    def disown(self, session_id: str, verifier_id: str) -> bool:
        """Give the session up (graceful shutdown of replica ``verifier_id``): it stays in the store, held by no
        replica (``verifier_id`` ""), so the next block, on any replica, resumes it there. Only if
        ``verifier_id`` holds it; True when given up."""

    @abc.abstractmethod
    def session_ids_of(self, verifier_id: str) -> list[str]:
        """Ids of the live sessions held by replica ``verifier_id`` (load counting, routing, draining)."""

    @abc.abstractmethod
    def ping(self) -> bool:
        """True when the store answers."""

    def close(self) -> None:
        """Release connections."""


# ---- shared by the implementations: token range check, record copies, the errors of a refused write


def check_tokens(token_ids: list[int]) -> None:
    """Raises InvalidRequestError when a token id does not fit in int32 (the stored format)."""
    check_int32(token_ids, "token id")


def copy_record(record: SessionRecord) -> SessionRecord:
    """A copy that shares no mutable list with ``record``."""
    return dataclasses.replace(record, committed_token_ids=list(record.committed_token_ids),
                               output_logprobs=list(record.output_logprobs))


def not_owner(session_id: str, verifier_id: str) -> StaleSessionError:
    return StaleSessionError(
        f"session {session_id!r} is no longer held by replica {verifier_id!r} (resumed elsewhere or given up): "
        "stale copy, nothing committed"
    )


def length_mismatch(session_id: str, expected: int, actual: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"committed length {expected} does not match session {session_id!r} (committed length {actual}): "
        "stale or duplicate block"
    )


def extend_conflict(session_id: str, expected: int, actual: int) -> ConflictError:
    return ConflictError(
        f"committed length {expected} does not match session {session_id!r} (committed length {actual}): "
        "nothing appended; re-read the session (GetSession)"
    )


def generating_error(session_id: str) -> PreconditionError:
    return PreconditionError(f"session {session_id!r} is generating: only a finished (or not started) session "
                             "can be extended")


def finished_error(session_id: str) -> PreconditionError:
    return PreconditionError(f"session {session_id!r} is finished")


def not_found(session_id: str) -> SessionNotFoundError:
    return SessionNotFoundError(f"unknown or expired session {session_id!r}")
