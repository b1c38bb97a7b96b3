"""Objects from the API server that cannot be what they claim: told apart before anything reads them.

A real API server validates every object it stores, so an object always is a JSON object with its
metadata one. A server (or a proxy, or an aggregated API) that sent something else failed the readers:
one such object in a list failed the whole list, every time, and one in a watch event failed the watch,
which resumed from the same resourceVersion into the same event. Such objects are skipped, with a
warning naming them. Only what leaves an object without a key is refused: an object skipped reads as
gone, and a pod read as gone gives its GPUs back, so a pod whose labels or status have an odd shape is
kept (its readers take such fields as absent).
"""

from __future__ import annotations

import json

#: The most characters of a value quoted in a log line.
_SHOWN_CHARS = 80


def problem(obj: object, *, uid: bool = False) -> str:
    """Why ``obj`` cannot be an API object ("" when it can). ``uid``: a UID is required too."""
    if not isinstance(obj, dict):
        return f"not an object but {shown(obj)}"
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return f"its metadata is not an object but {shown(meta)}"
    if uid and (not isinstance(meta.get("uid"), str) or not meta.get("uid")):
        return f"its metadata.uid is {shown(meta.get('uid'))}"
    return ""


def shown(value: object) -> str:
    """A value of an answer for a log line: its JSON, at most 80 characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def described(obj: object, kind: str = "") -> str:
    """What can be told of an object's identity: ``<kind> <namespace>/<name>`` (or ``<kind> <name>``;
    ``object`` for an empty kind) when its metadata names it, else ``an object``."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(meta, dict) or not meta.get("name"):
        return "an object"
    namespace = meta.get("namespace")
    what = kind or "object"
    return f"{what} {namespace}/{meta['name']}" if namespace else f"{what} {meta['name']}"
