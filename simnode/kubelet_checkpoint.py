"""Writers for the kubelet device-manager checkpoint file ``kubelet_internal_checkpoint``.

The kubelet keeps this JSON file next to the device-plugin sockets. Its Go structs carry no json
tags, so the keys are the Go field names. Three shapes exist in the wild:

* V1 (Kubernetes <= 1.19): ``DeviceIDs`` is a flat list of device IDs.
* V2 (Kubernetes >= 1.20): ``DeviceIDs`` maps a NUMA node id (as a JSON string) to the device IDs
  on that node; devices without topology sit under ``"-1"``, a device on several nodes appears
  under each.
* V2 with ``BootID``: the newest kubelets add an optional top-level ``BootID`` next to ``Data``
  and ``Checksum``.

``Checksum``: the real kubelet stores an FNV-32a hash of a Go ``spew`` dump of ``Data``, which
cannot reasonably be reproduced outside Go. The value written here is :func:`simulated_checksum`
(CRC-32 of a canonical JSON dump of ``Data``; a hash loop in Python would cost tens of
milliseconds per write with a few hundred pods, where the kubelet spends well under one): a
plain integer that readers must ignore, and that a real kubelet would reject as corrupt. Do not
feed these files to a real kubelet.

Like Go's ``encoding/json``, the writers emit compact JSON, sort map keys (NUMA ids sort as
strings, so ``"-1"`` comes first), base64-encode ``AllocResp`` with padding, and encode an empty
entry list as ``null`` (the kubelet builds it as a nil slice), unless told otherwise.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumanager.fileio import atomic_write

CHECKPOINT_FILE = "kubelet_internal_checkpoint"
"""File name of the checkpoint inside the device-plugin directory."""

NODE_WITHOUT_TOPOLOGY = -1
"""The fake NUMA node the kubelet files topology-less devices under."""

__all__ = [
    "CHECKPOINT_FILE",
    "NODE_WITHOUT_TOPOLOGY",
    "CheckpointEntry",
    "CheckpointV2Writer",
    "atomic_write_text",
    "checkpoint_data",
    "checkpoint_v1",
    "checkpoint_v2",
    "dump_checkpoint",
    "simulated_checksum",
    "write_checkpoint_v1",
    "write_checkpoint_v2",
    "write_checkpoint_v2_boot_id",
]


@dataclass(frozen=True)
class CheckpointEntry:
    """One ``PodDeviceEntries`` element: the devices of one resource of one container."""

    pod_uid: str
    container_name: str
    resource_name: str
    device_ids: Mapping[int, Sequence[str]] = field(default_factory=dict)
    """NUMA node id -> device IDs on that node (``-1`` for devices without topology)."""
    alloc_resp: bytes = b""
    """The serialized ``ContainerAllocateResponse`` the plugin returned for this container."""

    @classmethod
    def from_flat(
        cls,
        pod_uid: str,
        container_name: str,
        resource_name: str,
        device_ids: Iterable[str],
        alloc_resp: bytes = b"",
        *,
        numa_node: int = NODE_WITHOUT_TOPOLOGY,
    ) -> CheckpointEntry:
        """Build an entry whose devices all sit on one NUMA node (default: no topology)."""
        return cls(pod_uid, container_name, resource_name, {numa_node: list(device_ids)}, alloc_resp)

    def flat_device_ids(self) -> list[str]:
        """All device IDs of the entry, each once, in NUMA-node then listed order."""
        seen: dict[str, None] = {}
        for node in sorted(self.device_ids):
            for dev in self.device_ids[node]:
                seen.setdefault(dev, None)
        return list(seen)


def _alloc_resp_b64(entry: CheckpointEntry) -> str:
    return base64.b64encode(entry.alloc_resp).decode("ascii")


def _registered(registered_devices: Mapping[str, Iterable[str]]) -> dict[str, list[str]]:
    return {res: list(registered_devices[res]) for res in sorted(registered_devices)}


def _entries_json(rows: list[dict[str, Any]], null_when_empty: bool) -> list[dict[str, Any]] | None:
    if not rows and null_when_empty:
        return None
    return rows


def checkpoint_data(
    entries: Iterable[CheckpointEntry],
    registered_devices: Mapping[str, Iterable[str]],
    *,
    v1: bool = False,
    null_when_empty: bool = True,
) -> dict[str, Any]:
    """Return the ``Data`` object of a checkpoint (V2 shape, or V1 when ``v1`` is true)."""
    rows: list[dict[str, Any]] = []
    for e in entries:
        ids: Any
        if v1:
            ids = e.flat_device_ids()
        else:
            ids = {str(node): list(e.device_ids[node]) for node in sorted(e.device_ids, key=str)}
        rows.append(
            {
                "PodUID": e.pod_uid,
                "ContainerName": e.container_name,
                "ResourceName": e.resource_name,
                "DeviceIDs": ids,
                "AllocResp": _alloc_resp_b64(e),
            }
        )
    return {
        "PodDeviceEntries": _entries_json(rows, null_when_empty),
        "RegisteredDevices": _registered(registered_devices),
    }


def simulated_checksum(data: Mapping[str, Any]) -> int:
    """CRC-32 of canonical JSON of ``data``. Not the kubelet's checksum (see module docstring)."""
    return zlib.crc32(json.dumps(data, sort_keys=True, separators=(",", ":")).encode())


def checkpoint_v2(
    entries: Iterable[CheckpointEntry],
    registered_devices: Mapping[str, Iterable[str]],
    *,
    checksum: int | None = None,
    boot_id: str | None = None,
    null_when_empty: bool = True,
) -> dict[str, Any]:
    """Return the whole V2 checkpoint object (with a top-level ``BootID`` when ``boot_id`` is given)."""
    data = checkpoint_data(entries, registered_devices, null_when_empty=null_when_empty)
    doc: dict[str, Any] = {
        "Data": data,
        "Checksum": simulated_checksum(data) if checksum is None else checksum,
    }
    if boot_id:
        doc["BootID"] = boot_id
    return doc


def checkpoint_v1(
    entries: Iterable[CheckpointEntry],
    registered_devices: Mapping[str, Iterable[str]],
    *,
    checksum: int | None = None,
    null_when_empty: bool = True,
) -> dict[str, Any]:
    """Return the whole V1 checkpoint object (flat ``DeviceIDs`` lists)."""
    data = checkpoint_data(entries, registered_devices, v1=True, null_when_empty=null_when_empty)
    return {"Data": data, "Checksum": simulated_checksum(data) if checksum is None else checksum}


def dump_checkpoint(doc: Mapping[str, Any]) -> str:
    """Serialize a checkpoint object the way Go's ``json.Marshal`` lays it out (compact)."""
    return json.dumps(doc, separators=(",", ":"))


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename."""
    atomic_write(Path(path), text.encode("utf-8"), durable=True)


def _target(path: Path) -> Path:
    path = Path(path)
    return path / CHECKPOINT_FILE if path.is_dir() else path


def write_checkpoint_v2(
    path: Path,
    entries: Iterable[CheckpointEntry],
    registered_devices: Mapping[str, Iterable[str]],
    *,
    checksum: int | None = None,
    null_when_empty: bool = True,
) -> Path:
    """Atomically write a V2 checkpoint; ``path`` is the file or its directory. Returns the file path."""
    target = _target(path)
    doc = checkpoint_v2(entries, registered_devices, checksum=checksum, null_when_empty=null_when_empty)
    atomic_write_text(target, dump_checkpoint(doc))
    return target


class CheckpointV2Writer:
    """Writes V2 checkpoints of a state that changes an entry or two at a time, as the kubelet does after
    every allocation, producing exactly :func:`write_checkpoint_v2`'s text.

    Each entry's JSON (in both key orders: as written, and sorted for :func:`simulated_checksum`) and
    the registered devices' JSON are made once and joined: with 10,000 registered device IDs (16 GPUs)
    and a few hundred entries, encoding everything twice per write took this simulator ~10 ms, where
    the kubelet spends well under one. Entries are immutable and a registered-devices mapping is never
    changed in place (a new one comes with a new device list), so both are remembered by identity.
    """

    def __init__(self) -> None:
        # id(entry) -> (entry, as written, sorted), each row's JSON encoded once
        self._rows: dict[int, tuple[CheckpointEntry, bytes, bytes]] = {}
        self._registered: tuple[Mapping[str, Iterable[str]] | None, bytes] = (None, b"")

    def text(self, entries: Sequence[CheckpointEntry], registered_devices: Mapping[str, Iterable[str]]) -> str:
        """The checkpoint's text (``null_when_empty``, no BootID, the simulated checksum)."""
        return self.data(entries, registered_devices).decode()

    def data(self, entries: Sequence[CheckpointEntry], registered_devices: Mapping[str, Iterable[str]]) -> bytes:
        """:meth:`text`, encoded: the bytes written. The checksum is taken over the canonical dump piece
        by piece, never joined (with 10,000 device IDs that dump is a few hundred kilobytes)."""
        if self._registered[0] is not registered_devices:
            dump = json.dumps(_registered(registered_devices), separators=(",", ":")).encode()
            self._registered = (registered_devices, dump)
        registered = self._registered[1]
        rows = [self._row(e) for e in entries]
        if len(self._rows) > 2 * len(entries) + 64:
            keep = {id(e) for e in entries}
            self._rows = {k: v for k, v in self._rows.items() if k in keep}
        # Data's two keys are in sorted order either way; the checksum is over the canonical dump.
        crc = zlib.crc32(b'{"PodDeviceEntries":')
        if rows:
            crc = zlib.crc32(b"[", crc)
            for i, row in enumerate(rows):
                crc = zlib.crc32(row[2], zlib.crc32(b",", crc) if i else crc)
            crc = zlib.crc32(b"]", crc)
        else:
            crc = zlib.crc32(b"null", crc)
        crc = zlib.crc32(b"}", zlib.crc32(registered, zlib.crc32(b',"RegisteredDevices":', crc)))
        plain = b"[" + b",".join(r[1] for r in rows) + b"]" if rows else b"null"
        return b"".join(
            (b'{"Data":{"PodDeviceEntries":', plain, b',"RegisteredDevices":', registered, b'},"Checksum":%d}' % crc)
        )

    def _row(self, entry: CheckpointEntry) -> tuple[CheckpointEntry, bytes, bytes]:
        known = self._rows.get(id(entry))
        if known is None or known[0] is not entry:
            (row,) = checkpoint_data([entry], {})["PodDeviceEntries"]
            compact = (",", ":")
            known = (
                entry,
                json.dumps(row, separators=compact).encode(),
                json.dumps(row, sort_keys=True, separators=compact).encode(),
            )
            self._rows[id(entry)] = known
        return known

    def write(
        self, path: Path, entries: Sequence[CheckpointEntry], registered_devices: Mapping[str, Iterable[str]]
    ) -> Path:
        """Atomically write the checkpoint; ``path`` is the file or its directory. Returns the file path."""
        target = _target(path)
        atomic_write(target, self.data(entries, registered_devices), durable=True)
        return target


def write_checkpoint_v2_boot_id(
    path: Path,
    entries: Iterable[CheckpointEntry],
    registered_devices: Mapping[str, Iterable[str]],
    boot_id: str,
    *,
    checksum: int | None = None,
    null_when_empty: bool = True,
) -> Path:
    """Atomically write a V2 checkpoint carrying the newest kubelets' top-level ``BootID``."""
    target = _target(path)
    doc = checkpoint_v2(
        entries, registered_devices, checksum=checksum, boot_id=boot_id, null_when_empty=null_when_empty
    )
    atomic_write_text(target, dump_checkpoint(doc))
    return target


def write_checkpoint_v1(
    path: Path,
    entries: Iterable[CheckpointEntry],
    registered_devices: Mapping[str, Iterable[str]],
    *,
    checksum: int | None = None,
    null_when_empty: bool = True,
) -> Path:
    """Atomically write a V1 (Kubernetes <= 1.19) checkpoint with flat ``DeviceIDs`` lists."""
    target = _target(path)
    doc = checkpoint_v1(entries, registered_devices, checksum=checksum, null_when_empty=null_when_empty)
    atomic_write_text(target, dump_checkpoint(doc))
    return target
