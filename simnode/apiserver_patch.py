"""The three patch types the API server accepts on pods and nodes.

* ``application/merge-patch+json``: RFC 7386 (:func:`merge_patch`).
* ``application/json-patch+json``: RFC 6902 (:func:`json_patch`).
* ``application/strategic-merge-patch+json``: an approximation of Kubernetes' strategic merge
  (:func:`strategic_merge_patch`): maps merge as in RFC 7386; lists the Go types tag with
  ``patchStrategy:"merge"`` merge by their ``patchMergeKey`` (``spec.containers`` by ``name``,
  ``status.conditions`` by ``type``, ...; :data:`POD_MERGE_KEYS`, :data:`NODE_MERGE_KEYS`), lists of
  scalars tagged ``merge`` (``metadata.finalizers``) are unions; every other list is replaced.
  The directives ``$patch: replace|delete`` (on maps and list items), ``$retainKeys`` and
  ``$deleteFromPrimitiveList/<field>`` are honoured; ``$setElementOrder/<field>`` is accepted and
  ignored.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

PRIMITIVE_MERGE = ""
"""Merge-key value that marks a list of scalars merged as a set."""

_METADATA_KEYS: Mapping[str, str] = {
    "metadata.ownerReferences": "uid",
    "metadata.finalizers": PRIMITIVE_MERGE,
}

_CONTAINER_LISTS = ("spec.containers", "spec.initContainers", "spec.ephemeralContainers")
_CONTAINER_KEYS: Mapping[str, str] = {
    "ports": "containerPort",
    "env": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "resizePolicy": "resourceName",
}

POD_MERGE_KEYS: Mapping[str, str] = {
    **_METADATA_KEYS,
    **{path: "name" for path in _CONTAINER_LISTS},
    **{f"{path}[].{field}": key for path in _CONTAINER_LISTS for field, key in _CONTAINER_KEYS.items()},
    "spec.volumes": "name",
    "spec.imagePullSecrets": "name",
    "spec.hostAliases": "ip",
    "spec.topologySpreadConstraints": "topologyKey",
    "spec.resourceClaims": "name",
    "spec.schedulingGates": "name",
    "status.conditions": "type",
    "status.podIPs": "ip",
    "status.hostIPs": "ip",
    "status.resourceClaimStatuses": "name",
}
"""Pod list paths with ``patchStrategy: merge`` and their merge keys (``[]`` = any list item)."""

NODE_MERGE_KEYS: Mapping[str, str] = {
    **_METADATA_KEYS,
    "spec.podCIDRs": PRIMITIVE_MERGE,
    "status.conditions": "type",
    "status.addresses": "type",
}
"""Node list paths with ``patchStrategy: merge`` and their merge keys."""


class PatchError(ValueError):
    """A patch that cannot be applied (the server answers 422, or 400 when it cannot be decoded)."""

    def __init__(self, message: str, *, decode: bool = False) -> None:
        self.decode = decode
        super().__init__(message)


# --------------------------------------------------------------------------------------------
# RFC 7386


def merge_patch(target: Any, patch: Any) -> Any:
    """Apply a JSON merge patch (RFC 7386); returns a new value, ``target`` is not changed."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result: dict[str, Any] = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# --------------------------------------------------------------------------------------------
# RFC 6902


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f'invalid JSON pointer "{path}"')
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _index(container: list[Any], token: str, *, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(container)
    if not token.isdigit() or (len(token) > 1 and token.startswith("0")):
        raise PatchError(f'invalid array index "{token}"')
    idx = int(token)
    limit = len(container) if allow_end else len(container) - 1
    if idx > limit:
        raise PatchError(f"array index out of bounds: {idx}")
    return idx


def _parent(doc: Any, tokens: list[str], path: str) -> Any:
    cur = doc
    for token in tokens[:-1]:
        if isinstance(cur, dict):
            if token not in cur:
                raise PatchError(f'doc is missing path: "{path}"')
            cur = cur[token]
        elif isinstance(cur, list):
            cur = cur[_index(cur, token, allow_end=False)]
        else:
            raise PatchError(f'doc is missing path: "{path}"')
    return cur


def _get(doc: Any, path: str) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return doc
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f'doc is missing path: "{path}"')
        return parent[last]
    if isinstance(parent, list):
        return parent[_index(parent, last, allow_end=False)]
    raise PatchError(f'doc is missing path: "{path}"')


def _add(doc: Any, path: str, value: Any) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return value
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, allow_end=True), value)
    else:
        raise PatchError(f'doc is missing path: "{path}"')
    return doc


def _remove(doc: Any, path: str) -> tuple[Any, Any]:
    tokens = _pointer(path)
    if not tokens:
        raise PatchError("cannot remove the whole document")
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"unable to remove nonexistent key: {last}: missing value")
        return doc, parent.pop(last)
    if isinstance(parent, list):
        return doc, parent.pop(_index(parent, last, allow_end=False))
    raise PatchError(f'doc is missing path: "{path}"')


def json_patch(doc: Any, operations: Any) -> Any:
    """Apply a JSON patch (RFC 6902); returns a new document, ``doc`` is not changed."""
    if not isinstance(operations, list):
        raise PatchError("json: cannot unmarshal object into Go value of type jsonpatch.Patch", decode=True)
    out = copy.deepcopy(doc)
    for op in operations:
        if not isinstance(op, dict) or not isinstance(op.get("op"), str):
            raise PatchError("Unexpected kind: <nil>", decode=True)
        kind = op["op"]
        path = op.get("path")
        if not isinstance(path, str):
            raise PatchError(f"operation {kind!r} is missing path")
        if kind == "add":
            out = _add(out, path, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            out, _ = _remove(out, path)
        elif kind == "replace":
            _get(out, path)
            out, _ = _remove(out, path) if _pointer(path) else (out, None)
            out = _add(out, path, copy.deepcopy(op.get("value")))
        elif kind in ("move", "copy"):
            source = op.get("from")
            if not isinstance(source, str):
                raise PatchError(f"operation {kind!r} is missing from")
            if kind == "move":
                if path.startswith(source + "/"):
                    raise PatchError(f'cannot move "{source}" into its own child "{path}"')
                out, value = _remove(out, source)
            else:
                value = copy.deepcopy(_get(out, source))
            out = _add(out, path, value)
        elif kind == "test":
            if _get(out, path) != op.get("value"):
                raise PatchError(f"testing value {path} failed: test failed")
        else:
            raise PatchError(f"Unexpected kind: {kind}")
    return out


# --------------------------------------------------------------------------------------------
# strategic merge (approximation)

_DIRECTIVE = "$patch"
_RETAIN = "$retainKeys"
_DELETE_PRIMITIVE = "$deleteFromPrimitiveList/"
_SET_ORDER = "$setElementOrder/"


def strategic_merge_patch(target: Any, patch: Any, merge_keys: Mapping[str, str]) -> Any:
    """Apply a strategic merge patch with the list semantics given by ``merge_keys``."""
    if not isinstance(patch, dict):
        raise PatchError("strategic merge patch must be a JSON object", decode=True)
    return _smp_map(target if isinstance(target, dict) else {}, patch, "", merge_keys)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _smp_map(target: dict[str, Any], patch: dict[str, Any], path: str, keys: Mapping[str, str]) -> dict[str, Any]:
    directive = patch.get(_DIRECTIVE)
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != _DIRECTIVE}
    if directive == "delete":
        return {}
    if directive is not None:
        raise PatchError(f"Unknown patch type: {directive} in map: {patch}")
    result = copy.deepcopy(target)
    for key, value in patch.items():
        if key in (_DIRECTIVE, _RETAIN) or key.startswith(_SET_ORDER):
            continue
        if key.startswith(_DELETE_PRIMITIVE):
            field = key[len(_DELETE_PRIMITIVE) :]
            if isinstance(result.get(field), list) and isinstance(value, list):
                result[field] = [v for v in result[field] if v not in value]
            continue
        sub = _join(path, key)
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = _smp_map(result[key], value, sub, keys)
        elif isinstance(value, dict):
            result[key] = _smp_map({}, value, sub, keys)
        elif isinstance(value, list) and sub in keys:
            current = result.get(key)
            result[key] = _smp_list(current if isinstance(current, list) else [], value, sub, keys)
        else:
            result[key] = copy.deepcopy(value)
    retain = patch.get(_RETAIN)
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _smp_list(target: list[Any], patch: list[Any], path: str, keys: Mapping[str, str]) -> list[Any]:
    merge_key = keys[path]
    if any(isinstance(item, dict) and item.get(_DIRECTIVE) == "replace" for item in patch):
        return [copy.deepcopy(i) for i in patch if not (isinstance(i, dict) and i.get(_DIRECTIVE) == "replace")]
    if merge_key == PRIMITIVE_MERGE:
        out = list(target)
        for item in patch:
            if item not in out:
                out.append(copy.deepcopy(item))
        return out
    out = copy.deepcopy(target)
    item_path = path + "[]"
    for item in patch:
        if not isinstance(item, dict):
            raise PatchError(f"cannot merge a non-object item into {path}")
        if merge_key not in item:
            raise PatchError(f"map: {item} does not contain declared merge key: {merge_key}")
        wanted = item[merge_key]
        idx = next((i for i, cur in enumerate(out) if isinstance(cur, dict) and cur.get(merge_key) == wanted), None)
        if item.get(_DIRECTIVE) == "delete":
            if idx is not None:
                out.pop(idx)
            continue
        if idx is None:
            out.append(_smp_map({}, item, item_path, keys))
        else:
            out[idx] = _smp_map(out[idx], item, item_path, keys)
    return out
