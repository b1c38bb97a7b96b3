"""Writing a planned tree into a fresh directory, and its manifest.

A tree is only ever written while it is a private staging directory; once published it is never
modified. Files are created with ``O_EXCL`` (an existing file is never opened for writing), so a
file that a running container maps can never change under it. A tree is complete when its
manifest ``<trees>/<name>.json`` exists; the manifest is written after everything else is on disk.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumanager.volume.discovery import Identity, identity_of
from gpumanager.volume.errors import SourceChangedError, VolumeError
from gpumanager.volume.mirror import DIRS, TreePlan, usable_name

log = logging.getLogger(__name__)

MANIFEST_FORMAT = 1
DIR_MODE = 0o755
OWN_FILE_MODE = 0o755
_CHUNK = 1 << 20
_NO_RANGE_COPY = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM)


@dataclass(frozen=True)
class Manifest:
    """What a complete tree holds and where it came from."""

    name: str
    volume: str
    fingerprint: str
    driver_version: str | None
    entries: dict[str, dict[str, Any]]

    def to_json(self) -> str:
        """The manifest as JSON text."""
        return json.dumps(
            {
                "format": MANIFEST_FORMAT,
                "name": self.name,
                "volume": self.volume,
                "fingerprint": self.fingerprint,
                "driver_version": self.driver_version,
                "entries": self.entries,
            },
            indent=1,
            sort_keys=True,
        )


def manifest_path(tree: Path) -> Path:
    """The manifest file of ``tree`` (beside it, so containers never see it)."""
    return tree.with_name(tree.name + ".json")


def read_manifest(tree: Path) -> Manifest | None:
    """The manifest of ``tree``, or None when it is missing or unreadable (an incomplete tree)."""
    try:
        raw = json.loads(manifest_path(tree).read_text(encoding="utf-8"))
        if raw.get("format") != MANIFEST_FORMAT:
            return None
        return Manifest(
            name=str(raw["name"]),
            volume=str(raw["volume"]),
            fingerprint=str(raw["fingerprint"]),
            driver_version=raw.get("driver_version"),
            entries=dict(raw["entries"]),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def verify_tree(tree: Path, manifest: Manifest) -> str | None:
    """Check that ``tree`` still holds what its manifest lists; returns what is wrong, or None."""
    for directory in ("", *DIRS):
        try:
            mode = stat.S_IMODE(os.stat(tree / directory).st_mode)
        except OSError:
            return f"{directory or 'the tree'} is missing"
        if mode != DIR_MODE:
            return f"{directory or 'the tree'} has mode {mode:04o}, not {DIR_MODE:04o}"
    for rel, entry in manifest.entries.items():
        try:
            st = os.lstat(tree / rel)
        except OSError:
            return f"{rel} is missing"
        kind = entry.get("type")
        if kind == "link":
            if not stat.S_ISLNK(st.st_mode) or os.readlink(tree / rel) != entry.get("target"):
                return f"{rel} is not the symlink to {entry.get('target')}"
        elif not stat.S_ISREG(st.st_mode) or st.st_size != entry.get("size"):
            return f"{rel} is not the expected {entry.get('size')}-byte file"
    return None


def build_tree(
    staging: Path,
    plan: TreePlan,
    reusable: Mapping[Identity, Path],
    *,
    allow_hardlinks: bool,
) -> dict[str, dict[str, Any]]:
    """Write ``plan`` into the new directory ``staging``; returns the manifest entries.

    A file whose source identity is in ``reusable`` (a file of another of our trees, which are
    never modified) is hard-linked from there; otherwise it is hard-linked from its source when
    allowed and possible, else copied.
    """
    for rel in (*plan.files, *plan.aliases, *plan.links):
        _check_inside(rel, plan.volume)
    for rel in plan.aliases.values():
        _check_inside(rel, plan.volume)
    for target in plan.links.values():  # a file of the same directory
        if not usable_name(target):
            raise VolumeError(f"volume {plan.volume}: refusing the symlink target {target!r}, it may leave the tree")
    for directory in ("", *DIRS):
        (staging / directory).mkdir()
        # containers running as any user read the tree, whatever the agent's umask
        os.chmod(staging / directory, DIR_MODE)
    entries: dict[str, dict[str, Any]] = {}
    for rel, item in sorted(plan.files.items()):
        dst = staging / rel
        _clone(item.source, dst, reusable.get(item.identity), allow_hardlinks and not item.copy_only, item.identity)
        if item.copy_only:
            # The agent's own files (interceptor, gpu-client) come from its image with whatever
            # mode they were installed with; a container of any user must load or run them.
            os.chmod(dst, OWN_FILE_MODE)
        entries[rel] = {
            "type": "file",
            "size": item.identity[2],
            "source": item.host_path,
            "identity": list(item.identity),
        }
    for rel, target in sorted(plan.aliases.items()):
        os.link(staging / target, staging / rel)
        entries[rel] = {"type": "file", "size": entries[target]["size"], "source": entries[target]["source"]}
    for rel, target in sorted(plan.links.items()):
        os.symlink(target, staging / rel)
        entries[rel] = {"type": "link", "target": target}
    for directory in (*DIRS, ""):
        fsync_dir(staging / directory)
    return entries


def _inside(rel: str) -> bool:
    directory, _, name = rel.partition("/")
    return directory in DIRS and usable_name(name)


def _check_inside(rel: str, volume: str) -> None:
    """Every name written is ``<dir>/<name>``: one of the tree's directories and one plain file name."""
    if not _inside(rel):
        raise VolumeError(f"volume {volume}: refusing to write {rel!r}, it is not a file name inside the tree")


def write_manifest(tree: Path, manifest: Manifest) -> None:
    """Write the manifest atomically (temporary file, fsync, rename, fsync of the directory)."""
    final = manifest_path(tree)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, manifest.to_json().encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames and new entries in it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _clone(source: Path, dst: Path, reuse: Path | None, link_source: bool, expected: Identity) -> None:
    if reuse is not None:
        try:
            os.link(reuse, dst)  # a file of another tree, made from the same source
            return
        except OSError as err:
            log.debug("hard link %s -> %s failed (%s); trying the next way", reuse, dst, err.strerror)
    if link_source:
        try:
            os.link(source, dst)
        except OSError as err:
            log.debug("hard link %s -> %s failed (%s); copying", source, dst, err.strerror)
        else:
            if identity_of(os.lstat(dst)) != expected:
                os.unlink(dst)
                raise _changed(source)
            return
    copy_file(source, dst, expected)


def _changed(source: Path) -> SourceChangedError:
    return SourceChangedError(
        f"{source} changed while the driver mirror read it (a driver being installed?); "
        "the tree is not published, the mirror is built again at its next check"
    )


def copy_file(source: Path, dst: Path, expected: Identity | None = None) -> None:
    """Copy ``source`` to the new file ``dst`` (which must not exist), keeping holes, mode and mtime.

    VolumeError when the file is not the one of identity ``expected`` (when given), or changes
    while it is copied: the copy would hold parts of two files.
    """
    try:
        src_fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise VolumeError(f"cannot read {source}: {err.strerror or err}") from err
    try:
        st = os.fstat(src_fd)
        if expected is not None and identity_of(st) != expected:
            raise _changed(source)
        dst_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _copy_data(src_fd, dst_fd, st.st_size)
            if identity_of(os.fstat(src_fd)) != identity_of(st):
                raise _changed(source)
            os.ftruncate(dst_fd, st.st_size)
            os.fchmod(dst_fd, stat.S_IMODE(st.st_mode))
            os.fsync(dst_fd)
        except OSError as err:
            raise VolumeError(f"cannot copy {source} to {dst}: {err.strerror or err}") from err
        finally:
            os.close(dst_fd)
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
    finally:
        os.close(src_fd)


def _copy_data(src: int, dst: int, size: int) -> None:
    for start, end in _data_ranges(src, size):
        _copy_range(src, dst, start, end - start)


def _data_ranges(fd: int, size: int) -> list[tuple[int, int]]:
    """The data extents of a file (holes skipped); the whole file when holes cannot be asked for."""
    ranges: list[tuple[int, int]] = []
    pos = 0
    try:
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as err:
                if err.errno == errno.ENXIO:  # only a hole remains
                    break
                raise
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            ranges.append((start, end))
            pos = end
    except OSError:
        return [(0, size)]
    return ranges


def _copy_range(src: int, dst: int, offset: int, length: int) -> None:
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src, dst, length - done, offset + done, offset + done)
        except OSError as err:
            if err.errno not in _NO_RANGE_COPY:
                raise
            _copy_range_plain(src, dst, offset + done, length - done)
            return
        if n == 0:  # the source shrank under us
            return
        done += n


def _copy_range_plain(src: int, dst: int, offset: int, length: int) -> None:
    done = 0
    while done < length:
        chunk = os.pread(src, min(_CHUNK, length - done), offset + done)
        if not chunk:
            return
        written = 0
        while written < len(chunk):
            written += os.pwrite(dst, chunk[written:], offset + done + written)
        done += len(chunk)
