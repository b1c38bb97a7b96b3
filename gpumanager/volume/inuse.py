"""Is an old tree still in use? Two questions to ``/proc`` (the agent runs with ``hostPID``).

- Mapped: does any process map a file of the tree? ``/proc/<pid>/maps`` names files as the
  process sees them (container paths), so files are matched by device and inode, not by path.
- Mounted: does any mount namespace bind-mount the tree (a container started while it was the
  current one, even if none of its processes maps a file of it right now)? The root field of
  ``/proc/<pid>/mountinfo`` names the tree's directory, whatever the mount point.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class ProcScan:
    """What all processes map (``(st_dev, st_ino)``, with one pid) and the mount roots of all mount namespaces."""

    mapped: dict[tuple[int, int], str] = field(default_factory=dict)  # (st_dev, st_ino) -> a pid
    mount_roots: set[str] = field(default_factory=set)
    processes: int = 0
    unreadable: list[str] = field(default_factory=list)

    def mounts_tree(self, tree_name: str) -> str | None:
        """A mount root that is ``tree_name`` or lies inside it, or None."""
        for root in self.mount_roots:
            if tree_name in root.split("/"):
                return root
        return None


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
            _read_mountinfo(base / "mountinfo", scan.mount_roots)
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


def _read_mountinfo(path: Path, out: set[str]) -> None:
    with path.open("rb") as stream:
        for line in stream:
            fields = line.split()
            if len(fields) > 4:
                out.add(_unescape(fields[3]))


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
