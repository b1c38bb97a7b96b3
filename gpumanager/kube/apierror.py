"""API server refusals as text that says why: the status and the message of the Status object.

A 403's message is the RBAC authorizer's: it names the service account, the verb, the resource and
its API group, which is what an operator must add to the ClusterRole bound to the account.
"""

from __future__ import annotations

import json
import re
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


def failure(exc: BaseException) -> str:
    """One line for any failed request: :func:`describe` for an API answer (an ``ApiException``),
    ``<type>: <message>`` for anything else (a connection error, a timeout). ``str()`` of an
    ``ApiException`` is several lines with every response header: never logged as it is."""
    if getattr(exc, "status", None) is not None and hasattr(exc, "body"):
        return describe(exc)
    unreachable = _unreachable(exc)
    if unreachable:
        return unreachable
    return f"{type(exc).__name__}: {exc}"


def plain(exc: BaseException) -> str:
    """As :func:`failure`, but an error that is no API answer nor a connection's is its text alone (the
    agent's own errors say what failed: a type name before them says nothing more)."""
    if getattr(exc, "status", None) is not None and hasattr(exc, "body"):
        return describe(exc)
    return _unreachable(exc) or " ".join(str(exc).split()) or type(exc).__name__


#: How urllib3 starts the text of a connection's error: the connection, named by host and port.
_CONNECTION_PREFIX = re.compile(r"^\(?<?[\w.]*Connection\w*(?:\([^)]*\))?(?: object)?(?: at 0x[0-9a-f]+>)?,?:?\s*'?")


def unreachable(exc: BaseException) -> str:
    """For urllib3's MaxRetryError, ``cannot reach the API server at <server>: <why>``; "" otherwise."""
    return _unreachable(exc)


def _unreachable(exc: BaseException) -> str:
    """For urllib3's MaxRetryError (its text names the pool twice and the URL), the server and why it
    could not be reached: ``cannot reach the API server at https://host:port: <why>``; "" otherwise."""
    if not hasattr(exc, "url"):  # not a MaxRetryError (urllib3 2's NewConnectionError warns at a look at .pool)
        return ""
    pool, reason = getattr(exc, "pool", None), getattr(exc, "reason", None)
    if pool is None or not isinstance(reason, BaseException):
        return ""
    scheme = getattr(pool, "scheme", "https")
    host = getattr(pool, "host", "?")
    port = getattr(pool, "port", None)
    where = f"{scheme}://{host}" + (f":{port}" if port else "")
    text = " ".join(str(reason).split())
    why = _CONNECTION_PREFIX.sub("", text)
    if text.startswith("(") and why.endswith("')"):  # a (connection, 'message') pair's text
        why = why[:-2]
    return f"cannot reach the API server at {where}: {why or type(reason).__name__}"


def too_large_status(status: object) -> bool:
    """Whether a Status object (a watch's ERROR event, or an answer's body) says "Too large resource version":
    the server has not reached the resourceVersion asked for, which after its etcd was restored from a
    backup (its resourceVersion went back) it never will."""
    if not isinstance(status, dict) or status.get("code") != 504:
        return False
    details = status.get("details")
    causes = details.get("causes") if isinstance(details, dict) else None
    if isinstance(causes, list) and any(
        isinstance(c, dict) and c.get("reason") == "ResourceVersionTooLarge" for c in causes
    ):
        return True
    return "too large resource version" in str(status.get("message", "")).lower()


def resource_version_unusable(exc: BaseException) -> bool:
    """Whether a refused watch (an ``ApiException``) says its resourceVersion cannot be watched from: 410
    Gone (too old), or 504 "Too large resource version" (the server's went back). Watching again from it
    fails the same way for ever; only a new list gives one that works."""
    status = getattr(exc, "status", None)
    if status == 410:
        return True
    if status != 504:
        return False
    body = getattr(exc, "body", None)
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    try:
        data = json.loads(body) if isinstance(body, str) else None
    except ValueError:
        return False
    return too_large_status(data)


def unknown_node(node: str) -> str:
    """What a 404 for this agent's own Node means when it lasts: the node name it was given is not one the
    API server knows, and where that name comes from."""
    return (
        f"the agent's node name {node!r} (--hostname-override, else $NODE_NAME, else the host name) must be the "
        "name of this node's Node object (kubectl get nodes), or its pods are never seen"
    )
