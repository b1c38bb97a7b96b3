"""The kube-scheduler extender API v1 as JSON (k8s.io/kube-scheduler/extender/v1).

The Go types carry no JSON tags, so the keys are the Go field names: ``ExtenderArgs{Pod,
Nodes, NodeNames}``, ``ExtenderFilterResult{Nodes, NodeNames, FailedNodes,
FailedAndUnresolvableNodes, Error}``, ``HostPriorityList = [HostPriority{Host, Score}]``,
``ExtenderBindingArgs{PodName, PodNamespace, PodUID, Node}``, ``ExtenderBindingResult{Error}``.
``Pod`` and ``Nodes`` (a ``v1.NodeList``) are Kubernetes objects with their usual JSON keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

JSON = dict[str, Any]


class BadRequestError(ValueError):
    """The request body is not what the verb takes; the message names the field."""


@dataclass(frozen=True)
class ExtenderArgs:
    """Arguments of filter and prioritize.

    ``nodes`` holds full Node objects when the scheduler sends them (``nodeCacheCapable:
    false``); ``node_names`` is set only when it sends names instead.
    """

    pod: JSON
    nodes: list[JSON]
    node_names: list[str] | None

    @property
    def names(self) -> list[str]:
        """The candidate nodes' names, in the order sent."""
        if self.node_names is not None:
            return list(self.node_names)
        return [str((n.get("metadata") or {}).get("name", "")) for n in self.nodes]


def _object(raw: object, what: str) -> JSON:
    if not isinstance(raw, dict):
        raise BadRequestError(f"{what} must be a JSON object, got {type(raw).__name__}")
    return raw


def parse_args(body: object) -> ExtenderArgs:
    """``ExtenderArgs`` from a decoded request body."""
    data = _object(body, "ExtenderArgs")
    pod = _object(data.get("Pod"), "ExtenderArgs.Pod")
    raw_nodes = data.get("Nodes")
    raw_names = data.get("NodeNames")
    nodes: list[JSON] = []
    if raw_nodes is not None:
        items = _object(raw_nodes, "ExtenderArgs.Nodes").get("items") or []
        if not isinstance(items, list):
            raise BadRequestError("ExtenderArgs.Nodes.items must be a list")
        nodes = [_object(n, f"ExtenderArgs.Nodes.items[{i}]") for i, n in enumerate(items)]
    names: list[str] | None = None
    if raw_names is not None:
        if not isinstance(raw_names, list) or not all(isinstance(n, str) for n in raw_names):
            raise BadRequestError("ExtenderArgs.NodeNames must be a list of strings")
        names = list(raw_names)
    if raw_nodes is None and names is None:
        raise BadRequestError("ExtenderArgs has neither Nodes nor NodeNames")
    return ExtenderArgs(pod=pod, nodes=nodes, node_names=names if raw_nodes is None else None)


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
        keep = set(passed)
        items = [n for n in args.nodes if str((n.get("metadata") or {}).get("name", "")) in keep]
        result["Nodes"] = {"metadata": {}, "items": items}
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


def parse_binding(body: object) -> BindingArgs:
    """``ExtenderBindingArgs`` from a decoded request body."""
    data = _object(body, "ExtenderBindingArgs")
    values = {}
    for key in ("PodName", "PodNamespace", "PodUID", "Node"):
        value = data.get(key)
        if not isinstance(value, str) or (not value and key != "PodUID"):
            raise BadRequestError(f"ExtenderBindingArgs.{key} must be a non-empty string, got {value!r}")
        values[key] = value
    return BindingArgs(values["PodName"], values["PodNamespace"], values["PodUID"], values["Node"])
