"""Errors of specdec, each mapped to one gRPC status code (cloud_verifier.serving.server maps them; the edge client
maps status codes back). Messages are one line, fit for a CLI error."""

from __future__ import annotations

import grpc


class SpecdecError(Exception):
    """Base class. ``code`` is the gRPC status code the verifier answers with."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidRequestError(SpecdecError, ValueError):
    """Malformed request or draft block (wrong committed length, token id outside the vocabulary, block longer
    than max_num_speculative_tokens, draft probabilities that are not a distribution, bad parameters, empty prompt).
    Nothing committed changes."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class UnsupportedByDrafterError(InvalidRequestError):
    """The request needs something the edge's drafter cannot do (decoding alone for route=device or device
    fallback, a grammar or penalties while decoding alone, a fresh state for a seeded sampled generation):
    raised on the edge before anything is sent. ``capability`` names the missing one (the protocol's name in
    edge_client.drafting.contract). INVALID_ARGUMENT, as any request the client's setup cannot serve.
    ``head_on_device``: "route" or "fallback" when the drafter is a draft head that the device would need to
    decode alone there (a front end words its own remedy from it), else ""."""

    def __init__(self, message: str, capability: str = "", head_on_device: str = "") -> None:
        super().__init__(message)
        self.capability = capability
        self.head_on_device = head_on_device


class SessionNotFoundError(SpecdecError, KeyError):
    """Unknown, closed or expired session."""

    code = grpc.StatusCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "session not found"


class PreconditionError(SpecdecError):
    """The request cannot apply in the current state: tokenizer fingerprint mismatch, block for a finished
    session."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ConflictError(SpecdecError):
    """A compare-and-set failed: the session's committed length is not the one the request expected (ExtendSession
    after the session moved on, e.g. a retry whose first attempt was applied). Nothing changes; the caller re-reads
    the session (GetSession) before deciding. ABORTED, as gRPC's status guide prescribes for a failed test-and-set
    (FAILED_PRECONDITION is for states a retry cannot fix without the client changing something first)."""

    code = grpc.StatusCode.ABORTED


class ContextLengthError(InvalidRequestError):
    """The request would reach the target's context length (ExtendSession): OUT_OF_RANGE. Nothing changes."""

    code = grpc.StatusCode.OUT_OF_RANGE


class CapacityError(SpecdecError):
    """No room for the session: KV-cache budget or session limit reached."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class VerifierUnavailableError(SpecdecError):
    """The verifier cannot be reached or is shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


class StaleSessionError(VerifierUnavailableError):
    """This replica's copy of a session is stale: another replica holds it in the store, or it was given up
    (a drain, a store fail-over that lost the last claim). Nothing was committed and the copy is released, so the
    same block (same seq, same committed length) retried on any replica resumes the session from the store:
    UNAVAILABLE, the status a client retries."""


class DeadlineError(SpecdecError, TimeoutError):
    """A call did not finish within its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class RateLimitedError(CapacityError):
    """A tenant is over one of its limits (verified tokens per second, concurrent sessions): RESOURCE_EXHAUSTED,
    with a retry hint. ``retry_after_ms``: how long to wait before trying again, ms (the verifier sends it as the
    ``retry-after-ms`` trailing metadata and in the message)."""

    def __init__(self, message: str, retry_after_ms: int):
        super().__init__(message)
        self.retry_after_ms = int(retry_after_ms)

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """Trailing metadata of the status: ``(("retry-after-ms", "<ms>"),)``."""
        return ((RETRY_AFTER_MS_KEY, str(self.retry_after_ms)),)


class UnauthenticatedError(SpecdecError):
    """Missing or invalid credentials (API key). The verifier answers every such call with one generic
    message, whatever was wrong."""

    code = grpc.StatusCode.UNAUTHENTICATED


class TargetOutputError(SpecdecError):
    """The target model produced numbers that cannot be verified (NaN or +inf logits, a row with no finite
    logit): the block is refused (INTERNAL), nothing is committed, and the verifier rebuilds the session's KV
    cache before its next block. Not the client's fault; other sessions are not affected."""

    code = grpc.StatusCode.INTERNAL


class DraftNotFoundError(SpecdecError):
    """No such draft, version or file is offered to the caller (unknown, or restricted to other tenants: the same
    answer, so a tenant cannot learn which drafts others get), or no draft delivery is configured. NOT_FOUND."""

    code = grpc.StatusCode.NOT_FOUND


class DraftIntegrityError(SpecdecError):
    """A delivered draft file is not what its manifest says (size or SHA-256): the edge refuses it, deletes it and
    fetches it again. DATA_LOSS."""

    code = grpc.StatusCode.DATA_LOSS


RETRY_AFTER_MS_KEY = "retry-after-ms"  # trailing metadata of RESOURCE_EXHAUSTED statuses: suggested wait, ms


_BY_CODE = {
    cls.code: cls
    for cls in (InvalidRequestError, SessionNotFoundError, PreconditionError, CapacityError,
                VerifierUnavailableError, DeadlineError, UnauthenticatedError, ConflictError, ContextLengthError)
}


def error_for_status(code: grpc.StatusCode, message: str) -> SpecdecError:
    """The specdec exception for a gRPC status code (INTERNAL and unknown codes give SpecdecError)."""
    cls = _BY_CODE.get(code, SpecdecError)
    return cls(message)
