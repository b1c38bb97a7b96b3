"""Is an old tree still in use? Two questions to ``/proc`` (the agent runs with ``hostPID``).

- Mapped: does any process map a file of the tree? ``/proc/<pid>/maps`` names files as the
  process sees them (container paths), so files are matched by device and inode, not by path.
- Mounted: does any mount namespace bind-mount the tree (a container started while it was the
  current one, even if none of its processes maps a file of it right now)? The root field of
  ``/proc/<pid>/mountinfo`` names the tree's directory, whatever the mount point: its path from the
  root of its file system, on that file system's device. The tree's own path and device are read
  from the agent's mount table (:func:`place_of`), so that a mount elsewhere whose path merely names
  the tree (a pod's emptyDir with the tree's name as its subPath: a container reads that name in
  its own mountinfo) does not keep an old tree for ever.
"""

from __future__ import annotations

import logging
import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Place:
    """Where a directory lies: the device of its file system (``major:minor``, as mountinfo writes it)
    and its path from that file system's root (as the root field of a mount of it reads)."""

    device: str
    path: str


@dataclass
class ProcScan:
    """What all processes map (``(st_dev, st_ino)``, with one pid) and the mounts of all mount namespaces."""

    mapped: dict[tuple[int, int], str] = field(default_factory=dict)  # (st_dev, st_ino) -> a pid
    mount_roots: set[str] = field(default_factory=set)
    mounts: set[tuple[str, str]] = field(default_factory=set)  # (device, root) of every mount
    processes: int = 0
    unreadable: list[str] = field(default_factory=list)

    def mounts_tree(self, tree_name: str, place: Place | None = None) -> str | None:
        """A mount root that is the tree or lies inside it, or None.

        ``place``: the tree's (:func:`place_of`); a mount is the tree's when it is on that device at that
        path or below. Without it (the agent's mount table unreadable) any mount root with a component
        ``tree_name`` counts: a tree is kept rather than removed under a container that uses it.
        """
        if place is None:
            return next((root for root in sorted(self.mount_roots) if tree_name in root.split("/")), None)
        inside = place.path.rstrip("/") + "/"
        for device, root in sorted(self.mounts):
            if device == place.device and (root == place.path or root.startswith(inside)):
                return root
        return None


def place_of(proc_root: Path, directory: Path) -> Place | None:
    """Where ``directory`` lies, from the agent's own mount table (``<proc_root>/self/mountinfo``): the
    mount with the longest mount point above it (the last of equals, the one on top). None when the
    table cannot be read or names none."""
    try:
        real = os.path.realpath(directory)
        with (proc_root / "self" / "mountinfo").open("rb") as stream:
            lines = stream.readlines()
    except OSError as err:
        log.debug("cannot read the agent's mount table under %s: %s", proc_root, err)
        return None
    best: tuple[str, str, str] | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 5:
            continue
        point = _unescape(fields[4])
        if real != point and not real.startswith(point.rstrip("/") + "/"):
            continue
        if best is None or len(point) >= len(best[2]):
            best = (os.fsdecode(fields[2]), _unescape(fields[3]), point)
    if best is None:
        return None
    device, root, point = best
    rel = os.path.relpath(real, point)
    return Place(device, root if rel == "." else posixpath.normpath(posixpath.join(root, rel)))


def scan_proc(proc_root: Path) -> ProcScan:
    """Read the maps of every process and the mountinfo of every mount namespace under ``proc_root``.

    Processes that exit meanwhile are ignored; those that cannot be read are listed in
    ``unreadable`` (the caller then cannot tell whether an old tree is in use). OSError when
    ``proc_root`` itself cannot be listed.
    """
    scan = ProcScan()
    namespaces: set[str] = set()
    pids = [entry for entry in os.listdir(proc_root) if entry.isdigit()]
    for pid in pids:
        base = proc_root / pid
        try:
            _read_maps(base / "maps", pid, scan.mapped)
        except PermissionError:
            scan.unreadable.append(pid)
            continue
        except OSError:  # the process is gone
            continue
        scan.processes += 1
        try:
            ns = os.readlink(base / "ns" / "mnt")
        except OSError:
            ns = f"pid:{pid}"
        if ns in namespaces:
            continue
        try:
            _read_mountinfo(base / "mountinfo", scan.mount_roots, scan.mounts)
            namespaces.add(ns)
        except PermissionError:
            scan.unreadable.append(pid)
        except OSError:
            continue
    return scan


def _read_maps(path: Path, pid: str, out: dict[tuple[int, int], str]) -> None:
    with path.open("rb") as stream:
        for line in stream:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[4] == b"0":
                continue
            try:
                major, minor = (int(part, 16) for part in fields[3].split(b":"))
                out.setdefault((os.makedev(major, minor), int(fields[4])), pid)
            except ValueError:
                continue


def _read_mountinfo(path: Path, roots: set[str], mounts: set[tuple[str, str]]) -> None:
    with path.open("rb") as stream:
        for line in stream:
            fields = line.split()
            if len(fields) > 4:
                root = _unescape(fields[3])
                roots.add(root)
                mounts.add((os.fsdecode(fields[2]), root))


def _unescape(raw: bytes) -> str:
    """Undo the kernel's octal escapes (``\\040`` for a space) in mountinfo paths."""
    if b"\\" not in raw:
        return os.fsdecode(raw)
    out = bytearray()
    i = 0
    while i < len(raw):
        if raw[i : i + 1] == b"\\" and raw[i + 1 : i + 4].isdigit() and len(raw[i + 1 : i + 4]) == 3:
            out.append(int(raw[i + 1 : i + 4], 8) & 0xFF)
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return os.fsdecode(bytes(out))
