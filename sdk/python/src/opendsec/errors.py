"""Errors raised by the SDK, one class per server error code."""

from __future__ import annotations

from typing import Dict, Type


class DSecError(Exception):
    """An error answered by OpenDsec. ``code`` is the Connect code name
    (e.g. "invalid_argument"); ``message`` says which field, why, and what is
    allowed."""

    code = "unknown"
    #: True when the same request may be sent again as it is: the server
    #: said so (its Dsec-Retry header), or the connection failed before any
    #: answer.
    retryable = False
    #: Seconds the server asked to wait before the request is sent again
    #: (its Retry-After header: a fleet with no room for a create now), or
    #: None.
    retry_after: "float | None" = None

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.message = message
        if code:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidArgumentError(DSecError):
    code = "invalid_argument"


class NotFoundError(DSecError):
    code = "not_found"


class AlreadyExistsError(DSecError):
    code = "already_exists"


class PermissionDeniedError(DSecError):
    code = "permission_denied"


class AuthenticationError(DSecError):
    code = "unauthenticated"


class ResourceExhaustedError(DSecError):
    code = "resource_exhausted"


class FailedPreconditionError(DSecError):
    code = "failed_precondition"


class UnavailableError(DSecError):
    code = "unavailable"


class UnsupportedError(DSecError):
    code = "unimplemented"


class TimeoutError(DSecError):  # noqa: A001 - mirrors the server's code name
    code = "deadline_exceeded"


_BY_CODE: Dict[str, Type[DSecError]] = {
    c.code: c
    for c in (
        InvalidArgumentError,
        NotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        AuthenticationError,
        ResourceExhaustedError,
        FailedPreconditionError,
        UnavailableError,
        UnsupportedError,
        TimeoutError,
    )
}


def error_from_code(code: str, message: str) -> DSecError:
    """Returns the exception for a Connect error code."""
    cls = _BY_CODE.get(code, DSecError)
    return cls(message, code)
