"""The ``resource.k8s.io/v1`` kinds of the API-server simulator: DeviceClass, ResourceSlice,
ResourceClaim (with ``/status``), ResourceClaimTemplate.

Kept from the real server (what a DRA driver or scheduler can trip over):

* quantities are answered in canonical form (``81920Mi`` reads back as ``80Gi``; see
  :mod:`simnode.apiserver_quantity`);
* a ResourceSlice whose capacity ``requestPolicy`` has a ``default`` or ``max`` off the ``step``
  grid, a ``requestPolicy`` on a device without ``allowMultipleAllocations``, more than 128
  devices (64 when a device has taints), more than 32 attributes and capacities per device, a
  string attribute longer than 64 bytes, a device taint whose value is not a label value or
  whose effect is unknown: 422 Invalid, naming the field;
* field selectors on ResourceSlices: only ``metadata.name``, ``spec.nodeName``, ``spec.driver``;
* a ResourceClaim's (and template's) spec is immutable; an allocation, once set, can only be
  removed, not changed; ``reservedFor`` holds at most 256 entries;
* defaulting of ``exactly.allocationMode`` (``ExactCount``) and ``count`` (1).

Feature gates named off (``ApiServerSimulator(disabled_features=...)``) drop the ResourceSlice
fields they guard, as the real server does (:func:`drop_disabled_slice_fields`), and
``DRAConsumableCapacity`` those of claims and templates (:func:`drop_disabled_claim_fields`).

Not modelled: ``metadata.generation``, CEL validation of selectors at admission (they are
evaluated by the scheduler stand-in), ``firstAvailable`` sub-requests, admin access, device taint
rules, binding conditions.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from typing import Any

from simnode.apiserver_errors import invalid
from simnode.apiserver_objects import ResourceKind, _restore_system_meta, _validate_meta, meta
from simnode.apiserver_quantity import QuantityError, canonical, value
from simnode.apiserver_selectors import valid_label_value

JSON = dict[str, Any]
Cause = tuple[str, str, str]

GROUP = "resource.k8s.io"
VERSION = "v1"
GROUP_VERSION = f"{GROUP}/{VERSION}"

MAX_DEVICES = 128
MAX_DEVICES_WITH_TAINTS = 64
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_STRING_ATTRIBUTE = 64
MAX_RESERVED_FOR = 256
TAINT_EFFECTS = ("NoSchedule", "NoExecute")

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_ATTRIBUTE_TYPES = ("bool", "int", "string", "version")


def _str_field(*keys: str) -> Callable[[JSON], str]:
    def get(obj: JSON) -> str:
        cur: Any = obj
        for key in keys:
            cur = cur.get(key) if isinstance(cur, dict) else None
        return "" if cur is None else str(cur)

    return get


_NAME_FIELDS: Mapping[str, Callable[[JSON], str]] = {"metadata.name": _str_field("metadata", "name")}
_NAMESPACED_FIELDS: Mapping[str, Callable[[JSON], str]] = {
    **_NAME_FIELDS,
    "metadata.namespace": _str_field("metadata", "namespace"),
}
SLICE_FIELDS: Mapping[str, Callable[[JSON], str]] = {
    **_NAME_FIELDS,
    "spec.nodeName": _str_field("spec", "nodeName"),
    "spec.driver": _str_field("spec", "driver"),
}
"""The only fields the real server selects ResourceSlices on."""


def _raise(kind: str, obj: JSON, causes: list[Cause]) -> None:
    if causes:
        raise invalid(kind, str(meta(obj).get("name") or ""), causes)


def _canonical_at(container: Any, key: str, path: str, causes: list[Cause]) -> Any:
    """Replace ``container[key]`` by its canonical quantity; returns the exact value (or None)."""
    if not isinstance(container, dict) or key not in container or container[key] is None:
        return None
    try:
        exact = value(container[key])
        container[key] = canonical(container[key])
    except QuantityError as exc:
        causes.append((path, "FieldValueInvalid", f"Invalid value: {container[key]!r}: {exc}"))
        return None
    return exact


# --------------------------------------------------------------------------------------------
# DeviceClass


def validate_device_class(obj: JSON) -> None:
    """Metadata, and every selector must carry a CEL expression."""
    causes = _validate_meta(obj, namespaced=False)
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        causes.append(("spec", "FieldValueRequired", "Required value"))
    else:
        for i, sel in enumerate(spec.get("selectors") or []):
            expr = (sel or {}).get("cel", {}).get("expression") if isinstance(sel, dict) else None
            if not isinstance(expr, str) or not expr.strip():
                causes.append((f"spec.selectors[{i}].cel.expression", "FieldValueRequired", "Required value"))
    _raise("DeviceClass", obj, causes)


def _prepare_plain_create(obj: JSON, *, from_api: bool) -> None:
    obj.setdefault("spec", {})


def _prepare_class_update(old: JSON, new: JSON) -> None:
    _restore_system_meta(old, new, "DeviceClass")
    validate_device_class(new)


# --------------------------------------------------------------------------------------------
# ResourceSlice


def _check_attribute(name: str, attr: Any, path: str, causes: list[Cause]) -> None:
    if "/" in name:
        domain, _, short = name.partition("/")
        if not _DNS_SUBDOMAIN.match(domain) or not _C_IDENTIFIER.match(short):
            causes.append((path, "FieldValueInvalid", f"Invalid value: {name!r}: must be <domain>/<C identifier>"))
    elif not _C_IDENTIFIER.match(name):
        causes.append((path, "FieldValueInvalid", f"Invalid value: {name!r}: must be a C identifier"))
    if not isinstance(attr, dict):
        causes.append((path, "FieldValueRequired", "Required value: exactly one value must be specified"))
        return
    kinds = [k for k in _ATTRIBUTE_TYPES if attr.get(k) is not None]
    if len(kinds) != 1:
        causes.append((path, "FieldValueInvalid", "Invalid value: exactly one value must be specified"))
        return
    if kinds[0] == "string" and len(str(attr["string"]).encode()) > MAX_STRING_ATTRIBUTE:  # bytes, as Go's len
        causes.append(
            (f"{path}.string", "FieldValueTooLong", f"Too long: may not be more than {MAX_STRING_ATTRIBUTE} bytes")
        )
    if kinds[0] == "int" and (isinstance(attr["int"], bool) or not isinstance(attr["int"], int)):
        causes.append((f"{path}.int", "FieldValueInvalid", f"Invalid value: {attr['int']!r}: must be an integer"))


def _check_capacity(name: str, cap: Any, path: str, multi: bool, causes: list[Cause]) -> None:
    if not isinstance(cap, dict):
        causes.append((path, "FieldValueRequired", "Required value"))
        return
    total = _canonical_at(cap, "value", f"{path}.value", causes)
    if total is None and "value" not in cap:
        causes.append((f"{path}.value", "FieldValueRequired", "Required value"))
    policy = cap.get("requestPolicy")
    if policy is None:
        return
    if not multi:
        causes.append(
            (
                f"{path}.requestPolicy",
                "FieldValueForbidden",
                "Forbidden: requestPolicy may only be set when allowMultipleAllocations is true",
            )
        )
        return
    default = _canonical_at(policy, "default", f"{path}.requestPolicy.default", causes)
    rng = policy.get("validRange")
    values = policy.get("validValues")
    if rng is not None and values is not None:
        causes.append((f"{path}.requestPolicy", "FieldValueForbidden", "Forbidden: validRange and validValues"))
    if isinstance(rng, dict):
        lo = _canonical_at(rng, "min", f"{path}.requestPolicy.validRange.min", causes)
        hi = _canonical_at(rng, "max", f"{path}.requestPolicy.validRange.max", causes)
        step = _canonical_at(rng, "step", f"{path}.requestPolicy.validRange.step", causes)
        if lo is None:
            causes.append((f"{path}.requestPolicy.validRange.min", "FieldValueRequired", "Required value"))
            return
        if hi is not None and hi < lo:
            causes.append((f"{path}.requestPolicy.validRange.max", "FieldValueInvalid", "Invalid value: less than min"))
        if total is not None and hi is not None and hi > total:
            causes.append(
                (f"{path}.requestPolicy.validRange.max", "FieldValueInvalid", "Invalid value: more than the capacity")
            )
        if default is not None and (default < lo or (hi is not None and default > hi)):
            causes.append((f"{path}.requestPolicy.default", "FieldValueInvalid", "Invalid value: outside validRange"))
        if step is not None:
            if step <= 0:
                causes.append((f"{path}.requestPolicy.validRange.step", "FieldValueInvalid", "Invalid value: <= 0"))
                return
            for label, amount in (("default", default), ("validRange.max", hi)):
                if amount is not None and (amount - lo) % step != 0:
                    causes.append(
                        (
                            f"{path}.requestPolicy.{label}",
                            "FieldValueInvalid",
                            f"Invalid value: {canonical(str(amount))}: must be a multiple of step "
                            f"{canonical(str(step))} above min {canonical(str(lo))}",
                        )
                    )
    if isinstance(values, list):
        if len(values) > 10:
            causes.append((f"{path}.requestPolicy.validValues", "FieldValueTooMany", "Too many: must have at most 10"))
        exact = []
        for j, item in enumerate(values):
            holder = {"v": item}
            v = _canonical_at(holder, "v", f"{path}.requestPolicy.validValues[{j}]", causes)
            values[j] = holder["v"]
            if v is not None:
                exact.append(v)
        if exact != sorted(set(exact)):
            causes.append((f"{path}.requestPolicy.validValues", "FieldValueInvalid", "Invalid value: not ascending"))


def _check_taint(taint: Any, path: str, causes: list[Cause]) -> None:
    if not isinstance(taint, dict) or not taint.get("key"):
        causes.append((f"{path}.key", "FieldValueRequired", "Required value"))
        return
    val = taint.get("value")
    if val not in (None, "") and not valid_label_value(str(val)):
        causes.append(
            (
                f"{path}.value",
                "FieldValueInvalid",
                f"Invalid value: {val!r}: a valid label must be an empty string or consist of alphanumeric "
                "characters, '-', '_' or '.', and must start and end with an alphanumeric character",
            )
        )
    if taint.get("effect") not in TAINT_EFFECTS:
        causes.append(
            (
                f"{path}.effect",
                "FieldValueNotSupported",
                f'Unsupported value: {taint.get("effect")!r}: supported values: "NoExecute", "NoSchedule"',
            )
        )


def validate_resource_slice(obj: JSON) -> None:
    """The ResourceSlice rules listed in the module docstring (422 naming every bad field)."""
    causes = _validate_meta(obj, namespaced=False)
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        _raise("ResourceSlice", obj, [*causes, ("spec", "FieldValueRequired", "Required value")])
        return
    if not spec.get("driver"):
        causes.append(("spec.driver", "FieldValueRequired", "Required value"))
    pool = spec.get("pool")
    if not isinstance(pool, dict) or not pool.get("name"):
        causes.append(("spec.pool.name", "FieldValueRequired", "Required value"))
    elif not isinstance(pool.get("resourceSliceCount"), int) or pool["resourceSliceCount"] < 1:
        causes.append(("spec.pool.resourceSliceCount", "FieldValueInvalid", "Invalid value: must be greater than 0"))
    elif not isinstance(pool.get("generation", 0), int) or pool.get("generation", 0) < 0:
        causes.append(("spec.pool.generation", "FieldValueInvalid", "Invalid value: must be non-negative"))
    selectors = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(k)]
    if len(selectors) != 1:
        causes.append(
            (
                "spec",
                "FieldValueRequired",
                "Required value: exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` "
                "is required",
            )
        )
    devices = spec.get("devices") or []
    limit = MAX_DEVICES_WITH_TAINTS if any((d or {}).get("taints") for d in devices) else MAX_DEVICES
    if len(devices) > limit:
        causes.append(("spec.devices", "FieldValueTooMany", f"Too many: {len(devices)}: must have at most {limit}"))
    names: set[str] = set()
    for i, dev in enumerate(devices):
        path = f"spec.devices[{i}]"
        if not isinstance(dev, dict):
            causes.append((path, "FieldValueRequired", "Required value"))
            continue
        name = str(dev.get("name") or "")
        if not _DNS_LABEL.match(name) or len(name) > 63:
            causes.append((f"{path}.name", "FieldValueInvalid", f"Invalid value: {name!r}: must be a DNS label"))
        elif name in names:
            causes.append((f"{path}.name", "FieldValueDuplicate", f"Duplicate value: {name!r}"))
        names.add(name)
        attrs = dev.get("attributes") or {}
        caps = dev.get("capacity") or {}
        if len(attrs) + len(caps) > MAX_ATTRIBUTES_AND_CAPACITIES:
            causes.append((path, "FieldValueTooMany", "Too many: attributes and capacity together must be at most 32"))
        for key, attr in attrs.items():
            _check_attribute(key, attr, f"{path}.attributes[{key}]", causes)
        multi = dev.get("allowMultipleAllocations") is True
        for key, cap in caps.items():
            _check_capacity(key, cap, f"{path}.capacity[{key}]", multi, causes)
        for j, taint in enumerate(dev.get("taints") or []):
            _check_taint(taint, f"{path}.taints[{j}]", causes)
    _raise("ResourceSlice", obj, causes)


def drop_disabled_slice_fields(old: JSON | None, new: JSON, disabled: frozenset[str]) -> None:
    """What the real server does with a ResourceSlice's fields of a feature gate that is off: it drops
    them without an error, unless the stored slice already uses them. ``DRADeviceTaints``: device
    ``taints``; ``DRAConsumableCapacity``: ``allowMultipleAllocations`` and capacity ``requestPolicy``."""

    def devices(obj: JSON | None) -> list[JSON]:
        return [d for d in ((obj or {}).get("spec") or {}).get("devices") or [] if isinstance(d, dict)]

    old_devices = devices(old)
    if "DRADeviceTaints" in disabled and not any(d.get("taints") for d in old_devices):
        for dev in devices(new):
            dev.pop("taints", None)
    if "DRAConsumableCapacity" in disabled and not any(
        d.get("allowMultipleAllocations") is not None
        or any(isinstance(c, dict) and c.get("requestPolicy") for c in (d.get("capacity") or {}).values())
        for d in old_devices
    ):
        for dev in devices(new):
            dev.pop("allowMultipleAllocations", None)
            for cap in (dev.get("capacity") or {}).values():
                if isinstance(cap, dict):
                    cap.pop("requestPolicy", None)


def _claim_capacity_fields(claim_spec: Any, status: Any, *, drop: bool) -> bool:
    """Whether a claim's spec (``spec``, or a template's ``spec.spec``) and status use the fields of
    ``DRAConsumableCapacity``: capacity requests, ``distinctAttribute`` constraints, results' ``shareID``
    and ``consumedCapacity``, ``status.devices[].shareID``; with ``drop``, removes them."""
    used = False

    def take(holder: Any, key: str) -> None:
        nonlocal used
        if isinstance(holder, dict) and key in holder:
            used = True
            if drop:
                holder.pop(key)

    devices = (claim_spec or {}).get("devices") if isinstance(claim_spec, dict) else None
    if isinstance(devices, dict):
        for req in devices.get("requests") or []:
            if not isinstance(req, dict):
                continue
            take(req.get("exactly"), "capacity")
            for sub in req.get("firstAvailable") or []:
                take(sub, "capacity")
        for constraint in devices.get("constraints") or []:
            take(constraint, "distinctAttribute")
    if isinstance(status, dict):
        allocation = status.get("allocation")
        results = ((allocation or {}).get("devices") or {}).get("results") if isinstance(allocation, dict) else None
        for result in results or []:
            take(result, "shareID")
            take(result, "consumedCapacity")
        for device in status.get("devices") or []:
            take(device, "shareID")
    return used


def drop_disabled_claim_fields(old: JSON | None, new: JSON, disabled: frozenset[str]) -> None:
    """What the real server does with a ResourceClaim's fields of ``DRAConsumableCapacity`` when the gate
    is off: drops them without an error (capacity requests and ``distinctAttribute`` from the spec,
    ``shareID`` and ``consumedCapacity`` from the allocation), unless the stored claim already uses them."""
    if "DRAConsumableCapacity" not in disabled:
        return
    if old is not None and _claim_capacity_fields(old.get("spec"), old.get("status"), drop=False):
        return
    _claim_capacity_fields(new.get("spec"), new.get("status"), drop=True)


def drop_disabled_template_fields(old: JSON | None, new: JSON, disabled: frozenset[str]) -> None:
    """:func:`drop_disabled_claim_fields` for a ResourceClaimTemplate (its claim spec is ``spec.spec``)."""
    if "DRAConsumableCapacity" not in disabled:
        return
    if old is not None and _claim_capacity_fields((old.get("spec") or {}).get("spec"), None, drop=False):
        return
    _claim_capacity_fields((new.get("spec") or {}).get("spec"), None, drop=True)


def _prepare_slice_update(old: JSON, new: JSON) -> None:
    _restore_system_meta(old, new, "ResourceSlice")
    validate_resource_slice(new)


# --------------------------------------------------------------------------------------------
# ResourceClaim and ResourceClaimTemplate


def _check_claim_spec(spec: Any, path: str, causes: list[Cause]) -> None:
    """Defaults and checks ``spec`` of a claim (``spec.spec`` of a template) in place."""
    if not isinstance(spec, dict):
        return
    devices = spec.get("devices") or {}
    requests = devices.get("requests") or []
    seen: set[str] = set()
    for i, req in enumerate(requests):
        rpath = f"{path}.devices.requests[{i}]"
        if not isinstance(req, dict):
            causes.append((rpath, "FieldValueRequired", "Required value"))
            continue
        name = str(req.get("name") or "")
        if not _DNS_LABEL.match(name):
            causes.append((f"{rpath}.name", "FieldValueInvalid", f"Invalid value: {name!r}: must be a DNS label"))
        if name in seen:
            causes.append((f"{rpath}.name", "FieldValueDuplicate", f"Duplicate value: {name!r}"))
        seen.add(name)
        exactly = req.get("exactly")
        if (exactly is None) == (req.get("firstAvailable") is None):
            causes.append((rpath, "FieldValueRequired", "Required value: exactly one of `exactly` or `firstAvailable`"))
            continue
        if exactly is None:
            continue
        if not exactly.get("deviceClassName"):
            causes.append((f"{rpath}.exactly.deviceClassName", "FieldValueRequired", "Required value"))
        mode = exactly.setdefault("allocationMode", "ExactCount")
        if mode == "ExactCount":
            exactly.setdefault("count", 1)
            if not isinstance(exactly["count"], int) or exactly["count"] < 1:
                causes.append((f"{rpath}.exactly.count", "FieldValueInvalid", "Invalid value: must be greater than 0"))
        elif mode != "All":
            causes.append((f"{rpath}.exactly.allocationMode", "FieldValueNotSupported", f"Unsupported value: {mode!r}"))
        wanted = ((exactly.get("capacity") or {}).get("requests")) or {}
        for key in list(wanted):
            _canonical_at(wanted, key, f"{rpath}.exactly.capacity.requests[{key}]", causes)
    for i, con in enumerate(devices.get("constraints") or []):
        cpath = f"{path}.devices.constraints[{i}]"
        attr = (con or {}).get("matchAttribute") or (con or {}).get("distinctAttribute")
        if not attr or "/" not in str(attr):
            causes.append(
                (f"{cpath}.matchAttribute", "FieldValueInvalid", f"Invalid value: {attr!r}: must be fully qualified")
            )
        for r in (con or {}).get("requests") or []:
            if r not in seen:
                causes.append((f"{cpath}.requests", "FieldValueInvalid", f"Invalid value: {r!r}: no such request"))


def _check_claim_status(status: Any, causes: list[Cause]) -> None:
    if not isinstance(status, dict):
        return
    reserved = status.get("reservedFor") or []
    if len(reserved) > MAX_RESERVED_FOR:
        causes.append(("status.reservedFor", "FieldValueTooMany", f"Too many: must have at most {MAX_RESERVED_FOR}"))
    results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
    for i, res in enumerate(results):
        consumed = (res or {}).get("consumedCapacity") or {}
        for key in list(consumed):
            _canonical_at(consumed, key, f"status.allocation.devices.results[{i}].consumedCapacity[{key}]", causes)


def validate_claim(obj: JSON) -> None:
    """A ResourceClaim's metadata, spec (defaulted) and status."""
    causes = _validate_meta(obj, namespaced=True)
    _check_claim_spec(obj.get("spec"), "spec", causes)
    _check_claim_status(obj.get("status"), causes)
    _raise("ResourceClaim", obj, causes)


def _prepare_claim_create(obj: JSON, *, from_api: bool) -> None:
    obj.setdefault("spec", {})
    if from_api:
        obj.pop("status", None)


def _immutable_spec(old: JSON, new: JSON, kind: str) -> None:
    """422 when the spec changes (compared after defaulting, as the real server does)."""
    if new.get("spec") == old.get("spec"):
        return
    scratch = copy.deepcopy(new.get("spec"))
    claim_spec = scratch if kind == "ResourceClaim" else (scratch or {}).get("spec")
    _check_claim_spec(claim_spec, "spec", [])
    if scratch != old.get("spec"):
        raise invalid(
            kind, str(meta(new).get("name") or ""), [("spec", "FieldValueInvalid", "Invalid value: field is immutable")]
        )
    new["spec"] = scratch


def _prepare_claim_update(old: JSON, new: JSON) -> None:
    _restore_system_meta(old, new, "ResourceClaim")
    _immutable_spec(old, new, "ResourceClaim")
    new["status"] = copy.deepcopy(old.get("status"))
    if new["status"] is None:
        new.pop("status")
    validate_claim(new)


def _prepare_claim_status_update(old: JSON, new: JSON) -> None:
    _restore_system_meta(old, new, "ResourceClaim")
    new["spec"] = copy.deepcopy(old.get("spec"))
    causes: list[Cause] = []
    _check_claim_status(new.get("status"), causes)
    _raise("ResourceClaim", new, causes)
    before = (old.get("status") or {}).get("allocation")
    after = (new.get("status") or {}).get("allocation")
    if before is not None and after is not None and before != after:
        raise invalid(
            "ResourceClaim",
            str(meta(new).get("name") or ""),
            [("status.allocation", "FieldValueInvalid", "Invalid value: field is immutable once set")],
        )
    validate_claim(new)


def validate_claim_template(obj: JSON) -> None:
    """A ResourceClaimTemplate's metadata and ``spec.spec`` (defaulted)."""
    causes = _validate_meta(obj, namespaced=True)
    spec = obj.get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("spec"), dict):
        causes.append(("spec.spec", "FieldValueRequired", "Required value"))
    else:
        _check_claim_spec(spec["spec"], "spec.spec", causes)
    _raise("ResourceClaimTemplate", obj, causes)


def _prepare_template_update(old: JSON, new: JSON) -> None:
    _restore_system_meta(old, new, "ResourceClaimTemplate")
    _immutable_spec(old, new, "ResourceClaimTemplate")
    validate_claim_template(new)


def _no_status(old: JSON, new: JSON) -> None:
    raise invalid(
        str(old.get("kind", "")),
        str(meta(old).get("name") or ""),
        [("status", "FieldValueForbidden", "Forbidden: this resource has no status subresource")],
    )


DEVICE_CLASSES = ResourceKind(
    resource="deviceclasses",
    kind="DeviceClass",
    namespaced=False,
    fields=_NAME_FIELDS,
    merge_keys={},
    validate=validate_device_class,
    prepare_create=_prepare_plain_create,
    prepare_update=_prepare_class_update,
    prepare_status_update=_no_status,
    group_version=GROUP_VERSION,
)
RESOURCE_SLICES = ResourceKind(
    resource="resourceslices",
    kind="ResourceSlice",
    namespaced=False,
    fields=SLICE_FIELDS,
    merge_keys={},
    validate=validate_resource_slice,
    prepare_create=_prepare_plain_create,
    prepare_update=_prepare_slice_update,
    prepare_status_update=_no_status,
    group_version=GROUP_VERSION,
    drop_disabled=drop_disabled_slice_fields,
)
RESOURCE_CLAIMS = ResourceKind(
    resource="resourceclaims",
    kind="ResourceClaim",
    namespaced=True,
    fields=_NAMESPACED_FIELDS,
    merge_keys={},
    validate=validate_claim,
    prepare_create=_prepare_claim_create,
    prepare_update=_prepare_claim_update,
    prepare_status_update=_prepare_claim_status_update,
    group_version=GROUP_VERSION,
    drop_disabled=drop_disabled_claim_fields,
)
RESOURCE_CLAIM_TEMPLATES = ResourceKind(
    resource="resourceclaimtemplates",
    kind="ResourceClaimTemplate",
    namespaced=True,
    fields=_NAMESPACED_FIELDS,
    merge_keys={},
    validate=validate_claim_template,
    prepare_create=_prepare_plain_create,
    prepare_update=_prepare_template_update,
    prepare_status_update=_no_status,
    group_version=GROUP_VERSION,
    drop_disabled=drop_disabled_template_fields,
)
RESOURCE_KINDS: Mapping[str, ResourceKind] = {
    k.resource: k for k in (DEVICE_CLASSES, RESOURCE_SLICES, RESOURCE_CLAIMS, RESOURCE_CLAIM_TEMPLATES)
}
GROUP_KINDS: Mapping[str, Mapping[str, ResourceKind]] = {GROUP_VERSION: RESOURCE_KINDS}
"""Served API groups beyond the core group: ``<group>/<version>`` -> resource name -> kind."""

_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


def api_group_list() -> JSON:
    """``GET /apis``."""
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [
            {
                "name": GROUP,
                "versions": [{"groupVersion": GROUP_VERSION, "version": VERSION}],
                "preferredVersion": {"groupVersion": GROUP_VERSION, "version": VERSION},
            }
        ],
    }


def discovery_document(path: str) -> JSON | None:
    """``GET /apis/resource.k8s.io`` and ``/apis/resource.k8s.io/v1``; None for other paths."""
    clean = path.rstrip("/")
    if clean == f"/apis/{GROUP}":
        return {"kind": "APIGroup", "apiVersion": "v1", **api_group_list()["groups"][0]}
    if clean != f"/apis/{GROUP_VERSION}":
        return None
    resources: list[JSON] = []
    for kind in RESOURCE_KINDS.values():
        resources.append(
            {
                "name": kind.resource,
                "singularName": kind.singular,
                "namespaced": kind.namespaced,
                "kind": kind.kind,
                "verbs": _VERBS,
            }
        )
        if kind is RESOURCE_CLAIMS:
            resources.append(
                {
                    "name": "resourceclaims/status",
                    "singularName": "",
                    "namespaced": True,
                    "kind": "ResourceClaim",
                    "verbs": ["get", "patch", "update"],
                }
            )
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": GROUP_VERSION, "resources": resources}
