"""Allocation records and their checkpoint form (gpu-manager's ``gpumanager_internal_checkpoint``).

The file keeps upstream's shape so an in-place upgrade (either way) keeps every
allocation::

    {"PodGPUMapping": {"<pod uid>": {"<container>": {"Devices": ["/dev/nvidia0"],
                                                      "Cores": 50, "Memory": 2147483648}}}}

We add fields upstream ignores: ``DeviceIDs`` (the kubelet's vcuda-core IDs, to
recognise a repeated Allocate and map PreStartContainer), ``Namespace``,
``Pod``, ``Index`` (the container's position in the pod spec), ``AnsweredAs`` and
``Started`` (PreStartContainer was answered).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpumanager import safenames

_DEVICE_RE = re.compile(r"^/dev/nvidia(\d{1,9})$")  # no minor has more digits: int() of 5000 raises


class RecordError(ValueError):
    """A checkpoint entry that cannot be used; the message names the pod, container and value."""


@dataclass(frozen=True)
class ContainerAllocation:
    """The GPUs one container holds and what it asked for.

    Frozen: the allocator replaces a record to change it, so a record it hands out stays as it was
    (``extra`` too is never changed once the record is made).
    """

    pod_uid: str
    container: str
    minors: tuple[int, ...]
    cores: int
    memory: int  # bytes
    device_ids: tuple[str, ...] = ()
    namespace: str = ""
    pod_name: str = ""
    container_index: int = -1
    # (pod UID, container) the Allocate answer was built for; differs from the key after a swap
    # repaired at PreStartContainer, and names the directory mounted at /etc/vcuda.
    answered_as: tuple[str, str] = ("", "")
    # PreStartContainer has been answered for it: the container has started at least once.
    started: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        """(pod UID, container name)."""
        return (self.pod_uid, self.container)

    @property
    def answered(self) -> tuple[str, str]:
        """(pod UID, container) of the answer the runtime got: its /etc/vcuda directory and config name."""
        return self.answered_as if self.answered_as[0] else self.key

    @property
    def devices(self) -> list[str]:
        """Host device paths, ``/dev/nvidia<minor>``."""
        return [f"/dev/nvidia{m}" for m in self.minors]

    @property
    def shared(self) -> bool:
        """A fraction of one GPU."""
        return self.cores < 100

    def to_json(self) -> dict[str, Any]:
        """The checkpoint entry (upstream's fields first, then ours)."""
        entry: dict[str, Any] = {"Devices": self.devices, "Cores": self.cores, "Memory": self.memory}
        if self.device_ids:
            entry["DeviceIDs"] = list(self.device_ids)
        if self.namespace:
            entry["Namespace"] = self.namespace
        if self.pod_name:
            entry["Pod"] = self.pod_name
        if self.container_index >= 0:
            entry["Index"] = self.container_index
        if self.answered != self.key:
            entry["AnsweredAs"] = list(self.answered)
        if self.started:
            entry["Started"] = True
        return entry


def _minor(device: object, where: str) -> int:
    m = _DEVICE_RE.match(str(device))
    if m is None:
        raise RecordError(f"{where}: device {device!r} is not /dev/nvidia<N>")
    return int(m.group(1))


def _int(value: object, where: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RecordError(f"{where}: {what} {value!r} is not a non-negative integer")
    return value


def _answered(raw: Any) -> tuple[str, str]:
    if isinstance(raw, list) and len(raw) == 2:
        return (str(raw[0]), str(raw[1]))
    return ("", "")


@dataclass
class Parsed:
    """A checkpoint read entry by entry: what can be trusted, and what must be rebuilt."""

    allocations: list[ContainerAllocation] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: (pod UID, container) of entries that cannot be trusted: rebuilt from the kubelet's records.
    untrusted: list[tuple[str, str]] = field(default_factory=list)
    #: GPU minors still readable from an untrusted entry's ``Devices`` (to reserve if nothing else says).
    salvaged: dict[tuple[str, str], tuple[int, ...]] = field(default_factory=dict)
    #: The journal had damage (besides a last write cut short): some change may be missing.
    journal_damaged: bool = False


def _entry(pod_uid: str, container: str, entry: Any) -> ContainerAllocation:
    where = f"pod {pod_uid} container {container}"
    try:
        safenames.pod_uid(pod_uid)
        safenames.container_name(container)
    except safenames.UnsafeNameError as exc:
        raise RecordError(f"{where}: {exc}") from None
    if not isinstance(entry, Mapping):
        raise RecordError(f"{where}: entry is not an object")
    devices = entry.get("Devices") or []
    if not isinstance(devices, list) or not devices:
        raise RecordError(f"{where}: Devices {devices!r} is not a list of devices")
    ids = entry.get("DeviceIDs") or []
    return ContainerAllocation(
        pod_uid=pod_uid,
        container=container,
        minors=tuple(_minor(d, where) for d in devices),
        cores=_int(entry.get("Cores", 0), where, "Cores"),
        memory=_int(entry.get("Memory", 0), where, "Memory"),
        device_ids=tuple(str(i) for i in ids) if isinstance(ids, list) else (),
        namespace=str(entry.get("Namespace", "")),
        pod_name=str(entry.get("Pod", "")),
        container_index=int(entry.get("Index", -1)) if isinstance(entry.get("Index"), int) else -1,
        answered_as=_answered(entry.get("AnsweredAs")),
        started=entry.get("Started") is True,
    )


def _salvage(entry: Any) -> tuple[int, ...]:
    devices = entry.get("Devices") if isinstance(entry, Mapping) else None
    if not isinstance(devices, list):
        return ()
    found = [m for d in devices if (m := _DEVICE_RE.match(str(d)))]
    return tuple(int(m.group(1)) for m in found) if len(found) == len(devices) else ()


def from_json(data: Any) -> Parsed:
    """Parse a checkpoint entry by entry; a bad entry is listed as untrusted, never silently dropped.

    Raises RecordError when the document itself has the wrong shape.
    """
    if not isinstance(data, Mapping):
        raise RecordError(f"checkpoint is a {type(data).__name__}, not an object")
    mapping = data.get("PodGPUMapping")
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, Mapping):
        raise RecordError("PodGPUMapping is not an object")
    parsed = Parsed()
    for pod_uid, per_container in mapping.items():
        if not isinstance(per_container, Mapping):
            parsed.problems.append(f"pod {pod_uid}: entry is not an object")
            parsed.untrusted.append((str(pod_uid), ""))
            continue
        for container, entry in per_container.items():
            try:
                parsed.allocations.append(_entry(str(pod_uid), str(container), entry))
            except RecordError as exc:
                parsed.problems.append(str(exc))
                parsed.untrusted.append((str(pod_uid), str(container)))
                minors = _salvage(entry)
                if minors:
                    parsed.salvaged[(str(pod_uid), str(container))] = minors
    return parsed


def to_json(allocations: Iterable[ContainerAllocation]) -> dict[str, Any]:
    """The whole checkpoint document."""
    mapping: dict[str, dict[str, Any]] = {}
    for a in allocations:
        mapping.setdefault(a.pod_uid, {})[a.container] = a.to_json()
    return {"PodGPUMapping": mapping}
