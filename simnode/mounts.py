"""A simulated container's view of the paths a device plugin's answer mounts.

The runtimes (containerd's CRI, docker) apply a container's mounts ordered by the depth of their
container paths, so a parent directory is mounted before a mount nested in it (``/etc/vcuda``, then
``/etc/vcuda/<container>``); the nested one hides what the parent's directory holds there. A nested
mount's mount point must already exist in the parent mount when that one is read-only (the runtime
cannot make it: read-only file system).

No mount namespace here: :func:`host_path` translates a container path through the mounts, and
:func:`materialize` copies what a container sees under a directory into a plain directory tree (regular
files and directories; a socket is left out), for programs that take a stand-in for that directory.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Protocol


class MountLike(Protocol):
    """A mount of an answer (``pb.Mount`` or the agent's ``Mount``)."""

    @property
    def container_path(self) -> str: ...

    @property
    def host_path(self) -> str: ...


def _in_order(mounts: Iterable[MountLike]) -> list[MountLike]:
    """The mounts as the runtime applies them: by the depth of the container path, in answer order within one."""
    return sorted(mounts, key=lambda m: len(PurePosixPath(m.container_path).parts))


def _under(path: PurePosixPath, parent: PurePosixPath) -> bool:
    return path == parent or parent in path.parents


def host_path(mounts: Iterable[MountLike], container_path: str) -> Path:
    """The host path a container path lies at, through the mount applied last over it (the deepest);
    KeyError when no mount covers it."""
    wanted = PurePosixPath(container_path)
    found: Path | None = None
    for m in _in_order(mounts):
        target = PurePosixPath(m.container_path)
        if _under(wanted, target):
            found = Path(m.host_path) / wanted.relative_to(target)
    if found is None:
        raise KeyError(f"no mount covers {container_path}")
    return found


def materialize(mounts: Iterable[MountLike], container_dir: str, into: Path) -> Path:
    """Copy what the container sees under ``container_dir`` into ``into`` (made anew); returns ``into``.

    RuntimeError when a nested mount's mount point is missing below a read-only mount (the runtime would
    fail to create the container)."""
    top = PurePosixPath(container_dir)
    if into.exists():
        shutil.rmtree(into)
    covered = False
    read_only: list[PurePosixPath] = []
    for m in _in_order(mounts):
        target = PurePosixPath(m.container_path)
        if _under(top, target) and target != top:  # a mount above: the part of it below container_dir
            source = Path(m.host_path) / top.relative_to(target)
            dest = into
        elif _under(target, top):
            source, dest = Path(m.host_path), into / target.relative_to(top)
        else:
            continue
        if dest != into and not dest.is_dir() and any(_under(target, ro) for ro in read_only):
            raise RuntimeError(f"mount point {target} does not exist in a read-only mount above it")
        if dest.exists():
            shutil.rmtree(dest)
        _copy(source, dest)
        covered = True
        if getattr(m, "read_only", False):
            read_only.append(target)
    if not covered:
        raise KeyError(f"no mount covers {container_dir}")
    return into


def _copy(source: Path, dest: Path) -> None:
    """Directories and regular files of ``source`` (sockets, FIFOs and devices left out) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for entry in sorted(source.iterdir()):
        if entry.is_symlink():
            continue
        if entry.is_dir():
            _copy(entry, dest / entry.name)
        elif entry.is_file():
            shutil.copyfile(entry, dest / entry.name)
