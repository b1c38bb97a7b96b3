"""The kube-scheduler extender API v1 as JSON (k8s.io/kube-scheduler/extender/v1).

The Go types carry no JSON tags, so the keys are the Go field names: ``ExtenderArgs{Pod,
Nodes, NodeNames}``, ``ExtenderFilterResult{Nodes, NodeNames, FailedNodes,
FailedAndUnresolvableNodes, Error}``, ``HostPriorityList = [HostPriority{Host, Score}]``,
``ExtenderBindingArgs{PodName, PodNamespace, PodUID, Node}``, ``ExtenderBindingResult{Error}``.
``Pod`` and ``Nodes`` (a ``v1.NodeList``) are Kubernetes objects with their usual JSON keys.

With ``nodeCacheCapable: false`` every request carries whole Node objects (hundreds of KiB for
a hundred nodes) and filter must answer with the objects that pass. They are decoded with
msgspec into raw JSON pieces: only each node's name is read, and the pieces that pass are sent
back unchanged, so no Node object is ever fully decoded or encoded again (one is decoded only
when the extender does not know that node yet).

Keys are matched as Go's ``encoding/json`` matches them, whatever their case (the last one that
matches wins): gpu-admission, built on the older ``pkg/scheduler/api/v1`` types, took their tags
(``pod``, ``nodes``, ``nodenames``, ``podName``...) as well as the field names the kube-scheduler
sends, and so do these readers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

JSON = dict[str, Any]


#: What a pod or node object of the wrong shape raises when it is read as the API server writes them.
SHAPE_ERRORS = (AttributeError, TypeError, KeyError, RecursionError)


class BadRequestError(ValueError):
    """The request body is not what the verb takes; the message names the field."""


class _Meta(msgspec.Struct):
    name: str = ""


class _NodeHead(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)


class _NodeList(msgspec.Struct):
    items: list[msgspec.Raw] | None = None


_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_NODES = msgspec.json.Decoder(_NodeList | None)
_NAMES = msgspec.json.Decoder(list[str] | None)
_STRING = msgspec.json.Decoder(str | None)
_HEAD = msgspec.json.Decoder(_NodeHead)
_OBJECT = msgspec.json.Decoder(dict[str, Any])
_ENCODER = msgspec.json.Encoder()

_ARGS_KEYS = ("Pod", "Nodes", "NodeNames")
_BINDING_KEYS = ("PodName", "PodNamespace", "PodUID", "Node")


def encode(answer: object) -> bytes:
    """JSON bytes of an answer (raw Node pieces are copied as they are)."""
    return _ENCODER.encode(answer)


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes, what: str) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequestError(f"{what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequestError(f"{what}: the body is not JSON: {exc}") from None
    except RecursionError:
        raise BadRequestError(f"{what}: the body's JSON is nested too deeply to read") from None


def _fields(body: bytes, what: str, keys: tuple[str, ...]) -> dict[str, msgspec.Raw]:
    """The body's values of ``keys`` (raw), its keys matched whatever their case, the last match winning."""
    top: dict[str, msgspec.Raw] = _decode(_TOP, body, what)
    folded = {key.lower(): key for key in keys}
    found: dict[str, msgspec.Raw] = {}
    for key, raw in top.items():
        name = folded.get(key.lower())
        if name is not None:
            found[name] = raw
    return found


@dataclass(frozen=True)
class ExtenderArgs:
    """Arguments of filter and prioritize.

    ``raw_nodes`` holds the Node objects as sent (``nodeCacheCapable: false``), by name, in the
    order sent; ``node_names`` is set only when the scheduler sends names instead.
    """

    pod: JSON
    node_names: list[str] | None
    raw_nodes: dict[str, msgspec.Raw] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        """The candidate nodes' names, in the order sent."""
        return list(self.node_names) if self.node_names is not None else list(self.raw_nodes)

    def node_object(self, name: str) -> JSON | None:
        """The Node object sent for ``name`` (decoded now), None when only names were sent."""
        raw = self.raw_nodes.get(name)
        return None if raw is None else _OBJECT.decode(raw)


def parse_args(body: bytes) -> ExtenderArgs:
    """``ExtenderArgs`` from a request body."""
    fields = _fields(body, "ExtenderArgs", _ARGS_KEYS)
    if "Pod" not in fields:
        raise BadRequestError("ExtenderArgs has no Pod")
    pod: JSON = _decode(_OBJECT, fields["Pod"], "ExtenderArgs.Pod")
    nodes: _NodeList | None = _decode(_NODES, fields["Nodes"], "ExtenderArgs.Nodes") if "Nodes" in fields else None
    names: list[str] | None = (
        _decode(_NAMES, fields["NodeNames"], "ExtenderArgs.NodeNames") if "NodeNames" in fields else None
    )
    if nodes is None and names is None:
        raise BadRequestError("ExtenderArgs has neither Nodes nor NodeNames")
    if nodes is not None:
        raw: dict[str, msgspec.Raw] = {}
        for i, item in enumerate(nodes.items or []):
            head: _NodeHead = _decode(_HEAD, item, f"ExtenderArgs.Nodes.items[{i}]")
            if not head.metadata.name:
                raise BadRequestError(f"ExtenderArgs.Nodes.items[{i}] has no metadata.name")
            raw[head.metadata.name] = item
        return ExtenderArgs(pod=pod, node_names=None, raw_nodes=raw)
    for i, name in enumerate(names or []):
        if not name:
            raise BadRequestError(f"ExtenderArgs.NodeNames[{i}] is an empty name")
    return ExtenderArgs(pod=pod, node_names=list(names or []))


def filter_result(
    args: ExtenderArgs,
    passed: list[str],
    failed: Mapping[str, str],
    unresolvable: Mapping[str, str],
    error: str = "",
) -> JSON:
    """``ExtenderFilterResult`` answering in the form the scheduler asked in (objects or names)."""
    result: JSON = {
        "FailedNodes": dict(failed),
        "FailedAndUnresolvableNodes": dict(unresolvable),
        "Error": error,
    }
    if args.node_names is not None:
        result["Nodes"] = None
        result["NodeNames"] = passed
    else:
        result["Nodes"] = {"metadata": {}, "items": [args.raw_nodes[name] for name in passed]}
        result["NodeNames"] = None
    return result


def error_filter_result(message: str) -> JSON:
    """A filter answer that only carries an error (the scheduler then fails the pod's attempt)."""
    return {"Nodes": None, "NodeNames": None, "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": message}


@dataclass(frozen=True)
class BindingArgs:
    """``ExtenderBindingArgs``."""

    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str


def parse_binding(body: bytes) -> BindingArgs:
    """``ExtenderBindingArgs`` from a request body."""
    fields = _fields(body, "ExtenderBindingArgs", _BINDING_KEYS)
    values: dict[str, str] = {
        key: _decode(_STRING, raw, f"ExtenderBindingArgs.{key}") or "" for key, raw in fields.items()
    }
    for key in _BINDING_KEYS:
        if key not in fields:
            raise BadRequestError(f"ExtenderBindingArgs: Object missing required field `{key}`")
    for key in ("PodName", "PodNamespace", "Node"):
        if not values[key]:
            raise BadRequestError(f"ExtenderBindingArgs.{key} is empty")
    return BindingArgs(values["PodName"], values["PodNamespace"], values["PodUID"], values["Node"])
