"""Errors of the endpoint: OpenAI's error JSON, and the HTTP status of each exception a generation can raise."""

from __future__ import annotations

import logging

from specdec_runtime.common.errors import (
    CapacityError,
    DeadlineError,
    InvalidRequestError,
    PreconditionError,
    RateLimitedError,
    SpecdecError,
    UnauthenticatedError,
    UnsupportedByDrafterError,
    VerifierUnavailableError,
)

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered in OpenAI's error JSON with HTTP ``status``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def api_error_for(e: BaseException) -> ApiError:
    """The HTTP error for an exception of a generation (see the module docstring for the mapping)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, UnsupportedByDrafterError) and e.head_on_device:
        # a head cannot decode alone, and the SDK's remedy in its message means nothing to an HTTP client
        return ApiError(400, "route 'device' needs a draft that decodes alone, and this endpoint drafts with a "
                        "draft head (it drafts from the verifier's features): ask for another route, or start "
                        "edge-serve with --device-draft, a draft that decodes alone (int8, distilled or an ONNX "
                        "draft directory), beside the head (or with such a --draft instead)", param="route")
    if isinstance(e, InvalidRequestError):
        return ApiError(400, str(e))
    if isinstance(e, RateLimitedError):
        seconds = max(1, -(-e.retry_after_ms // 1000))
        return ApiError(429, str(e), "rate_limit_exceeded", code="rate_limit_exceeded",
                        headers={"Retry-After": str(seconds)})
    if isinstance(e, CapacityError):
        return ApiError(429, str(e), "rate_limit_exceeded", code="capacity_exceeded")
    if isinstance(e, (VerifierUnavailableError, DeadlineError)):
        return ApiError(503, f"the verifier cannot be reached: {e}", "service_unavailable",
                        code="verifier_unavailable")
    if isinstance(e, (UnauthenticatedError, PreconditionError)):
        return ApiError(502, f"the verifier refused this endpoint: {e}", "bad_gateway", code="verifier_refused")
    if isinstance(e, SpecdecError):
        return ApiError(500, str(e) or type(e).__name__, "server_error")
    log.exception("generation failed", exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}", "server_error")
