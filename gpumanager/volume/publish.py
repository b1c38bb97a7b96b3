"""Publishing a tree: the stable volume path becomes a symlink to it, replaced atomically.

``<base>/<volume>`` is a relative symlink ``.trees/<tree>``. A new tree is published by creating
the new symlink under a temporary name and ``rename(2)``-ing it over the old one, so the stable
path always exists and always names a complete tree. The container runtime resolves the symlink
when it creates a container's bind mount: running containers keep the tree they started with,
new containers get the new one.

An upgrade in place from tkestack gpu-manager finds ``<base>/<volume>`` as a real directory. It
is exchanged with the new symlink in one ``renameat2(RENAME_EXCHANGE)`` where the kernel and file
system support it (else renamed away first, leaving a window of microseconds without the path),
and moved into the trees directory as ``<volume>-legacy-<time>``, to be removed like any old tree.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import time
from pathlib import Path

from gpumanager.volume.errors import VolumeError
from gpumanager.volume.tree import fsync_dir

log = logging.getLogger(__name__)

AT_FDCWD = -100
RENAME_EXCHANGE = 1 << 1


def current_target(link: Path) -> str | None:
    """The target of the symlink ``link``, or None when it is no symlink."""
    try:
        return os.readlink(link)
    except OSError:
        return None


def tidy_leftovers(base: Path, trees_dir: Path) -> None:
    """Clean up after a run that died while publishing: temporary symlinks are removed, and an
    old directory left under its temporary name (after an exchange) is moved among the trees."""
    for entry in os.scandir(base):
        if not (entry.name.startswith(".") and ".new-" in entry.name):
            continue
        path = Path(entry.path)
        if entry.is_symlink() or not entry.is_dir():
            path.unlink()
        else:
            name = entry.name[1:].split(".new-", 1)[0]
            os.rename(path, trees_dir / f"{name}-legacy-{time.time_ns()}")


def publish(link: Path, target: str, trees_dir: Path) -> Path | None:
    """Make ``link`` a symlink to ``target`` (relative to ``link``'s directory), atomically.

    Returns the path of the legacy directory moved out of the way, if there was one.
    """
    if current_target(link) == target:
        return None
    tmp = link.with_name(f".{link.name}.new-{os.getpid()}")
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    os.symlink(target, tmp)
    legacy: Path | None = None
    try:
        if link.is_dir() and not link.is_symlink():
            legacy = trees_dir / f"{link.name}-legacy-{time.time_ns()}"
            if _exchange(tmp, link):
                os.rename(tmp, legacy)  # tmp now names the old directory
            else:
                os.rename(link, legacy)
                os.replace(tmp, link)
            log.info("moved the old directory %s to %s", link, legacy)
        else:
            os.replace(tmp, link)
    except OSError as err:
        raise VolumeError(f"cannot publish {link} -> {target}: {err.strerror or err}") from err
    finally:
        if tmp.is_symlink():
            tmp.unlink()
    fsync_dir(link.parent)
    return legacy


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths with renameat2(RENAME_EXCHANGE); False when that call is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))
