"""Reading what the allocator needs from pod objects (plain dicts as the API server sends them).

Requests are read from ``resources.limits`` as gpu-manager does (extended
resources must have limits equal to requests, so this is the same value).
Init containers are not considered, as upstream: gpu-admission indexes
``tencent.com/predicate-gpu-idx-<i>`` by position in ``spec.containers``.
"""

from __future__ import annotations

import datetime
import functools
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from gpumanager import names, safenames
from gpumanager.dra import quantity

log = logging.getLogger(__name__)

Pod = Mapping[str, Any]


class PodSpecError(ValueError):
    """A pod carries a value the agent cannot use; the message names the pod, the field and the value."""


def pod_key(pod: Pod) -> str:
    """``namespace/name`` for messages."""
    meta = pod.get("metadata")
    if type(meta) is not dict:  # a plain dict (nearly always) without a call: these run on every Allocate
        meta = _mapping(meta)
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def namespace_name(pod: Pod) -> tuple[str, str]:
    """(namespace, name)."""
    meta = _mapping(pod.get("metadata"))
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


def uid(pod: Pod) -> str:
    """The pod's UID."""
    meta = pod.get("metadata")
    if type(meta) is not dict:
        meta = _mapping(meta)
    return str(meta.get("uid", ""))


def pod_annotations(pod: Pod) -> Mapping[str, str]:
    """The pod's annotations (never None)."""
    meta = pod.get("metadata")
    if type(meta) is not dict:
        meta = _mapping(meta)
    annotations = meta.get("annotations")
    if type(annotations) is dict:
        return annotations
    return {} if annotations is None else _mapping(annotations)  # none: no call


def _mapping(value: Any) -> Mapping[str, Any]:
    """``value`` when it is an object, else an empty one (a field of the wrong shape reads as absent)."""
    if type(value) is dict:  # dict first, then absent: the ABC check is slow
        return value
    return {} if value is None or not isinstance(value, Mapping) else value


def _objects(value: Any) -> list[Mapping[str, Any]]:
    """The objects of a list field; a null or other odd item is skipped, a field that is no list reads as empty."""
    if not isinstance(value, list):
        return []
    return [item for item in value if type(item) is dict or isinstance(item, Mapping)]


def _statuses(pod: Pod, field: str = "containerStatuses") -> list[Mapping[str, Any]]:
    return _objects(_mapping(pod.get("status")).get(field))


def _spec_list(pod: Pod, field: str) -> list[Mapping[str, Any]]:
    """``spec.<field>`` (containers or initContainers) in order; PodSpecError naming the pod when it is
    not a list of objects: a container's place in it is its index in ``predicate-gpu-idx-<i>``, so
    none is skipped."""
    spec = pod.get("spec")
    if type(spec) is not dict:
        spec = _mapping(spec)
    value = spec.get(field)
    if value is None:
        return []
    if isinstance(value, list):
        for item in value:  # a loop, not all() over a generator: a call less per container
            if type(item) is not dict and not isinstance(item, Mapping):
                break
        else:
            return value
    raise PodSpecError(f"pod {pod_key(pod)}: spec.{field} is not a list of containers: {str(value)[:80]!r}")


def containers(pod: Pod) -> list[Mapping[str, Any]]:
    """``spec.containers`` in order (PodSpecError when it is not a list of objects)."""
    return _spec_list(pod, "containers")


#: The largest quantity the API server stores (it caps larger ones).
MAX_QUANTITY = 2**63 - 1


def _quantity(pod: Pod, container: Mapping[str, Any], resource: str) -> int:
    limits = _mapping(_mapping(container.get("resources")).get("limits"))
    raw = limits.get(resource)
    if raw is None:
        return 0
    if isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) <= 18:
        return int(raw)  # the common spelling, as parse_quantity would read it
    try:
        # A quantity, as the API server answers it in canonical form: 1000 reads back as "1k". Only the
        # API server's grammar: Decimal() alone would also read "5_000", "١٢٣" and "5 k".
        value = quantity.parse(raw)
    except quantity.QuantityError:
        value = Decimal(-1)
    shown = quantity.shown(raw)
    if value.is_finite() and value > MAX_QUANTITY:
        # Checked before to_integral_value() and int(): 1e999999999 would take them minutes. The API server
        # stores no larger quantity; only a request sent straight to a component carries one.
        raise PodSpecError(
            f"pod {pod_key(pod)} container {container.get('name')}: {resource} limit {shown} is larger than "
            f"any quantity (2^63-1)"
        )
    if not value.is_finite() or value != value.to_integral_value() or value < 0:
        raise PodSpecError(
            f"pod {pod_key(pod)} container {container.get('name')}: {resource} limit {shown} is not a whole number"
        )
    return int(value)


@dataclass(frozen=True)
class GPURequest:
    """What one container asks for: vcuda-core units and vcuda-memory blocks (256 MiB each)."""

    name: str
    index: int  # position in spec.containers
    cores: int
    memory_blocks: int

    @property
    def memory_bytes(self) -> int:
        """The memory request in bytes."""
        return self.memory_blocks * names.MEMORY_BLOCK_BYTES

    @property
    def gpu_required(self) -> bool:
        """gpu-manager's IsGPURequiredContainer: some cores, and memory unless it is whole GPUs."""
        return self.cores > 0 and not (self.cores < names.HUNDRED_CORES and self.memory_blocks <= 0)

    @property
    def shared(self) -> bool:
        """A fraction of one GPU."""
        return 0 < self.cores < names.HUNDRED_CORES


def gpu_requests(pod: Pod) -> list[GPURequest]:
    """The vcuda requests of every container (zero for containers that ask for none)."""
    return [
        GPURequest(
            name=str(c.get("name", "")),
            index=i,
            cores=_quantity(pod, c, names.VCORE_RESOURCE),
            memory_blocks=_quantity(pod, c, names.VMEMORY_RESOURCE),
        )
        for i, c in enumerate(containers(pod))
    ]


def gpu_containers(pod: Pod) -> list[GPURequest]:
    """Containers that need a GPU, in spec order."""
    return [r for r in gpu_requests(pod) if r.gpu_required]


def init_gpu_requests(pod: Pod) -> list[GPURequest]:
    """The vcuda requests of ``spec.initContainers``; their index is negative (-1 for the first): no
    ``predicate-gpu-idx`` names them, gpu-admission indexes ``spec.containers`` only."""
    inits = _spec_list(pod, "initContainers")
    return [
        GPURequest(
            name=str(c.get("name", "")),
            index=-1 - i,
            cores=_quantity(pod, c, names.VCORE_RESOURCE),
            memory_blocks=_quantity(pod, c, names.VMEMORY_RESOURCE),
        )
        for i, c in enumerate(inits)
    ]


def allocation_order(pod: Pod) -> list[GPURequest]:
    """Containers that need a GPU in the order the kubelet allocates them: init containers, then the rest.

    The kubelet allocates devices to an init container too, and may hand the same device IDs on to
    an app container once the init container has run.
    """
    return [r for r in init_gpu_requests(pod) if r.gpu_required] + gpu_containers(pod)


def request_named(pod: Pod, container: str) -> GPURequest | None:
    """The request of the container (or init container) of that name."""
    return next((r for r in gpu_requests(pod) + init_gpu_requests(pod) if r.name == container), None)


def is_gpu_pod(pod: Pod) -> bool:
    """Whether any container of the pod needs a GPU (unreadable requests count as not)."""
    try:
        return bool(gpu_containers(pod))
    except PodSpecError:
        return False


def is_assigned(pod: Pod) -> bool:
    """gpu-manager's IsGPUAssignedPod: ``tencent.com/gpu-assigned`` present and not "false"."""
    value = pod_annotations(pod).get(names.GPU_ASSIGNED)
    return value is not None and value != "false"


@functools.lru_cache(maxsize=4096)
def _rfc3339_ns(text: str) -> int:
    """A creation timestamp, ``YYYY-MM-DDTHH:MM:SSZ`` as the API server writes it, in ns (0 when
    unreadable); cached: Allocate orders every pending pod by it.

    Read field by field: ``time.strptime`` loads and compiles its locale's patterns on first use,
    about 2 ms that the first Allocate after a start paid."""
    if len(text) != 20 or text[4] != "-" or text[7] != "-" or text[10] != "T" or text[13] != ":" or text[16] != ":":
        return 0
    if text[19] != "Z":
        return 0
    fields = (text[0:4], text[5:7], text[8:10], text[11:13], text[14:16], text[17:19])
    if not all(f.isascii() and f.isdigit() for f in fields):
        return 0
    year, month, day, hour, minute, second = (int(f) for f in fields)
    try:
        stamp = datetime.datetime(year, month, day, hour, minute, second, tzinfo=datetime.UTC)
    except ValueError:  # no such day or time
        return 0
    return int(stamp.timestamp()) * 1_000_000_000


def predicate_time(pod: Pod) -> int:
    """``tencent.com/predicate-time`` (ns), else the creation time in ns, as upstream orders candidates.

    The annotation is read as upstream reads it (``strconv.ParseUint(s, 10, 64)``); a value that
    does not read so (spaces, '_', a sign, other scripts' digits, past 2**64 - 1) is warned about
    once, naming the pod, the annotation and the value, and the creation time is used.
    """
    raw = pod_annotations(pod).get(names.PREDICATE_TIME)
    if raw is not None:
        value = go_parse_uint(raw) if isinstance(raw, str) else None
        if value is not None:
            return value
        _malformed_predicate_time(pod_key(pod), quantity.shown(raw))
    return _rfc3339_ns(str(_mapping(pod.get("metadata")).get("creationTimestamp", "")))


@functools.lru_cache(maxsize=1024)
def _malformed_predicate_time(who: str, shown: str) -> None:
    """Warn once per pod and value: candidates are ordered on every Allocate."""
    log.warning(
        "pod %s: annotation %s=%s is not a decimal number of nanoseconds (as gpu-admission writes it); "
        "ordering the pod by its creation time",
        who,
        names.PREDICATE_TIME,
        shown,
    )


def predicated_gpus(pod: Pod, container_index: int) -> list[int] | None:
    """Minor numbers from ``tencent.com/predicate-gpu-idx-<i>``; None when absent; PodSpecError when malformed."""
    key = f"{names.PREDICATE_GPU_IDX_PREFIX}{container_index}"
    raw = pod_annotations(pod).get(key)
    if raw is None:
        return None
    shown = quantity.shown(raw)
    if not isinstance(raw, str):
        raise PodSpecError(f"pod {pod_key(pod)}: annotation {key}={shown} is not a list of GPU indices")
    parts = [p.strip() for p in raw.split(",")]
    # ASCII digits only: str.isdigit() also takes "²" (which int() refuses) and other scripts' digits.
    # At most 18 digits (an int64, as upstream's strconv.Atoi): int() refuses more than 4300.
    if not parts or not all(p.isascii() and p.isdigit() and len(p) <= 18 for p in parts):
        raise PodSpecError(f"pod {pod_key(pod)}: annotation {key}={shown} is not a list of GPU indices")
    return [int(p) for p in parts]


def predicated_here(pod: Pod) -> bool:
    """Whether the pod's ``predicate-gpu-idx-*`` name GPUs of the node it is bound to.

    Not when ``tencent.com/predicate-node`` names another node (chosen there by a bind whose Binding
    failed, then bound here by something else), unless the agent has assigned the pod since
    (``gpu-assigned=true``: it wrote the indices it used and leaves ``predicate-node`` as it was).
    """
    chosen = pod_annotations(pod).get(names.PREDICATE_NODE)
    bound = _mapping(pod.get("spec")).get("nodeName")
    return not chosen or not bound or chosen == bound or is_assigned(pod)


def qos_class(pod: Pod) -> str | None:
    """``status.qosClass`` (None when absent or not a string): where the kubelet puts the pod's cgroup."""
    value = _mapping(pod.get("status")).get("qosClass")
    return value if isinstance(value, str) else None


def phase(pod: Pod) -> str:
    """``status.phase``."""
    status = pod.get("status")
    if type(status) is not dict:
        status = _mapping(status)
    return str(status.get("phase", ""))


def should_delete(pod: Pod) -> bool:
    """gpu-manager's ShouldDelete: PreStart failed for a container, or admission failed."""
    status = _mapping(pod.get("status"))
    if status.get("reason") == "UnexpectedAdmissionError":
        return True
    for cs in _statuses(pod):
        waiting = _mapping(_mapping(cs.get("state")).get("waiting"))
        if names.PRESTART_FAILED in str(waiting.get("message", "")):
            return True
    return False


#: The kubelet's error for a start of a container whose devices it has no record of (its
#: GetDeviceRunContainerOptions, before any plugin call): its checkpoint was lost before it restarted.
KUBELET_NO_DEVICES = "no devices found allocated in local cache"


def without_device_records(pod: Pod) -> list[tuple[str, str]]:
    """(container, message) of each container waiting because the kubelet has no record of its vcuda devices."""
    found = []
    for field in ("initContainerStatuses", "containerStatuses"):
        for cs in _statuses(pod, field):
            waiting = _mapping(_mapping(cs.get("state")).get("waiting"))
            message = str(waiting.get("message", ""))
            if KUBELET_NO_DEVICES in message and (names.VCORE_RESOURCE in message or names.VMEMORY_RESOURCE in message):
                found.append((str(cs.get("name", "")), message))
    return found


def is_terminated(pod: Pod) -> bool:
    """The pod will not run (again): Succeeded/Failed, or being deleted with no running container.

    A pod being deleted whose status names no container yet is not known to have stopped: the
    kubelet's status update lags the start of the containers, which may run until it arrives.
    """
    status = pod.get("status")
    if type(status) is not dict:
        status = _mapping(status)
    if str(status.get("phase", "")) in ("Succeeded", "Failed"):  # phase(), without the call
        return True
    meta = pod.get("metadata")
    if type(meta) is not dict:
        meta = _mapping(meta)
    if meta.get("deletionTimestamp"):
        statuses = _statuses(pod)
        return bool(statuses) and all("running" not in _mapping(cs.get("state")) for cs in statuses)
    return False


def is_deleting(pod: Pod) -> bool:
    """The pod has a deletionTimestamp: the kubelet starts none of its containers any more."""
    return bool(_mapping(pod.get("metadata")).get("deletionTimestamp"))


def is_sidecar(pod: Pod, container: str) -> bool:
    """Whether ``container`` is an init container that runs beside the others (``restartPolicy: Always``)."""
    try:
        inits = _spec_list(pod, "initContainers")
    except PodSpecError:
        return False
    return any(c.get("name") == container and c.get("restartPolicy") == "Always" for c in inits)


def container_env(container: Mapping[str, Any], name: str) -> str | None:
    """The literal value of an env var of a container spec."""
    listed = container.get("env")
    if not listed:  # none (the common case): what _objects would read as no variables
        return None
    for env in _objects(listed):
        if env.get("name") == name:
            value = env.get("value")
            return None if value is None else str(value)
    return None


def container_ids(pod: Pod, *, ephemeral: bool = False) -> dict[str, str]:
    """Container name -> runtime container ID (``containerd://<id>`` prefix removed) from the pod status.

    An ID that is not a plain token (:func:`gpumanager.safenames.container_id`: ``/`` or ``..`` in it) is
    left out, as if the status named none: it becomes part of paths (the container's directory beside
    its pod's limit files, its cgroup), and whoever may patch ``pods/status`` can write anything there.
    """
    found = {}
    statuses = _statuses(pod) + _statuses(pod, "initContainerStatuses")
    if ephemeral:  # ``kubectl debug``'s containers too (names are unique across the three lists)
        statuses += _statuses(pod, "ephemeralContainerStatuses")
    for cs in statuses:
        cid = str(cs.get("containerID") or "")
        if cid:
            bare = cid.split("://", 1)[-1]
            try:
                found[str(cs.get("name", ""))] = safenames.container_id(bare)
            except safenames.UnsafeNameError as exc:
                log.debug("pod %s container %s: %s; taken as no ID", pod_key(pod), cs.get("name", ""), exc)
    return found


def started_containers(pod: Pod) -> set[str]:
    """Names of containers the runtime has started: a container ID, or a running or terminated state."""
    found = set()
    for cs in _statuses(pod):
        state = _mapping(cs.get("state"))
        if cs.get("containerID") or "running" in state or "terminated" in state:
            found.add(str(cs.get("name", "")))
    return found


def may_run(pod: Pod) -> list[str] | None:
    """Names of the pod's containers and init containers that run or may be started (again), by its
    spec and status: all but an init container that completed (not a sidecar), and a container whose
    status says it ended where the pod's ``restartPolicy`` does not start it again (``Never``; ``OnFailure``
    after a success). A status that lags names an ended container as running: it is counted. Ephemeral
    containers (``kubectl debug``) that have not ended are counted too: one may start at any time.
    None when the pod is being deleted (the kubelet starts none of its containers) or its spec is
    malformed."""
    if is_deleting(pod):
        return None
    try:
        specs = _spec_list(pod, "containers")
        inits = _spec_list(pod, "initContainers")
        debug = _spec_list(pod, "ephemeralContainers")
    except PodSpecError:
        return None
    policy = _mapping(pod.get("spec")).get("restartPolicy") or "Always"
    ended: dict[str, int | None] = {}  # name -> exit code of a container whose status says it ended
    for cs in _statuses(pod) + _statuses(pod, "initContainerStatuses") + _statuses(pod, "ephemeralContainerStatuses"):
        terminated = _mapping(_mapping(cs.get("state")).get("terminated"))
        if terminated:
            code = terminated.get("exitCode")
            ended[str(cs.get("name", ""))] = code if isinstance(code, int) else None
    found = []
    for c in inits:
        name = str(c.get("name", ""))
        if c.get("restartPolicy") == "Always" or name not in ended:
            found.append(name)
        elif ended[name] != 0 and policy != "Never":
            found.append(name)  # a failed init container is run again
    for c in specs:
        name = str(c.get("name", ""))
        if name not in ended or policy == "Always" or (policy == "OnFailure" and ended[name] != 0):
            found.append(name)
    found += [str(c.get("name", "")) for c in debug if str(c.get("name", "")) not in ended]  # never restarted
    return found


#: What Go's strconv.Atoi takes: an optional sign, then ASCII decimal digits (no spaces, no '_').
_GO_DECIMAL = re.compile(r"[+-]?[0-9]+")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def go_atoi(text: str) -> int | None:
    """``text`` as Go's ``strconv.Atoi`` reads it (64-bit int); None where Atoi returns an error.

    Python's int() also takes surrounding spaces, '_' between digits and other scripts' digits.
    """
    if not _GO_DECIMAL.fullmatch(text):
        return None
    value = _bounded_int(text)
    return value if value is not None and _INT64_MIN <= value <= _INT64_MAX else None


def _bounded_int(text: str) -> int | None:
    """An optionally signed run of ASCII digits as an int; None past 20 significant digits (beyond any
    64-bit integer: Go's range error), leading zeros ignored as Go ignores them (int() refuses more than
    4300 digits)."""
    sign = text[0] if text[0] in "+-" else ""
    digits = text[len(sign) :].lstrip("0") or "0"
    return int(sign + digits) if len(digits) <= 20 else None


#: What Go's strconv.ParseUint(s, 10, 64) takes: ASCII decimal digits only (no sign, no spaces, no '_').
_GO_UNSIGNED = re.compile(r"[0-9]+")
_UINT64_MAX = (1 << 64) - 1


def go_parse_uint(text: str) -> int | None:
    """``text`` as Go's ``strconv.ParseUint(text, 10, 64)`` reads it; None where it returns an error."""
    if not _GO_UNSIGNED.fullmatch(text):
        return None
    value = _bounded_int(text)
    return value if value is not None and value <= _UINT64_MAX else None


def core_limit(pod: Pod) -> int | None:
    """The soft limit of ``tencent.com/vcuda-core-limit`` (capped at 100), None when absent."""
    raw = pod_annotations(pod).get(names.VCORE_LIMIT_ANNOTATION)
    if raw is None:
        return None
    value = go_atoi(raw) if isinstance(raw, str) else None
    shown = quantity.shown(raw)
    if value is None:
        raise PodSpecError(f"pod {pod_key(pod)}: annotation {names.VCORE_LIMIT_ANNOTATION}={shown} is not an integer")
    if value < 0:
        raise PodSpecError(f"pod {pod_key(pod)}: annotation {names.VCORE_LIMIT_ANNOTATION}={shown} is negative")
    return min(value, names.HUNDRED_CORES)
