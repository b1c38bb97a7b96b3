"""Pods and nodes as the API server stores them: defaulting, validation, update rules, builders.

What the real server does on create that is modelled here (``pkg/apis/core/v1/defaults.go``,
the pod strategy and the default admission plugins):

* system fields: ``metadata.uid``, ``metadata.creationTimestamp`` (``resourceVersion`` comes from
  the store);
* pod spec defaults: ``restartPolicy``, ``terminationGracePeriodSeconds``, ``dnsPolicy``,
  ``schedulerName``, ``securityContext``, ``enableServiceLinks``, ``priority``,
  ``preemptionPolicy``, ``serviceAccountName`` and the two default ``NoExecute`` tolerations;
  per container ``imagePullPolicy``, ``terminationMessagePath/Policy`` and ``resources.requests``
  defaulted from ``resources.limits``;
* pod status reset to ``{phase: Pending, qosClass: ...}`` (the status of a created pod is never
  taken from the request).

Validation covers names, labels, annotations, containers (name, image, unique names), quantities,
extended resources (whole numbers, requests equal to limits) and ``status.phase``. Updates of the
main resource keep the stored status and may change only the spec fields the real server lets
change; updates of ``/status`` keep the stored spec.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from simnode.apiserver_errors import ApiError, bad_request, invalid
from simnode.apiserver_patch import NODE_MERGE_KEYS, POD_MERGE_KEYS
from simnode.apiserver_quantity import QuantityError, canonical
from simnode.apiserver_selectors import NODE_FIELDS, POD_FIELDS, valid_label_key, valid_label_value

log = logging.getLogger(__name__)

JSON = dict[str, Any]
Cause = tuple[str, str, str]

DEFAULT_IMAGE = "nvidia/cuda:12.4.1-base-ubuntu22.04"
"""Image used by :func:`pod_manifest` when none is given."""

POD_PHASES = ("Pending", "Running", "Succeeded", "Failed", "Unknown")
TERMINAL_PHASES = ("Succeeded", "Failed")

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
    "and must start and end with an alphanumeric character"
)
_LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
    "and must start and end with an alphanumeric character"
)
_GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"

DEFAULT_TOLERATIONS: tuple[JSON, ...] = (
    {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
    {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
)


def now_rfc3339(offset_seconds: float = 0.0) -> str:
    """The current UTC time (plus an offset) as the API server writes timestamps."""
    t = datetime.now(UTC).timestamp() + offset_seconds
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_uid() -> str:
    """A fresh object UID."""
    return str(uuid.uuid4())


def generated_name(prefix: str) -> str:
    """``metadata.generateName`` plus five random characters, as the server names such objects."""
    suffix = uuid.uuid4().int
    chars = []
    for _ in range(5):
        suffix, idx = divmod(suffix, len(_GENERATE_ALPHABET))
        chars.append(_GENERATE_ALPHABET[idx])
    return prefix + "".join(chars)


def meta(obj: JSON) -> JSON:
    """``obj["metadata"]``, created when missing."""
    md = obj.get("metadata")
    if not isinstance(md, dict):
        md = {}
        obj["metadata"] = md
    return md


def _sub(obj: JSON, key: str) -> JSON:
    value = obj.get(key)
    if not isinstance(value, dict):
        value = {}
        obj[key] = value
    return value


# --------------------------------------------------------------------------------------------
# shape checks (the real server fails to decode such bodies: 400)


def _check_string_map(obj: JSON, field: str) -> None:
    value = meta(obj).get(field)
    if value is None:
        return
    if not isinstance(value, dict):
        raise bad_request(
            f"json: cannot unmarshal {type(value).__name__} into Go struct field ObjectMeta.metadata.{field}"
        )
    for k, v in value.items():
        if not isinstance(v, str):
            raise bad_request(
                f"json: cannot unmarshal {type(v).__name__} into Go struct field ObjectMeta.metadata.{field} "
                f"of type string (key {k!r})"
            )


def check_shape(obj: Any, kind: str, api_version: str = "v1") -> JSON:
    """Reject bodies the real server could not decode into the Go type (400)."""
    if not isinstance(obj, dict):
        raise bad_request(f"json: cannot unmarshal {type(obj).__name__} into Go value of type v1.{kind}")
    body_kind = obj.get("kind")
    if body_kind not in (None, "", kind):
        raise bad_request(
            f"the API version in the data ({api_version}) does not match the expected kind {kind} (got {body_kind})"
        )
    if obj.get("apiVersion") not in (None, "", api_version):
        raise bad_request(
            f"the API version in the data ({obj.get('apiVersion')}) does not match the expected API version "
            f"({api_version})"
        )
    if "metadata" in obj and not isinstance(obj["metadata"], dict):
        raise bad_request("json: cannot unmarshal into Go struct field metadata of type v1.ObjectMeta")
    for field in ("labels", "annotations"):
        _check_string_map(obj, field)
    for field in ("spec", "status"):
        if field in obj and obj[field] is not None and not isinstance(obj[field], dict):
            raise bad_request(f"json: cannot unmarshal into Go struct field {kind}.{field}")
    return obj


# --------------------------------------------------------------------------------------------
# metadata validation


def _validate_meta(obj: JSON, namespaced: bool) -> list[Cause]:
    causes: list[Cause] = []
    md = meta(obj)
    name = md.get("name")
    if not name:
        causes.append(("metadata.name", "FieldValueRequired", "Required value: name or generateName is required"))
    elif not isinstance(name, str) or len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        causes.append(("metadata.name", "FieldValueInvalid", f'Invalid value: "{name}": {_SUBDOMAIN_MSG}'))
    if namespaced:
        ns = md.get("namespace")
        if not isinstance(ns, str) or len(ns) > 63 or not _DNS_LABEL.match(ns):
            causes.append(("metadata.namespace", "FieldValueInvalid", f'Invalid value: "{ns}": {_LABEL_MSG}'))
    for key, value in (md.get("labels") or {}).items():
        if not valid_label_key(key):
            causes.append(("metadata.labels", "FieldValueInvalid", f'Invalid value: "{key}": name part must be valid'))
        if not valid_label_value(value):
            causes.append(
                (
                    "metadata.labels",
                    "FieldValueInvalid",
                    f'Invalid value: "{value}": a valid label must be an empty '
                    "string or consist of alphanumeric characters, '-', '_' or '.'",
                )
            )
    for key in md.get("annotations") or {}:
        if not valid_label_key(key.lower()):
            causes.append(
                ("metadata.annotations", "FieldValueInvalid", f'Invalid value: "{key}": name part must be valid')
            )
    finalizers = md.get("finalizers")
    if finalizers is not None and (not isinstance(finalizers, list) or not all(isinstance(f, str) for f in finalizers)):
        causes.append(("metadata.finalizers", "FieldValueInvalid", "Invalid value: finalizers must be strings"))
    return causes


# --------------------------------------------------------------------------------------------
# pods


def _is_extended(resource: str) -> bool:
    if "/" not in resource:
        return False
    if resource.startswith("requests."):
        return False
    prefix = resource.split("/", 1)[0]
    return not (prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io"))


def _quantity(value: Any) -> Decimal | None:
    try:
        return Decimal(parse_quantity(value))  # type: ignore[no-untyped-call]
    except (ValueError, TypeError, ArithmeticError):
        return None


def _containers(spec: JSON) -> list[tuple[str, JSON]]:
    out: list[tuple[str, JSON]] = []
    for field in ("initContainers", "containers"):
        items = spec.get(field)
        if isinstance(items, list):
            out.extend((f"spec.{field}[{i}]", c) for i, c in enumerate(items) if isinstance(c, dict))
    return out


def _normalize_quantities(container: JSON) -> None:
    """Quantities as the server stores them: canonical form (``1000`` reads back as ``1k``, ``1024Mi`` as
    ``1Gi``); a value that is not a quantity is left for validation to refuse."""
    resources = container.get("resources")
    if not isinstance(resources, dict):
        return
    for part in ("limits", "requests"):
        values = resources.get(part)
        if isinstance(values, dict):
            for key, value in list(values.items()):
                if isinstance(value, int | float) and not isinstance(value, bool):
                    values[key] = value = str(value)
                with contextlib.suppress(QuantityError):
                    values[key] = canonical(value)


def _image_pull_policy(image: str) -> str:
    if "@" in image:
        return "IfNotPresent"
    last = image.rsplit("/", 1)[-1]
    if ":" not in last or last.endswith(":latest"):
        return "Always"
    return "IfNotPresent"


def pod_qos_class(pod: JSON) -> str:
    """The QoS class the server computes from cpu/memory requests and limits."""
    spec = pod.get("spec") or {}
    any_set = False
    guaranteed = True
    for _path, c in _containers(spec):
        resources = c.get("resources") or {}
        limits = resources.get("limits") or {}
        requests = resources.get("requests") or {}
        for res in ("cpu", "memory"):
            lim, req = limits.get(res), requests.get(res)
            if lim is not None or req is not None:
                any_set = True
            if lim is None or (req is not None and _quantity(req) != _quantity(lim)):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def default_pod(pod: JSON) -> None:
    """Apply the server's defaults to a pod being created (in place)."""
    spec = _sub(pod, "spec")
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("priority", 0)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    if "serviceAccountName" not in spec:
        spec["serviceAccountName"] = spec.get("serviceAccount", "default")
    spec.setdefault("serviceAccount", spec["serviceAccountName"])
    tolerations = spec.setdefault("tolerations", [])
    if isinstance(tolerations, list):
        for tol in DEFAULT_TOLERATIONS:
            if not any(isinstance(t, dict) and t.get("key") == tol["key"] for t in tolerations):
                tolerations.append(dict(tol))
    for _path, c in _containers(spec):
        image = c.get("image")
        if isinstance(image, str) and image:
            c.setdefault("imagePullPolicy", _image_pull_policy(image))
        c.setdefault("terminationMessagePath", "/dev/termination-log")
        c.setdefault("terminationMessagePolicy", "File")
        resources = c.setdefault("resources", {})
        _normalize_quantities(c)
        if isinstance(resources, dict) and isinstance(resources.get("limits"), dict):
            requests = resources.setdefault("requests", {})
            if isinstance(requests, dict):
                for key, value in resources["limits"].items():
                    requests.setdefault(key, value)


def _validate_resources(path: str, c: JSON) -> list[Cause]:
    causes: list[Cause] = []
    resources = c.get("resources") or {}
    if not isinstance(resources, dict):
        return [(f"{path}.resources", "FieldValueInvalid", "Invalid value: must be an object")]
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    parsed: dict[tuple[str, str], Decimal] = {}
    for part, values in (("limits", limits), ("requests", requests)):
        if not isinstance(values, dict):
            causes.append((f"{path}.resources.{part}", "FieldValueInvalid", "Invalid value: must be a map"))
            continue
        for res, raw in values.items():
            q = _quantity(raw)
            where = f"{path}.resources.{part}[{res}]"
            if q is None or not isinstance(raw, str | int | float):
                causes.append(
                    (
                        where,
                        "FieldValueInvalid",
                        f'Invalid value: "{raw}": quantities must match the regular '
                        "expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'",
                    )
                )
                continue
            if q < 0:
                causes.append(
                    (where, "FieldValueInvalid", f'Invalid value: "{raw}": must be greater than or equal to 0')
                )
            if _is_extended(res) and q != q.to_integral_value():
                causes.append((where, "FieldValueInvalid", f'Invalid value: "{raw}": must be an integer'))
            parsed[(part, res)] = q
    for (part, res), q in parsed.items():
        if part != "requests":
            continue
        lim = parsed.get(("limits", res))
        where = f"{path}.resources.requests[{res}]"
        if _is_extended(res):
            if lim is None:
                causes.append(
                    (where, "FieldValueForbidden", "Forbidden: Limit must be set for non overcommitable resources")
                )
            elif lim != q:
                causes.append(
                    (
                        where,
                        "FieldValueInvalid",
                        f'Invalid value: "{requests[res]}": must be equal to {res} limit of {limits[res]}',
                    )
                )
        elif lim is not None and q > lim:
            causes.append(
                (
                    where,
                    "FieldValueInvalid",
                    f'Invalid value: "{requests[res]}": must be less than or equal to {res} limit of {limits[res]}',
                )
            )
    return causes


def validate_pod(pod: JSON) -> None:
    """Raise 422 Invalid when the pod would be rejected by the real server's validation."""
    name = str(meta(pod).get("name") or "")
    causes = _validate_meta(pod, namespaced=True)
    spec = pod.get("spec")
    containers = spec.get("containers") if isinstance(spec, dict) else None
    if not isinstance(containers, list) or not containers:
        causes.append(("spec.containers", "FieldValueRequired", "Required value"))
    names: set[str] = set()
    for path, c in _containers(spec if isinstance(spec, dict) else {}):
        cname = c.get("name")
        if not cname:
            causes.append((f"{path}.name", "FieldValueRequired", "Required value"))
        elif not isinstance(cname, str) or not _DNS_LABEL.match(cname) or len(cname) > 63:
            causes.append((f"{path}.name", "FieldValueInvalid", f'Invalid value: "{cname}": {_LABEL_MSG}'))
        elif cname in names:
            causes.append((f"{path}.name", "FieldValueDuplicate", f'Duplicate value: "{cname}"'))
        else:
            names.add(cname)
        if not c.get("image"):
            causes.append((f"{path}.image", "FieldValueRequired", "Required value"))
        causes.extend(_validate_resources(path, c))
    status = pod.get("status")
    phase = status.get("phase") if isinstance(status, dict) else None
    if phase is not None and phase not in POD_PHASES:
        supported = ", ".join(f'"{p}"' for p in POD_PHASES)
        causes.append(
            ("status.phase", "FieldValueNotSupported", f'Unsupported value: "{phase}": supported values: {supported}')
        )
    if causes:
        raise invalid("Pod", name, causes)


def prepare_pod_create(pod: JSON, *, from_api: bool) -> None:
    """Defaults and status of a pod being created.

    Through the API (``from_api``) the status is reset to ``Pending`` as the real server does;
    the direct helpers keep a given status and default only ``phase`` and ``qosClass``.
    """
    default_pod(pod)
    qos = pod_qos_class(pod)
    if from_api or not isinstance(pod.get("status"), dict):
        pod["status"] = {"phase": "Pending", "qosClass": qos}
    else:
        pod["status"].setdefault("phase", "Pending")
        pod["status"].setdefault("qosClass", qos)


_MUTABLE_POD_SPEC = (
    "activeDeadlineSeconds",
    "tolerations",
    "terminationGracePeriodSeconds",
    "schedulingGates",
)


def _pod_spec_view(spec: Any) -> Any:
    view = copy.deepcopy(spec) if isinstance(spec, dict) else {}
    for key in _MUTABLE_POD_SPEC:
        view.pop(key, None)
    for field in ("containers", "initContainers"):
        for c in view.get(field) or []:
            if isinstance(c, dict):
                c.pop("image", None)
    return view


def _restore_system_meta(old: JSON, new: JSON, kind: str) -> None:
    old_md, new_md = meta(old), meta(new)
    name = str(old_md.get("name"))
    uid = new_md.get("uid")
    if uid and uid != old_md.get("uid"):
        raise invalid(
            kind, name, [("metadata.uid", "FieldValueInvalid", f'Invalid value: "{uid}": field is immutable')]
        )
    for key in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generateName"):
        if key in old_md:
            new_md[key] = old_md[key]
        else:
            new_md.pop(key, None)


def prepare_pod_update(old: JSON, new: JSON) -> None:
    """Rules of ``PUT``/``PATCH`` on a pod: status kept, spec mostly immutable (422 otherwise)."""
    _restore_system_meta(old, new, "Pod")
    new["status"] = copy.deepcopy(old.get("status"))
    if isinstance(new.get("spec"), dict):
        for _path, c in _containers(new["spec"]):
            _normalize_quantities(c)
    if _pod_spec_view(old.get("spec")) != _pod_spec_view(new.get("spec")):
        raise invalid(
            "Pod",
            str(meta(old).get("name")),
            [
                (
                    "spec",
                    "FieldValueForbidden",
                    "Forbidden: pod updates may not change fields other than `spec.containers[*].image`,"
                    "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` "
                    "(only additions to existing tolerations),`spec.terminationGracePeriodSeconds` "
                    "(allow it to be set to 1 if it was previously negative)",
                )
            ],
        )
    validate_pod(new)


def prepare_pod_status_update(old: JSON, new: JSON) -> None:
    """Rules of ``PUT``/``PATCH`` on ``pods/{name}/status``: spec and owner references kept."""
    _restore_system_meta(old, new, "Pod")
    new["spec"] = copy.deepcopy(old.get("spec"))
    old_refs = meta(old).get("ownerReferences")
    if old_refs is None:
        meta(new).pop("ownerReferences", None)
    else:
        meta(new)["ownerReferences"] = copy.deepcopy(old_refs)
    old_phase = (old.get("status") or {}).get("phase")
    new_phase = (new.get("status") or {}).get("phase") if isinstance(new.get("status"), dict) else None
    if old_phase in TERMINAL_PHASES and new_phase not in TERMINAL_PHASES:
        raise invalid(
            "Pod",
            str(meta(old).get("name")),
            [
                (
                    "status.phase",
                    "FieldValueForbidden",
                    f"Forbidden: cannot transition from terminal phase {old_phase} to {new_phase}",
                )
            ],
        )
    validate_pod(new)


# --------------------------------------------------------------------------------------------
# nodes


def validate_node(node: JSON) -> None:
    """Raise 422 Invalid when the node's metadata is invalid."""
    causes = _validate_meta(node, namespaced=False)
    if causes:
        raise invalid("Node", str(meta(node).get("name") or ""), causes)


def prepare_node_create(node: JSON, *, from_api: bool) -> None:
    """Nodes get no defaults beyond their system metadata."""
    node.setdefault("spec", {})
    node.setdefault("status", {})


def prepare_node_update(old: JSON, new: JSON) -> None:
    """``PUT``/``PATCH`` on a node keep its status."""
    _restore_system_meta(old, new, "Node")
    new["status"] = copy.deepcopy(old.get("status"))
    validate_node(new)


def prepare_node_status_update(old: JSON, new: JSON) -> None:
    """``PUT``/``PATCH`` on ``nodes/{name}/status`` keep its spec."""
    _restore_system_meta(old, new, "Node")
    new["spec"] = copy.deepcopy(old.get("spec"))
    validate_node(new)


DEFAULT_NODE_CAPACITY: Mapping[str, str] = {
    "cpu": "64",
    "memory": "528280892Ki",
    "pods": "110",
    "ephemeral-storage": "1921803888Ki",
    "hugepages-1Gi": "0",
    "hugepages-2Mi": "0",
}


def node_object(
    name: str,
    *,
    labels: Mapping[str, str] | None = None,
    capacity: Mapping[str, str | int] | None = None,
    allocatable: Mapping[str, str | int] | None = None,
    annotations: Mapping[str, str] | None = None,
    ready: bool = True,
    address: str = "10.0.0.10",
) -> JSON:
    """A node as a kubelet registers it: default labels, capacity, a Ready condition, node info."""
    cap = {**DEFAULT_NODE_CAPACITY, **{k: str(v) for k, v in (capacity or {}).items()}}
    alloc = {k: str(v) for k, v in allocatable.items()} if allocatable is not None else dict(cap)
    now = now_rfc3339()
    base_labels = {
        "beta.kubernetes.io/arch": "amd64",
        "beta.kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
    }
    md: JSON = {"name": name, "labels": {**base_labels, **dict(labels or {})}}
    md["annotations"] = {"node.alpha.kubernetes.io/ttl": "0", **dict(annotations or {})}

    def condition(ctype: str, status: str, reason: str, message: str) -> JSON:
        return {
            "type": ctype,
            "status": status,
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
            "reason": reason,
            "message": message,
        }

    conditions = [
        condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
        condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
        condition("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
        condition("Ready", "True", "KubeletReady", "kubelet is posting ready status")
        if ready
        else condition("Ready", "False", "KubeletNotReady", "container runtime network not ready"),
    ]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": md,
        "spec": {"podCIDR": "10.244.0.0/24", "podCIDRs": ["10.244.0.0/24"]},
        "status": {
            "capacity": cap,
            "allocatable": alloc,
            "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": address}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": uuid.uuid5(uuid.NAMESPACE_DNS, name).hex,
                "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_URL, name)).upper(),
                "bootID": str(uuid.uuid5(uuid.NAMESPACE_OID, name)),
                "kernelVersion": "5.15.0-119-generic",
                "osImage": "Ubuntu 22.04.4 LTS",
                "containerRuntimeVersion": "containerd://1.7.20",
                "kubeletVersion": "v1.31.4",
                "kubeProxyVersion": "v1.31.4",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        },
    }


# --------------------------------------------------------------------------------------------
# resource kinds


@dataclass(frozen=True)
class ResourceKind:
    """What differs between the resources the simulator serves."""

    resource: str
    kind: str
    namespaced: bool
    fields: Mapping[str, Callable[[JSON], str]]
    merge_keys: Mapping[str, str]
    validate: Callable[[JSON], None]
    prepare_create: Callable[..., None]
    prepare_update: Callable[[JSON, JSON], None]
    prepare_status_update: Callable[[JSON, JSON], None]
    short_names: Sequence[str] = ()
    group_version: str = "v1"
    """``v1`` for the core group, ``<group>/<version>`` otherwise (the objects' ``apiVersion``)."""
    drop_disabled: Callable[[JSON | None, JSON, frozenset[str]], None] | None = None
    """``(old or None, new, disabled feature gates)``: drops from ``new`` the fields of disabled gates."""

    @property
    def list_kind(self) -> str:
        """``PodList``, ``NodeList``."""
        return self.kind + "List"

    @property
    def singular(self) -> str:
        """``pod``, ``node``."""
        return self.kind.lower()


PODS = ResourceKind(
    resource="pods",
    kind="Pod",
    namespaced=True,
    fields=POD_FIELDS,
    merge_keys=POD_MERGE_KEYS,
    validate=validate_pod,
    prepare_create=prepare_pod_create,
    prepare_update=prepare_pod_update,
    prepare_status_update=prepare_pod_status_update,
    short_names=("po",),
)
NODES = ResourceKind(
    resource="nodes",
    kind="Node",
    namespaced=False,
    fields=NODE_FIELDS,
    merge_keys=NODE_MERGE_KEYS,
    validate=validate_node,
    prepare_create=prepare_node_create,
    prepare_update=prepare_node_update,
    prepare_status_update=prepare_node_status_update,
    short_names=("no",),
)
KINDS: Mapping[str, ResourceKind] = {PODS.resource: PODS, NODES.resource: NODES}


# --------------------------------------------------------------------------------------------
# test manifests


def pod_manifest(
    name: str,
    namespace: str = "default",
    node: str | None = "node-1",
    containers: Sequence[Mapping[str, Any]] | None = None,
    annotations: Mapping[str, str] | None = None,
    uid: str | None = None,
    phase: str | None = "Pending",
    *,
    labels: Mapping[str, str] | None = None,
) -> JSON:
    """A pod manifest for tests.

    ``containers`` items are ``{"name": ..., "limits": {...}, "requests": {...}, "image": ...}``
    (quantities may be ints; they become strings); the default is one container ``c0`` asking for
    half a GPU (``tencent.com/vcuda-core: 50``) and 1 GiB (``tencent.com/vcuda-memory: 4``).
    ``node=None`` leaves the pod unscheduled; ``phase=None`` leaves out the status.
    """
    if containers is None:
        containers = [{"name": "c0", "limits": {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "4"}}]
    specs: list[JSON] = []
    for item in containers:
        c: JSON = {"name": item["name"], "image": item.get("image", DEFAULT_IMAGE)}
        resources: JSON = {}
        for part in ("limits", "requests"):
            values = item.get(part)
            if values:
                resources[part] = {str(k): str(v) for k, v in values.items()}
        if resources:
            c["resources"] = resources
        for extra in ("command", "args", "env"):
            if extra in item:
                c[extra] = copy.deepcopy(item[extra])
        specs.append(c)
    md: JSON = {"name": name, "namespace": namespace}
    if labels:
        md["labels"] = dict(labels)
    if annotations:
        md["annotations"] = dict(annotations)
    if uid:
        md["uid"] = uid
    spec: JSON = {"containers": specs}
    if node:
        spec["nodeName"] = node
    pod: JSON = {"apiVersion": "v1", "kind": "Pod", "metadata": md, "spec": spec}
    if phase is not None:
        pod["status"] = {"phase": phase}
    return pod


def raise_if_name_mismatch(obj: JSON, name: str, namespace: str | None) -> None:
    """400 when the body names another object than the URL (``PUT``)."""
    md = meta(obj)
    body_name = md.get("name")
    if body_name and body_name != name:
        raise bad_request(f"the name of the object ({body_name}) does not match the name on the URL ({name})")
    md["name"] = name
    if namespace is not None:
        body_ns = md.get("namespace")
        if body_ns and body_ns != namespace:
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
        md["namespace"] = namespace


def ensure_api_error(exc: Exception) -> ApiError:
    """Wrap an unexpected exception as a 500 ``InternalError``."""
    if isinstance(exc, ApiError):
        return exc
    return ApiError(500, f"Internal error occurred: {exc}")
