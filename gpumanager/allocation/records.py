"""Allocation records and their checkpoint form (gpu-manager's ``gpumanager_internal_checkpoint``).

The file keeps upstream's shape so an in-place upgrade (either way) keeps every
allocation::

    {"PodGPUMapping": {"<pod uid>": {"<container>": {"Devices": ["/dev/nvidia0"],
                                                      "Cores": 50, "Memory": 2147483648}}}}

We add fields upstream ignores: ``DeviceIDs`` (the kubelet's vcuda-core IDs, to
recognise a repeated Allocate and map PreStartContainer), ``Namespace``,
``Pod``, ``Index`` (the container's position in the pod spec) and ``AnsweredAs``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

_DEVICE_RE = re.compile(r"^/dev/nvidia(\d+)$")


class RecordError(ValueError):
    """A checkpoint entry that cannot be used; the message names the pod, container and value."""


@dataclass
class ContainerAllocation:
    """The GPUs one container holds and what it asked for."""

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


def from_json(data: Any) -> tuple[list[ContainerAllocation], list[str]]:
    """Parse a checkpoint; returns the allocations and a list of problems with entries that were skipped.

    Raises RecordError when the document itself has the wrong shape.
    """
    if not isinstance(data, Mapping):
        raise RecordError(f"checkpoint is a {type(data).__name__}, not an object")
    mapping = data.get("PodGPUMapping")
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, Mapping):
        raise RecordError("PodGPUMapping is not an object")
    found: list[ContainerAllocation] = []
    problems: list[str] = []
    for pod_uid, per_container in mapping.items():
        if not isinstance(per_container, Mapping):
            problems.append(f"pod {pod_uid}: entry is not an object")
            continue
        for container, entry in per_container.items():
            where = f"pod {pod_uid} container {container}"
            try:
                if not isinstance(entry, Mapping):
                    raise RecordError(f"{where}: entry is not an object")
                devices = entry.get("Devices") or []
                if not isinstance(devices, list):
                    raise RecordError(f"{where}: Devices is not a list")
                ids = entry.get("DeviceIDs") or []
                found.append(
                    ContainerAllocation(
                        pod_uid=str(pod_uid),
                        container=str(container),
                        minors=tuple(_minor(d, where) for d in devices),
                        cores=_int(entry.get("Cores", 0), where, "Cores"),
                        memory=_int(entry.get("Memory", 0), where, "Memory"),
                        device_ids=tuple(str(i) for i in ids) if isinstance(ids, list) else (),
                        namespace=str(entry.get("Namespace", "")),
                        pod_name=str(entry.get("Pod", "")),
                        container_index=int(entry.get("Index", -1)) if isinstance(entry.get("Index"), int) else -1,
                        answered_as=_answered(entry.get("AnsweredAs")),
                    )
                )
            except RecordError as exc:
                problems.append(str(exc))
    return found, problems


def to_json(allocations: Iterable[ContainerAllocation]) -> dict[str, Any]:
    """The whole checkpoint document."""
    mapping: dict[str, dict[str, Any]] = {}
    for a in allocations:
        mapping.setdefault(a.pod_uid, {})[a.container] = a.to_json()
    return {"PodGPUMapping": mapping}
