"""Reading an allocated ResourceClaim: which of this node's GPUs it holds, and how much of each.

The kubelet names a claim by namespace, name and UID; the claim itself (GET from
the API server) carries ``status.allocation.devices.results``. Each result of our
driver and our pool names a device (``gpu-<index>``), an optional ``shareID`` and
``consumedCapacity`` (``cores``, ``memory``). A result without consumed capacity,
or consuming all of both, is a whole GPU (no limits). A result with ``adminAccess``
is the whole GPU too, but consumes nothing of it (the scheduler places it beside the
claims already there and does not count it), whatever its ``consumedCapacity`` says.
Every refusal names the claim, the device and the value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from gpumanager.allocation.claims import ClaimAllocation, ClaimDevice
from gpumanager.device.types import GPUInfo
from gpumanager.dra import constants as c
from gpumanager.dra.cdi import device_name as cdi_device_name
from gpumanager.dra.devices import published_memory
from gpumanager.dra.quantity import QuantityError, parse, shown
from gpumanager.topology.nodes import HUNDRED_CORES

JSON = dict[str, Any]
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a request name (a directory of the claim's)


class ClaimError(Exception):
    """A claim this node cannot prepare; the message names the claim, device and value."""


class ClaimNotFound(ClaimError):
    """The API server has no claim of that namespace and name."""


@dataclass(frozen=True)
class ClaimRef:
    """What the kubelet names: namespace, name, UID."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def tolerated(result: Mapping[str, Any], driver: str, value: str | None = None) -> bool:
    """Whether a result tolerates the driver's unhealthy taint (whose value, the cause, is ``value``).

    As everywhere in Kubernetes: an empty effect matches every effect; ``Exists`` with no key
    tolerates every taint, with the key every value of it; ``Equal`` (the default operator)
    tolerates the key only with the same value. ``value`` None: any value of the key.
    """
    key = c.taint_key(driver)
    tolerations = result.get("tolerations") or []
    for tol in tolerations if isinstance(tolerations, list) else []:
        if not isinstance(tol, Mapping):
            continue
        if tol.get("effect") not in (None, "", c.TAINT_EFFECT):
            continue
        operator = tol.get("operator") or "Equal"
        if operator == "Exists" and tol.get("key") in (None, "", key):
            return True
        if operator == "Equal" and tol.get("key") == key and (value is None or (tol.get("value") or "") == value):
            return True
    return False


def _object(value: Any, who: str, what: str) -> Mapping[str, Any]:
    """``value`` when it is an object (absent: empty); ClaimError naming the claim and the field otherwise."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ClaimError(f"{who}: {what} {str(value)[:80]!r} is not an object")
    return value


def parse_claim(
    claim: Mapping[str, Any],
    ref: ClaimRef,
    *,
    driver: str,
    pool: str,
    gpus: Sequence[GPUInfo],
    taints: Mapping[int, str] | None = None,
) -> tuple[ClaimAllocation, frozenset[int]]:
    """The claim's results on this node, and the minors whose results tolerate the unhealthy taint
    (``taints``: the taint's value, its cause, on each tainted GPU by minor; None: any value).

    Raises ClaimError for a claim whose UID differs, that is not allocated, that holds no device
    of ``driver``, or whose results name another pool, a device this node does not have, a bad
    quantity, more capacity than the device has, a share beside a whole GPU, or the shares of one
    request on several GPUs (a request's limits are one vcuda.config, for one GPU: its shares
    placed on one GPU are limited by their sum). Shares of several requests may be on different
    GPUs: each request is limited on its own, for the containers that name it.
    """
    who = f"claim {ref}"
    meta = _object(claim, who, "the claim")
    meta = _object(meta.get("metadata"), who, "metadata")
    if meta.get("uid") != ref.uid:
        raise ClaimError(f"{who}: its UID is {meta.get('uid')!r}, the kubelet asked for {ref.uid!r}")
    allocation = _object(claim.get("status"), who, "status").get("allocation")
    if not isinstance(allocation, Mapping):
        raise ClaimError(f"{who} ({ref.uid}) is not allocated (no status.allocation)")
    results = _object(allocation.get("devices"), who, "status.allocation.devices").get("results") or []
    if not isinstance(results, list):
        raise ClaimError(f"{who} ({ref.uid}): status.allocation.devices.results {results!r} is not a list")
    mine = [r for r in results if isinstance(r, Mapping) and r.get("driver") == driver]
    if not mine:
        others = ", ".join(
            f"{r.get('driver')}/{r.get('pool')}/{r.get('device')}" for r in results if isinstance(r, Mapping)
        )
        raise ClaimError(f"{who} ({ref.uid}) holds no device of driver {driver} (its devices: {others or 'none'})")
    by_name = {c.device_name(g.index): g for g in gpus}
    devices: list[ClaimDevice] = []
    tolerant: set[int] = set()
    for r in mine:
        name = str(r.get("device") or "")
        at = f"{who} ({ref.uid}) device {name!r}"
        if r.get("pool") != pool:
            raise ClaimError(f"{at}: pool {r.get('pool')!r} is not this node's ({pool!r})")
        gpu = by_name.get(name)
        if gpu is None:
            raise ClaimError(f"{at}: this node has no such device (it has {', '.join(sorted(by_name)) or 'none'})")
        devices.append(_device(r, gpu, at))
        if tolerated(r, driver, None if taints is None else taints.get(gpu.minor)):
            tolerant.add(gpu.minor)
    seen: dict[str, ClaimDevice] = {}
    for d in devices:  # each result is a CDI device of its own name: the runtime refuses a spec that repeats one
        name = cdi_device_name(ref.uid, d)
        first = seen.setdefault(name, d)
        if first is not d:
            raise ClaimError(
                f"{who} ({ref.uid}): results {first.request!r}/{first.device!r} and {d.request!r}/{d.device!r}"
                f"{f' (share {d.share_id!r})' if d.share_id else ''} are one CDI device {name!r}: a claim "
                "holds a device once per request"
            )
    shares = [d for d in devices if not d.whole]
    if shares and len(shares) < len(devices):
        listed = ", ".join(f"{d.request}/{d.device}{'' if d.whole else ' (a share)'}" for d in devices)
        raise ClaimError(
            f"{who} ({ref.uid}): {len(devices)} results ({listed}): a claim with a share must hold one device per "
            "request, and only shares (a share's limits are a vcuda.config, which holds the limits of one GPU); ask "
            "for a whole GPU in a claim of its own"
        )
    for request, held in ClaimAllocation(ref.uid, ref.namespace, ref.name, tuple(shares)).share_requests.items():
        if not _LABEL.fullmatch(request):
            raise ClaimError(f"{who} ({ref.uid}): request name {request!r} is not a DNS label")
        if len({d.minor for d in held}) > 1:
            listed = ", ".join(f"{d.request}/{d.device}" for d in held)
            raise ClaimError(
                f"{who} ({ref.uid}): request {request!r} holds shares of several GPUs ({listed}): a request's shares "
                "are limited together by one vcuda.config, which holds the limits of one GPU; keep them on one GPU "
                f"with the constraint matchAttribute: {driver}/{c.ATTR_UUID}, or ask for each share in a request of "
                "its own"
            )
    return ClaimAllocation(uid=ref.uid, namespace=ref.namespace, name=ref.name, devices=tuple(devices)), frozenset(
        tolerant
    )


def _device(result: Mapping[str, Any], gpu: GPUInfo, at: str) -> ClaimDevice:
    consumed = result.get("consumedCapacity")
    total_memory = published_memory(gpu)
    share_id = str(result.get("shareID") or "")
    if result.get("adminAccess") is True:
        return _whole(result, gpu, share_id, admin=True)
    if consumed in (None, {}):
        return _whole(result, gpu, share_id)
    if not isinstance(consumed, Mapping):
        raise ClaimError(f"{at}: consumedCapacity {consumed!r} is not a map")
    cores = _amount(consumed, c.CORES, Decimal(HUNDRED_CORES), at)
    memory = _amount(consumed, c.MEMORY, Decimal(total_memory), at)
    unknown = sorted(set(consumed) - {c.CORES, c.MEMORY})
    if unknown:
        raise ClaimError(f"{at}: consumedCapacity names {unknown}, which the device does not have")
    if cores != cores.to_integral_value() or not 1 <= cores <= HUNDRED_CORES:
        raise ClaimError(f"{at}: consumed cores {consumed.get(c.CORES)!r} is not a whole number from 1 to 100")
    if memory != memory.to_integral_value() or not 0 < memory <= total_memory:
        raise ClaimError(
            f"{at}: consumed memory {consumed.get(c.MEMORY)!r} is more than the device has ({total_memory} bytes) "
            "or not a positive number of bytes"
        )
    if cores == HUNDRED_CORES and memory == total_memory:
        return _whole(result, gpu, share_id)
    return ClaimDevice(
        request=str(result.get("request") or ""),
        pool=str(result.get("pool") or ""),
        device=str(result.get("device") or ""),
        minor=gpu.minor,
        share_id=share_id,
        cores=int(cores),
        memory=int(memory),
        whole=False,
    )


def _whole(result: Mapping[str, Any], gpu: GPUInfo, share_id: str, *, admin: bool = False) -> ClaimDevice:
    return ClaimDevice(
        request=str(result.get("request") or ""),
        pool=str(result.get("pool") or ""),
        device=str(result.get("device") or ""),
        minor=gpu.minor,
        share_id=share_id,
        cores=HUNDRED_CORES,
        memory=gpu.memory_total,
        whole=True,
        admin=admin,
    )


def _amount(consumed: Mapping[str, Any], key: str, default: Decimal, at: str) -> Decimal:
    if key not in consumed:
        return default
    try:
        return parse(consumed[key])
    except QuantityError as exc:
        raise ClaimError(f"{at}: consumed {key} {consumed[key]!r}: {exc}") from None


def config_problem(claim: Mapping[str, Any], ref: ClaimRef, held: ClaimAllocation, driver: str) -> str | None:
    """Why the claim's configuration (``status.allocation.devices.config``, from its class or itself)
    cannot be honoured, or None. The driver takes no configuration: opaque parameters addressed to it
    for a request it holds a result of (every request when the entry names none) are refused, with
    the claim, the entry and the value named, rather than dropped without a word (a user copying
    another driver's ``GpuConfig`` would run with something else than asked for). Empty parameters
    ask nothing and pass; entries of other drivers are theirs."""
    who = f"claim {ref} ({ref.uid})"
    status = claim.get("status")
    allocation = status.get("allocation") if isinstance(status, Mapping) else None
    devices = allocation.get("devices") if isinstance(allocation, Mapping) else None
    entries = devices.get("config") if isinstance(devices, Mapping) else None
    if entries is None:
        return None
    if not isinstance(entries, list):
        return f"{who}: status.allocation.devices.config {shown(entries)} is not a list"
    ours = {d.request for d in held.devices} | {d.top_request for d in held.devices}
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            return f"{who}: status.allocation.devices.config[{i}] {shown(entry)} is not an object"
        opaque = entry.get("opaque")
        if opaque is None or (isinstance(opaque, Mapping) and opaque.get("driver") != driver):
            continue
        where = f"{who}: configuration {i} ({entry.get('source') or 'no source'})"
        if not isinstance(opaque, Mapping):
            return f"{where}: opaque {shown(opaque)} is not an object"
        requests = entry.get("requests") or []
        if not isinstance(requests, list):
            return f"{where}: requests {shown(requests)} is not a list"
        if requests and not ours & {str(r) for r in requests}:
            continue
        parameters = opaque.get("parameters")
        if parameters in (None, {}):
            continue
        return (
            f"{where} gives driver {driver} parameters {shown(parameters)}: this driver takes no configuration "
            "(a share is asked for with capacity requests, cores and memory); remove the parameters from the claim "
            "or its DeviceClass"
        )
    return None
