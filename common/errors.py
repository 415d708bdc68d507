"""Errors of specdec, each mapped to one gRPC status code (cloud_verifier.server maps them; the edge client
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


class SessionNotFoundError(SpecdecError, KeyError):
    """Unknown, closed or expired session."""

    code = grpc.StatusCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "session not found"


class PreconditionError(SpecdecError):
    """The request cannot apply in the current state: tokenizer fingerprint mismatch, block for a finished
    session."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class CapacityError(SpecdecError):
    """No room for the session: KV-cache budget or session limit reached."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class VerifierUnavailableError(SpecdecError):
    """The verifier cannot be reached or is shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineError(SpecdecError, TimeoutError):
    """A call did not finish within its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


_BY_CODE = {
    cls.code: cls
    for cls in (InvalidRequestError, SessionNotFoundError, PreconditionError, CapacityError,
                VerifierUnavailableError, DeadlineError)
}


def error_for_status(code: grpc.StatusCode, message: str) -> SpecdecError:
    """The specdec exception for a gRPC status code (INTERNAL and unknown codes give SpecdecError)."""
    cls = _BY_CODE.get(code, SpecdecError)
    return cls(message)
