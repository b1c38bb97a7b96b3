"""Errors of the API-server simulator, shaped as the real server's ``Status`` objects."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

JSON = dict[str, Any]

REASONS: Mapping[int, str] = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}
"""The ``reason`` the real server gives with each status code (``metav1.StatusReason``)."""

DEFAULT_MESSAGES: Mapping[int, str] = {
    400: "the server rejected our request for an unknown reason",
    401: "Unauthorized",
    403: "forbidden",
    404: "the server could not find the requested resource",
    405: "the server does not allow this method on the requested resource",
    409: "the server reported a conflict",
    410: "the resource version is too old",
    415: "the server does not support the media type of the request",
    422: "the server rejected our request due to an error in our request",
    429: "the server has received too many requests and has asked us to try again later",
    500: 'an error on the server ("unknown") has prevented the request from succeeding',
    503: "the server is currently unable to handle the request",
    504: "the server was unable to return a response in the time allotted, but may still be processing the request",
}


class ApiError(Exception):
    """A failed request: carries the HTTP code and the ``Status`` object the server answers with."""

    def __init__(
        self,
        code: int,
        message: str | None = None,
        *,
        reason: str | None = None,
        details: JSON | None = None,
        retry_after: int | None = None,
    ) -> None:
        self.code = code
        self.reason = reason or REASONS.get(code, "Unknown" if code < 500 else "InternalError")
        self.message = message if message is not None else DEFAULT_MESSAGES.get(code, f"HTTP {code}")
        self.details = details
        self.retry_after = retry_after
        super().__init__(f"{self.code} {self.reason}: {self.message}")

    def status(self) -> JSON:
        """The ``Status`` object (``kind: Status``) for this error."""
        out: JSON = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
        }
        details = dict(self.details) if self.details is not None else None
        if self.retry_after is not None:
            details = details or {}
            details["retryAfterSeconds"] = self.retry_after
        if details is not None:
            out["details"] = details
        out["code"] = self.code
        return out


def success_status(details: JSON | None = None, code: int | None = None) -> JSON:
    """A ``Status`` of ``Success`` (answer to DELETE of a node, to a binding, ...)."""
    out: JSON = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
    if details is not None:
        out["details"] = details
    if code is not None:
        out["code"] = code
    return out


def not_found(resource: str, name: str) -> ApiError:
    """``pods "x" not found``."""
    return ApiError(404, f'{resource} "{name}" not found', details={"name": name, "kind": resource})


def already_exists(resource: str, name: str) -> ApiError:
    """``pods "x" already exists`` (409, reason ``AlreadyExists``)."""
    return ApiError(
        409, f'{resource} "{name}" already exists', reason="AlreadyExists", details={"name": name, "kind": resource}
    )


def conflict(resource: str, name: str, why: str | None = None) -> ApiError:
    """The optimistic-concurrency conflict of an update with a stale resourceVersion."""
    why = why or "the object has been modified; please apply your changes to the latest version and try again"
    return ApiError(
        409, f'Operation cannot be fulfilled on {resource} "{name}": {why}', details={"name": name, "kind": resource}
    )


def bad_request(message: str) -> ApiError:
    """400 BadRequest."""
    return ApiError(400, message)


def expired(message: str) -> ApiError:
    """410 Expired (``too old resource version``)."""
    return ApiError(410, message)


def method_not_allowed() -> ApiError:
    """405 for a verb the resource does not offer."""
    return ApiError(405)


def server_not_found() -> ApiError:
    """404 for an unknown resource under ``/api``."""
    return ApiError(404, details={})


def invalid(kind: str, name: str, causes: Sequence[tuple[str, str, str]]) -> ApiError:
    """422 Invalid; ``causes`` are ``(field, reason, message)`` triples as in ``field.ErrorList``.

    The message reads like the real server's: ``Pod "x" is invalid: spec.containers: Required value``.
    """
    parts = [f"{fld}: {msg}" if fld else msg for fld, _reason, msg in causes]
    text = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    return ApiError(
        422,
        f'{kind} "{name}" is invalid: {text}',
        details={
            "name": name,
            "group": "",
            "kind": kind,
            "causes": [{"reason": reason, "message": msg, "field": fld} for fld, reason, msg in causes],
        },
    )


def forbidden_anonymous(verb: str, resource: str | None, namespace: str | None, path: str) -> ApiError:
    """403 for a request without credentials, worded as the RBAC authorizer words it."""
    if resource is None:
        message = f'forbidden: User "system:anonymous" cannot {verb} path "{path}"'
        return ApiError(403, message, details={})
    scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
    message = (
        f'{resource} is forbidden: User "system:anonymous" cannot {verb} resource "{resource}" in API group "" {scope}'
    )
    return ApiError(403, message, details={"kind": resource})


def for_code(code: int, message: str | None = None, retry_after: int | None = None) -> ApiError:
    """A generic error for ``code`` (used by fault injection).

    With ``retry_after`` the answer carries a ``Retry-After`` header (and
    ``details.retryAfterSeconds``); note that urllib3 then retries 413/429/503 answers by itself.
    """
    return ApiError(code, message, retry_after=retry_after)
