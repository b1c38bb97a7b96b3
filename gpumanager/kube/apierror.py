"""API server refusals as text that says why: the status and the message of the Status object."""

from __future__ import annotations

import json
from typing import Any

#: The longest part of an answer's message quoted (a proxy's HTML page is not worth more).
MAX_MESSAGE = 400


def describe(exc: Any) -> str:
    """``<status> <reason>: <message>`` of an ApiException, the message from the Status object the
    server answered (which names the refused field, the RBAC rule, the conflict); without a usable
    body, ``<status> <reason>``, and ``str(exc)`` for an exception that is not an API answer."""
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    if status is None and reason is None:
        return str(exc)
    head = " ".join(str(p) for p in (status, reason) if p)
    body = getattr(exc, "body", None)
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    message = ""
    if isinstance(body, str) and body.strip():
        try:
            data = json.loads(body)
        except ValueError:
            message = body
        else:
            message = str(data.get("message") or "") if isinstance(data, dict) else ""
    message = " ".join(message.split())
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 3] + "..."
    return f"{head}: {message}" if message and message != reason else head
