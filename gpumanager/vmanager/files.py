"""The files the in-container library reads: ``vcuda.config`` and ``pids.config``.

``vcuda.config`` is vcuda-controller's ``struct resource_data_t`` (packed,
aligned(8), little-endian x86-64, 8240 bytes)::

    0     char pod_uid[48]          8208  uint64 gpu_memory (bytes)
    48    int  limit                8216  int    utilization (vcuda-core)
    52    char occupied[4044]       8220  int    hard_limit
    4096  char container_name[4096] 8224  int    driver major, int driver minor
    8192  char bus_id[16]           8232  int    enable; 4 bytes of padding

``pids.config`` is the container's host PIDs as native int32, sorted ascending
(the library looks them up with bsearch). Both are replaced atomically
(temp file + rename), so a reader never sees a half-written file.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import stat
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpumanager.fileio import atomic_write

CONFIG_SIZE = 8240
_takes = itertools.count()  # spares taken in this process (each gets a name of its own)
_LAYOUT = struct.Struct("<48si4044s4096s16sQiiiii4x")
assert _LAYOUT.size == CONFIG_SIZE


@dataclass(frozen=True)
class VcudaConfig:
    """The values of one container's vcuda.config."""

    pod_uid: str
    container_name: str
    gpu_memory: int
    utilization: int
    limit: int = 0
    hard_limit: int = 1
    driver_major: int = 0
    driver_minor: int = 0
    enable: int = 1
    bus_id: str = ""


def _cstr(text: str, size: int, what: str) -> bytes:
    raw = text.encode()
    if len(raw) >= size:
        raise ValueError(f"{what} {text!r} is longer than {size - 1} bytes")
    return raw


def pack(config: VcudaConfig) -> bytes:
    """The 8240-byte image of a config."""
    return _LAYOUT.pack(
        _cstr(config.pod_uid, 48, "pod UID"),
        config.limit,
        b"",
        _cstr(config.container_name, 4096, "container name"),
        _cstr(config.bus_id, 16, "bus id"),
        config.gpu_memory,
        config.utilization,
        config.hard_limit,
        config.driver_major,
        config.driver_minor,
        config.enable,
    )


def unpack(data: bytes) -> VcudaConfig:
    """Read a vcuda.config image (ValueError on a wrong size)."""
    if len(data) != CONFIG_SIZE:
        raise ValueError(f"vcuda.config is {len(data)} bytes, expected {CONFIG_SIZE}")
    uid, limit, _, name, bus, mem, util, hard, major, minor, enable = _LAYOUT.unpack(data)

    def text(b: bytes) -> str:
        return b.split(b"\0", 1)[0].decode()

    return VcudaConfig(text(uid), text(name), mem, util, limit, hard, major, minor, enable, text(bus))


def driver_version_fields(version: str) -> tuple[int, int]:
    """(major, minor) as gpu-manager derives them from ``libcuda.so.<version>``.

    The minor is the integer after the first dot, or 0 when the rest is not a plain
    integer (so ``550.54.15`` gives (550, 0), as upstream; the library ignores it).
    """
    head, _, rest = version.partition(".")
    major = int(head) if head.isascii() and head.isdigit() else 0
    minor = int(rest) if rest.isascii() and rest.isdigit() else 0
    return major, minor


def make_open_dirs(path: Path) -> None:
    """Make ``path`` and its missing parents, mode 0755 whatever the agent's umask (a container running as
    any user reaches its limit files and its socket through them); existing ones are left as they are."""
    missing: list[Path] = []
    while not os.path.isdir(path):
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o755)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise
            continue  # made meanwhile by another thread: as it made it
        os.chmod(directory, 0o755)


def spare_path(path: Path) -> Path:
    """``.<name>.spare`` beside ``path``: an empty file made ahead, filled and renamed over ``path``."""
    return path.with_name(f".{path.name}.spare")


def make_spare(path: Path) -> None:
    """Make the empty spare of ``path`` (unless something is there already), so that writing ``path``
    later creates no file: on some filesystems a new inode costs far more than the write (see
    :mod:`gpumanager.vmanager.ahead`)."""
    try:
        fd = os.open(spare_path(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return
    os.close(fd)


def _write_through_spare(path: Path, data: bytes) -> bool:
    """Take ``path``'s spare, fill it and rename it over ``path``; False when there is no usable spare.

    The spare is first renamed to a name of this call's own, so two writers never share it (one
    would otherwise truncate the file the other had just put in place).
    """
    # Names made as text: the same paths as spare_path() and with_name() give, without a Path made for each.
    head, name = os.path.split(os.fspath(path))
    mine = os.path.join(head, f".{name}.{os.getpid()}.{threading.get_ident()}.{next(_takes)}")
    try:
        os.rename(os.path.join(head, f".{name}.spare"), mine)
    except OSError:
        return False
    try:
        # O_NONBLOCK: a FIFO fails at once instead of waiting for a reader.
        fd = os.open(mine, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        _discard(mine)
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            _discard(mine)  # not a file only we made: our name of it goes, the file itself is left
            return False
        os.fchmod(fd, 0o644)
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        _discard(mine)
        raise
    finally:
        os.close(fd)
    try:
        os.rename(mine, path)
    except BaseException:
        _discard(mine)
        raise
    return True


def _discard(name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name)


def _holds(path: Path, data: bytes) -> bool:
    """Whether ``path`` is a plain file of ours (this user's, mode 0644, one name) holding exactly
    ``data``; never follows a link, never waits on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_nlink != 1
            or st.st_size != len(data)
            or stat.S_IMODE(st.st_mode) != 0o644
            or st.st_uid != os.geteuid()
        ):
            return False
        return os.read(fd, len(data) + 1) == data
    except OSError:
        return False
    finally:
        os.close(fd)


def write_config(path: Path, config: VcudaConfig, *, make_dirs: bool = True) -> None:
    """Write (or replace) a vcuda.config, atomically: through its spare when one was made ahead,
    else through a temp file. A file that holds these values already (a restarted container's) is
    left as it is: reading it costs a few microseconds, a new file and a rename ~0.3 ms or more.

    ``make_dirs=False``: a missing directory is not made (FileNotFoundError): one removed meanwhile
    (its pod gone) stays removed."""
    # Not fsynced: after a power loss the containers are gone too, and PreStart writes it again.
    data = pack(config)
    if _holds(path, data):
        return
    if _write_through_spare(path, data):
        return
    if make_dirs:
        make_open_dirs(path.parent)
        atomic_write(path, data)
        return
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _replace_in(dir_fd, path.name, data)
    finally:
        os.close(dir_fd)


def write_pids(path: Path, pids: Iterable[int], *, make_dir: bool = False) -> list[int]:
    """Write sorted int32 PIDs under an exclusive flock on the directory; returns what was written.

    The file is replaced inside the directory as it was opened: a directory removed meanwhile (its pod
    or claim gone) is not made again, the write fails (FileNotFoundError). ``make_dir``: make the
    file's directory first when missing (not its parent, the pod's or claim's directory).
    """
    ordered = sorted({int(p) for p in pids})
    data = struct.pack(f"<{len(ordered)}i", *ordered)
    if make_dir:
        try:
            os.mkdir(path.parent, 0o755)
        except FileExistsError:
            pass
        else:
            os.chmod(path.parent, 0o755)  # whatever the umask
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX)
        _replace_in(dir_fd, path.name, data)
    finally:
        os.close(dir_fd)
    return ordered


def _replace_in(dir_fd: int, name: str, data: bytes) -> None:
    """Put ``data`` in place of ``name`` in the directory ``dir_fd`` (temp file and rename, both in it)."""
    tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.{next(_takes)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    try:
        try:
            os.fchmod(fd, 0o644)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def read_pids(path: Path) -> list[int]:
    """The PIDs of a pids.config."""
    data = path.read_bytes()
    return list(struct.unpack(f"<{len(data) // 4}i", data[: len(data) // 4 * 4]))
