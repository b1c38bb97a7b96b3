"""Reading the kubelet's ``kubelet_internal_checkpoint`` (read only; every shape the kubelet has written).

Shapes, detected by structure (never by trial and error):
- current (1.20+): ``{"Data": {"PodDeviceEntries": [{..., "DeviceIDs": {"<numa>": [ids]}}], ...}, "Checksum": N}``
- 1.10-1.19: the same with ``"DeviceIDs": [ids]``
- oldest: no ``Data`` wrapper: ``{"PodDeviceEntries": [...], "RegisteredDevices": {...}}``
``PodDeviceEntries`` may be null; unknown keys (e.g. ``BootID``) are ignored and the checksum is not checked.
An entry of another resource that cannot be read is skipped (it tells nothing about ours); one of ours
makes the file unusable. Anything but a regular file, or one over :data:`MAX_BYTES`, is refused without
waiting (a FIFO in its place never blocks the reader).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import stat
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumanager import names
from gpumanager.fileio import read_regular

log = logging.getLogger(__name__)

#: The largest checkpoint read (the kubelet's for thousands of pods is a few MiB).
MAX_BYTES = 256 << 20
_OURS = frozenset({names.VCORE_RESOURCE, names.VMEMORY_RESOURCE})


class KubeletCheckpointError(ValueError):
    """The file exists but is not a kubelet device checkpoint; the message names the file and the problem."""


@dataclass(frozen=True)
class KubeletEntry:
    """One container's devices of one resource, as the kubelet recorded them."""

    pod_uid: str
    container: str
    resource: str
    device_ids: tuple[str, ...]
    alloc_resp: bytes  # serialized ContainerAllocateResponse (may be empty)


def _device_ids(raw: Any, where: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, list):
        return tuple(str(i) for i in raw)
    if isinstance(raw, Mapping):
        seen: dict[str, None] = {}
        for numa in sorted(raw, key=str):
            ids = raw[numa]
            if not isinstance(ids, list):
                raise KubeletCheckpointError(f"{where}: DeviceIDs[{numa!r}] is not a list")
            for i in ids:
                seen.setdefault(str(i))  # a device on several NUMA nodes is listed under each
        return tuple(seen)
    raise KubeletCheckpointError(f"{where}: DeviceIDs is neither a list nor a NUMA map")


def parse(data: Any, source: str = "kubelet_internal_checkpoint") -> list[KubeletEntry]:
    """Entries of an already-decoded checkpoint document."""
    if not isinstance(data, Mapping):
        raise KubeletCheckpointError(f"{source}: top level is a {type(data).__name__}, not an object")
    body = data.get("Data") if "Data" in data else data
    if body is None:
        return []
    if not isinstance(body, Mapping):
        raise KubeletCheckpointError(f"{source}: Data is not an object")
    entries = body.get("PodDeviceEntries")
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise KubeletCheckpointError(f"{source}: PodDeviceEntries is not a list")
    out = []
    for n, entry in enumerate(entries):
        where = f"{source}: PodDeviceEntries[{n}]"
        if not isinstance(entry, Mapping):
            raise KubeletCheckpointError(f"{where} is not an object")
        resource = str(entry.get("ResourceName", ""))
        try:
            out.append(_entry(entry, resource, where))
        except KubeletCheckpointError as exc:
            if not resource or resource in _OURS:  # ours, or whose it is cannot be told
                raise
            log.debug("%s (skipped: not a resource of ours)", exc)
    return out


def _entry(entry: Mapping[str, Any], resource: str, where: str) -> KubeletEntry:
    raw_resp = entry.get("AllocResp") or ""
    try:
        alloc_resp = base64.b64decode(raw_resp, validate=True) if raw_resp else b""
    except (binascii.Error, TypeError, ValueError) as exc:
        raise KubeletCheckpointError(f"{where}: AllocResp is not base64: {exc}") from exc
    return KubeletEntry(
        pod_uid=str(entry.get("PodUID", "")),
        container=str(entry.get("ContainerName", "")),
        resource=resource,
        device_ids=_device_ids(entry.get("DeviceIDs"), where),
        alloc_resp=alloc_resp,
    )


def read(path: Path) -> list[KubeletEntry]:
    """Entries of the checkpoint at ``path``; a missing file has none (a fresh node has no file yet)."""
    try:
        raw = read_regular(path, MAX_BYTES)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise KubeletCheckpointError(f"{path}: cannot read: {exc}") from exc
    return _decode(raw, path)


def _decode(raw: bytes, path: Path) -> list[KubeletEntry]:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KubeletCheckpointError(f"{path}: not JSON: {exc}") from exc
    except RecursionError:
        raise KubeletCheckpointError(f"{path}: nests its JSON too deeply to read") from None
    except ValueError as exc:  # a number too long to convert
        raise KubeletCheckpointError(f"{path}: cannot read its JSON: {exc}") from exc
    return parse(data, str(path))


def _kind(mode: int) -> str:
    return {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory", stat.S_IFSOCK: "a socket"}.get(
        stat.S_IFMT(mode), "a device or other special file"
    )


class CheckpointFile:
    """The kubelet's checkpoint at one path, parsed once per version of the file.

    The kubelet replaces the file whole (a new inode) at every change; concurrent readers of one
    version share one parse instead of each decoding every pod's entry again.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._version: tuple[int, int, int, int] | None = None
        self._entries: list[KubeletEntry] = []
        #: Times the file was read and parsed (for tests).
        self.parses = 0

    def entries(self) -> list[KubeletEntry]:
        """The entries now (a missing file has none); KubeletCheckpointError when it cannot be used."""
        with self._lock:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except FileNotFoundError:
                self._version, self._entries = None, []
                return []
            except OSError as exc:
                raise KubeletCheckpointError(f"{self.path}: cannot read: {exc}") from exc
            with open(fd, "rb") as f:
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode):
                        raise OSError(f"not a regular file ({_kind(st.st_mode)})")
                    if st.st_size > MAX_BYTES:
                        raise OSError(f"{st.st_size} bytes, more than the {MAX_BYTES} read")
                    version = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                    if version == self._version:
                        return self._entries
                    raw = f.read(MAX_BYTES + 1)
                except OSError as exc:
                    raise KubeletCheckpointError(f"{self.path}: cannot read: {exc}") from exc
            self.parses += 1
            self._entries = _decode(raw, self.path)
            self._version = version
            return self._entries


class KubeletRecords:
    """Which containers the kubelet forgot: those that had started before its last restart (or before this
    agent's start) and that its checkpoint, read then, does not list with devices of ``resource``.

    The kubelet loses its records of running containers only across its restart (its
    ``kubelet_internal_checkpoint`` removed or damaged meanwhile): it then counts their IDs free and may hand
    them to a new pod while they run on. A container it listed after its restart that it no longer lists
    later ended (a Job's pod ending by itself, its status not at the API server yet): its IDs are free for
    good. The file is read once per :meth:`note_restart`, never per question; before the first, nothing
    is known forgotten.
    """

    def __init__(self, path: Path, resource: str) -> None:
        self.path = path
        self.resource = resource
        self._lock = threading.Lock()
        self._forgotten: frozenset[tuple[str, str]] = frozenset()

    def note_restart(
        self, started: Iterable[tuple[str, str]], listed: Iterable[tuple[str, str]] | None = None
    ) -> frozenset[tuple[str, str]]:
        """The kubelet restarted (or this agent started): of the containers ``started`` now, those that
        ``listed`` (the checkpoint's (pod UID, container) holding devices of the resource; read from the file
        when None) lacks are forgotten from now on, until the next call. A file that cannot be used lists
        none, as the kubelet reading it knows none. Returns the forgotten ones."""
        if listed is None:
            try:
                entries = read(self.path)
            except KubeletCheckpointError as exc:
                log.warning("%s: read after the kubelet's restart, it names no container: %s", self.path, exc)
                entries = []
            listed = [(e.pod_uid, e.container) for e in entries if e.resource == self.resource and e.device_ids]
        known = frozenset(listed)
        forgotten = frozenset(key for key in started if key not in known)
        with self._lock:
            self._forgotten = forgotten
        if forgotten:
            log.warning(
                "%s: the kubelet has no record of %d running container(s) of %s: %s",
                self.path,
                len(forgotten),
                self.resource,
                ", ".join(f"pod {uid} container {c}" for uid, c in sorted(forgotten)),
            )
        return forgotten

    def holds(self, key: tuple[str, str]) -> bool:
        """Whether the kubelet still counts ``key``'s (pod UID, container) devices as held, as far as its
        restarts tell: False only for a container it forgot (see the class)."""
        with self._lock:
            return key not in self._forgotten


def owner_of(entries: Iterable[KubeletEntry], resource: str, device_ids: Sequence[str]) -> tuple[str, str] | None:
    """(pod UID, container) holding exactly ``device_ids`` of ``resource``."""
    wanted = frozenset(device_ids)
    for e in entries:
        if e.resource == resource and frozenset(e.device_ids) == wanted:
            return (e.pod_uid, e.container)
    return None
