"""Errors in OpenAI's shape, and the runtime's error codes mapped to HTTP statuses (never from
message text)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from radixrt.client.transport import FrameTooLargeError, RemoteError
from radixrt.protocol import ErrorCode

RUNTIME_EXCEPTIONS = (RemoteError, ValueError, ConnectionError)
# (HTTP status, OpenAI error type) -> the runtime's error codes answered with it; statuses are
# never decided from message text
_STATUSES = {
    (400, "invalid_request_error"): (
        ErrorCode.INVALID_REQUEST,
        ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        ErrorCode.INVALID_CONSTRAINT,
    ),
    (401, "authentication_error"): (ErrorCode.UNAUTHORIZED,),
    (429, "rate_limit_error"): (ErrorCode.RATE_LIMITED,),
    (499, "client_disconnected"): (ErrorCode.ABORTED,),
    (503, "overloaded_error"): (ErrorCode.OVERLOADED, ErrorCode.DRAINING),
    (503, "server_error"): (ErrorCode.CONNECTION_LOST, ErrorCode.WORKER_LOST),
    (504, "timeout_error"): (ErrorCode.TIMEOUT,),
    (500, "server_error"): (ErrorCode.INTERNAL_ERROR,),
}
HTTP_ERRORS = {code: status for status, codes in _STATUSES.items() for code in codes}
# codes that say "come back later": their answers carry Retry-After (seconds)
RETRY_AFTER_S = {ErrorCode.OVERLOADED: 1, ErrorCode.RATE_LIMITED: 1, ErrorCode.DRAINING: 5}


# an error raised on this side without a code of its own: the code its status and type stand
# for (a client reads `code`, which is never null; 404, 413 and 422 are requests refused)
_DEFAULT_CODES = {
    (404, "invalid_request_error"): ErrorCode.INVALID_REQUEST,
    (408, "invalid_request_error"): ErrorCode.TIMEOUT,
    (413, "invalid_request_error"): ErrorCode.INVALID_REQUEST,
    (422, "invalid_request_error"): ErrorCode.INVALID_REQUEST,
    **{key: codes[0] for key, codes in _STATUSES.items()},
}


class APIError(Exception):
    """An error answered in OpenAI's shape; without a `code`, the one its status stands for."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        if code is None and (status, kind) in _DEFAULT_CODES:
            code = _DEFAULT_CODES[status, kind].value
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": str(self),
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = None if self.retry_after is None else {"Retry-After": str(self.retry_after)}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_runtime_error(e: Exception) -> APIError:
    """The runtime's error as OpenAI's, by its code; a ValueError raised on this side (before any
    request was sent) is the caller's mistake, any other failure a lost runtime. A request that
    packs past the runtime's frame limit is a 413 (code `invalid_request`), as a body past it is."""
    if isinstance(e, FrameTooLargeError):
        return APIError(413, e.message, code=e.code)
    if isinstance(e, RemoteError):
        code = ErrorCode.parse(e.code)
        if code is None:  # a code this gateway does not know: the runtime's own failure
            return APIError(500, e.message, "server_error", code=e.code)
        status, api_kind = HTTP_ERRORS.get(code, (500, "server_error"))
        return APIError(
            status, e.message, api_kind, code=e.code, retry_after=RETRY_AFTER_S.get(code)
        )
    if isinstance(e, ValueError):
        return APIError(400, str(e), code=ErrorCode.INVALID_REQUEST.value)
    return APIError(503, str(e), "server_error", code=ErrorCode.CONNECTION_LOST.value)
