"""Allocation records and their checkpoint form (gpu-manager's ``gpumanager_internal_checkpoint``).

The file keeps upstream's shape so an in-place upgrade (either way) keeps every
allocation::

    {"PodGPUMapping": {"<pod uid>": {"<container>": {"Devices": ["/dev/nvidia0"],
                                                      "Cores": 50, "Memory": 2147483648}}}}

We add fields upstream ignores: ``DeviceIDs`` (the kubelet's vcuda-core IDs, to
recognise a repeated Allocate and map PreStartContainer), ``Namespace``,
``Pod``, ``Index`` (the container's position in the pod spec), ``AnsweredAs``,
``Started`` (PreStartContainer was answered) and ``Init`` (an init container that
ends before its pod's containers start).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _quoted
from typing import Any

from gpumanager import names, safenames

#: ASCII digits only (\d and int() also read other scripts' digits); no minor has more than 9: int() of 5000 raises.
_DEVICE_RE = re.compile(r"/dev/nvidia([0-9]{1,9})\Z")


#: The container's own directory ``<vm>/configs/<pod uid>/<container>``, which this version's answer mounts
#: at ``/etc/vcuda/<container>`` (checkpoint ``"Layout": "own"``).
LAYOUT_OWN = "own"
#: ``<vm>/<pod uid>/<container>``: an earlier version's answer mounts the pod's directory alone (no
#: ``Layout`` in its record, which that version never writes).
LAYOUT_POD = "pod"
#: Not known (a record rebuilt without the answer): the files go to both places, so the container reads
#: them whichever its answer mounts (``"Layout": "unknown"``).
LAYOUT_UNKNOWN = "unknown"
LAYOUTS = (LAYOUT_OWN, LAYOUT_POD, LAYOUT_UNKNOWN)


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
    # An init container that runs to its end before its pod's other containers start (not a sidecar):
    # its GPUs' charge is the larger of it and what those containers hold there together.
    init: bool = False
    # A static pod's config hash (its mirror pod's ``kubernetes.io/config.mirror``): the kubelet's pod, which
    # outlives the deletion of its mirror pod, the API object made again under a new UID.
    mirror: str = ""
    # Where the answer the runtime got puts the container's limit files (see LAYOUTS): this version's
    # answers mount the container's own directory; a record without the field is an earlier version's.
    layout: str = LAYOUT_OWN
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        """(pod UID, container name)."""
        return (self.pod_uid, self.container)

    @property
    def answered(self) -> tuple[str, str]:
        """(pod UID, container) of the answer the runtime got: its /etc/vcuda directory and config name."""
        return self.answered_as if self.answered_as[0] else (self.pod_uid, self.container)

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
        answered = self.answered_as
        if answered[0] and answered != (self.pod_uid, self.container):  # self.answered != self.key
            entry["AnsweredAs"] = list(answered)
        if self.started:
            entry["Started"] = True
        if self.init:
            entry["Init"] = True
        if self.mirror:
            entry["Mirror"] = self.mirror
        if self.layout != LAYOUT_POD:
            entry["Layout"] = self.layout
        return entry

    def to_json_text(self) -> str | None:
        """:meth:`to_json` as compact JSON with sorted keys, exactly as ``json.dumps(self.to_json(),
        sort_keys=True, separators=(",", ":"))`` writes it (ASCII, escapes and all), made by one
        template: the journal record of every Allocate holds it. None when a field is not of its
        plain type (the caller then encodes :meth:`to_json`)."""
        cores, memory, index = self.cores, self.memory, self.container_index
        if type(cores) is not int or type(memory) is not int or type(index) is not int:
            return None  # e.g. a bool, which JSON spells otherwise
        answered = self.answered_as
        if len(answered) != 2:
            return None
        try:  # the quoting takes strings only (as the encoder writes them); anything else: None
            parts = []
            if answered[0] and answered != (self.pod_uid, self.container):
                parts.append(f'"AnsweredAs":[{_quoted(answered[0])},{_quoted(answered[1])}]')
            parts.append(f'"Cores":{cores}')
            if self.device_ids:
                parts.append('"DeviceIDs":[' + ",".join([_quoted(d) for d in self.device_ids]) + "]")
            parts.append('"Devices":[' + ",".join([_quoted(d) for d in self.devices]) + "]")
            if index >= 0:
                parts.append(f'"Index":{index}')
            if self.init:
                parts.append('"Init":true')
            if self.layout != LAYOUT_POD:
                parts.append(f'"Layout":{_quoted(self.layout)}')
            parts.append(f'"Memory":{memory}')
            if self.mirror:
                parts.append(f'"Mirror":{_quoted(self.mirror)}')
            if self.namespace:
                parts.append(f'"Namespace":{_quoted(self.namespace)}')
            if self.pod_name:
                parts.append(f'"Pod":{_quoted(self.pod_name)}')
        except TypeError:
            return None
        if self.started:
            parts.append('"Started":true')
        return "{" + ",".join(parts) + "}"


#: Upstream's Cores and Memory are Go int64s, and vcuda.config holds the memory limit as a uint64.
_INT64_MAX = (1 << 63) - 1
#: A container's position in its pod spec (a Kubernetes list index: an int32).
_INDEX_MAX = (1 << 31) - 1


def _shown(value: object) -> str:
    """``repr(value)``, cut short for a log line."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def device_minor(device: object) -> int | None:
    """The minor number of a GPU's device node ``/dev/nvidia<N>`` (ASCII digits); None for anything else."""
    m = _DEVICE_RE.match(device) if isinstance(device, str) else None
    return int(m.group(1)) if m is not None else None


def _minor(device: object, where: str) -> int:
    minor = device_minor(device)
    if minor is None:
        raise RecordError(f"{where}: device {_shown(device)} is not /dev/nvidia<N>")
    return minor


def _int(value: object, where: str, what: str, *, low: int = 0, high: int = _INT64_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RecordError(f"{where}: {what} {_shown(value)} is not an integer from {low} to {high}")
    return value


def _minors(entry: Mapping[str, Any], where: str) -> tuple[int, ...]:
    devices = entry.get("Devices")
    if not isinstance(devices, list) or not devices:
        raise RecordError(f"{where}: Devices {_shown(devices)} is not a list of devices")
    minors = tuple(_minor(d, where) for d in devices)
    if len(set(minors)) != len(minors):
        raise RecordError(f"{where}: Devices {_shown(devices)} names a GPU more than once")
    return minors


def _cores(entry: Mapping[str, Any], where: str, gpus: int) -> int:
    """Cores as an Allocate answers them: 1-99 of one GPU, or 100 per GPU for whole GPUs."""
    if "Cores" not in entry:
        raise RecordError(f"{where}: Cores is missing")
    cores = _int(entry["Cores"], where, "Cores", low=1)
    if gpus == 1 and cores < names.HUNDRED_CORES:
        return cores
    if cores != names.HUNDRED_CORES * gpus:
        raise RecordError(
            f"{where}: Cores {cores} for {gpus} GPU(s): neither a share of one GPU nor {names.HUNDRED_CORES} per GPU"
        )
    return cores


def _strings(entry: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = entry.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise RecordError(f"{where}: {key} {_shown(value)} is not a list of strings")
    return tuple(value)


def _string(entry: Mapping[str, Any], key: str, where: str) -> str:
    value = entry.get(key, "")
    if not isinstance(value, str):
        raise RecordError(f"{where}: {key} {_shown(value)} is not a string")
    return value


def _answered(entry: Mapping[str, Any], where: str) -> tuple[str, str]:
    """``AnsweredAs``: the (pod UID, container) whose directory the answer mounts; both become paths."""
    if "AnsweredAs" not in entry:
        return ("", "")
    raw = entry["AnsweredAs"]
    if not isinstance(raw, list) or len(raw) != 2 or not all(isinstance(v, str) for v in raw):
        raise RecordError(f"{where}: AnsweredAs {_shown(raw)} is not a [pod UID, container] pair")
    try:
        return (safenames.pod_uid(raw[0]), safenames.container_name(raw[1]))
    except safenames.UnsafeNameError as exc:
        raise RecordError(f"{where}: AnsweredAs: {exc}") from None


def _layout(entry: Mapping[str, Any], where: str) -> str:
    """``Layout``: missing in an earlier version's record (its answers mount the pod's directory alone)."""
    if "Layout" not in entry:
        return LAYOUT_POD
    value = entry["Layout"]
    if not isinstance(value, str) or value not in (LAYOUT_OWN, LAYOUT_UNKNOWN):
        raise RecordError(f"{where}: Layout {_shown(value)} is not {LAYOUT_OWN!r} or {LAYOUT_UNKNOWN!r}")
    return value


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
    """One container's entry, every field checked: upstream's (``Devices``, ``Cores``, ``Memory``) must be
    there; ours may be missing (upstream's file), never of another type. Keys neither knows are ignored."""
    where = f"pod {pod_uid} container {container}"
    try:
        safenames.pod_uid(pod_uid)
        safenames.container_name(container)
    except safenames.UnsafeNameError as exc:
        raise RecordError(f"{where}: {exc}") from None
    if not isinstance(entry, Mapping):
        raise RecordError(f"{where}: entry {_shown(entry)} is not an object")
    minors = _minors(entry, where)
    if "Memory" not in entry:
        raise RecordError(f"{where}: Memory is missing")
    started = entry.get("Started", False)
    if not isinstance(started, bool):
        raise RecordError(f"{where}: Started {_shown(started)} is not true or false")
    init = entry.get("Init", False)
    if not isinstance(init, bool):
        raise RecordError(f"{where}: Init {_shown(init)} is not true or false")
    return ContainerAllocation(
        pod_uid=pod_uid,
        container=container,
        minors=minors,
        cores=_cores(entry, where, len(minors)),
        memory=_int(entry["Memory"], where, "Memory"),
        device_ids=_strings(entry, "DeviceIDs", where),
        namespace=_string(entry, "Namespace", where),
        pod_name=_string(entry, "Pod", where),
        container_index=_int(entry["Index"], where, "Index", high=_INDEX_MAX) if "Index" in entry else -1,
        answered_as=_answered(entry, where),
        started=started,
        init=init,
        mirror=_string(entry, "Mirror", where),
        layout=_layout(entry, where),
    )


def _salvage(entry: Any) -> tuple[int, ...]:
    devices = entry.get("Devices") if isinstance(entry, Mapping) else None
    if not isinstance(devices, list):
        return ()
    found = [minor for d in devices if (minor := device_minor(d)) is not None]
    return tuple(dict.fromkeys(found)) if len(found) == len(devices) else ()


#: The top-level keys of a checkpoint document besides PodGPUMapping that this agent writes (prepared claims,
#: allocations freed before their start, the journal segment continuing the snapshot).
DOCUMENT_KEYS = frozenset({"PodGPUMapping", "Claims", "FreedUnstarted", "JournalSegment"})


def from_json(data: Any, origins: Mapping[tuple[str, str], str] | None = None) -> Parsed:
    """Parse a checkpoint entry by entry; a bad entry is listed as untrusted, never silently dropped.

    ``origins``: where an entry was read when not from the snapshot ((pod UID, container) -> a journal
    record's file and offset), named in its problem. Raises RecordError when the document itself has the
    wrong shape.
    """
    if not isinstance(data, Mapping):
        raise RecordError(f"checkpoint is a {type(data).__name__}, not an object")
    if "PodGPUMapping" not in data:
        # Upstream's file and ours always carry it (upstream's may be null): without it, keys of no layout
        # this agent knows are another program's state (a newer version's, left by a downgrade), not "no
        # allocations"; read as empty, the first snapshot written would replace it.
        unknown = sorted(str(k) for k in data if k not in DOCUMENT_KEYS)
        if unknown:
            shown = ", ".join(repr(k) for k in unknown[:8])
            if len(unknown) > 8:
                shown += f" and {len(unknown) - 8} more"
            raise RecordError(
                f"no PodGPUMapping, but {shown}: not a layout this agent reads (a newer version's, left by a "
                "downgrade?)"
            )
    mapping = data.get("PodGPUMapping")
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, Mapping):
        raise RecordError("PodGPUMapping is not an object")
    parsed = Parsed()
    for pod_uid, per_container in mapping.items():
        if not isinstance(per_container, Mapping):
            parsed.problems.append(f"pod {pod_uid}: entry {_shown(per_container)} is not an object")
            parsed.untrusted.append((str(pod_uid), ""))
            continue
        for container, entry in per_container.items():
            try:
                parsed.allocations.append(_entry(str(pod_uid), str(container), entry))
            except RecordError as exc:
                origin = origins.get((str(pod_uid), str(container))) if origins else None
                parsed.problems.append(f"{exc} (the {origin})" if origin else str(exc))
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


def freed_from_json(
    data: Any, *, key: str, newest: int | None = None
) -> tuple[dict[frozenset[str], list[ContainerAllocation]], list[str]]:
    """Allocations freed before their container started, by their device IDs, from the document's ``key``
    (``{"<IDs>": {"<pod uid>": {"<container>": <entry>}}}``), and what was skipped and why. Each entry is
    checked as in ``PodGPUMapping`` and must hold the IDs it is kept under; an unusable one is skipped (it is
    only a hint for a container that may start with those IDs). ``newest``: only the last that many sets of
    IDs are read (the others, older, counted in one problem)."""
    found: dict[frozenset[str], list[ContainerAllocation]] = {}
    problems: list[str] = []
    remembered = data.get(key) if isinstance(data, Mapping) else None
    if remembered is None:
        return found, problems
    if not isinstance(remembered, Mapping):
        return found, [f"{key} {_shown(remembered)} is not an object"]
    items = list(remembered.items())
    if newest is not None and len(items) > newest:
        problems.append(
            f"{key} holds {len(items)} sets of IDs; the {len(items) - newest} older than the newest {newest}"
        )
        items = items[len(items) - newest :]
    for ids, per_pod in items:
        if not isinstance(per_pod, Mapping) or len(per_pod) != 1:
            problems.append(f"{key} {_shown(ids)}: {_shown(per_pod)} is not one pod's entries")
            continue
        pod_uid, per_container = next(iter(per_pod.items()))
        if not isinstance(per_container, Mapping) or not per_container:
            problems.append(f"{key} {_shown(ids)}: pod {pod_uid}: {_shown(per_container)} is not its entries")
            continue
        same: list[ContainerAllocation] = []
        for container, entry in per_container.items():
            try:
                alloc = _entry(str(pod_uid), str(container), entry)
            except RecordError as exc:
                problems.append(f"{key} {_shown(ids)}: {exc}")
                continue
            if not alloc.device_ids or ",".join(sorted(alloc.device_ids)) != ids:
                problems.append(f"{key} {_shown(ids)}: pod {pod_uid} container {container} holds other device IDs")
                continue
            same.append(alloc)
        if same:
            found[frozenset(same[0].device_ids)] = same
    return found, problems
