"""Whether the driver root is in the middle of a driver install, so that no tree is built from it now.

A package manager or NVIDIA's installer replaces the driver's files one by one and runs ``ldconfig``
at some point (at the end, or between packages). A check that runs meanwhile sees some libraries
of the new version beside some of the old one, or libraries the cache does not list yet, or cache
entries whose files are gone; a tree built then would be missing libraries or mix versions, and
the containers started with it keep it for life.

The rule: the root looks half-installed when

- the mirrored NVIDIA libraries (those named ``<name>.so.<driver version>``) carry more than one
  driver version, or
- a mirrored library, or a directory holding one or listed for one in the cache, changed after
  ``ld.so.cache`` was written (the cache may not list what is there now),

and any of those files, directories or the cache changed within the last ``settle`` seconds. Then
the published trees are kept and the root is checked again soon. Once nothing has changed for
``settle`` seconds, the state is the host's own, which its processes see too: it is mirrored, and
a mix of versions is warned about.

Times: a file's mtime (a file written in place); a directory's later of mtime and ctime (a file
added, renamed over or removed: installers keep the packages' mtimes on the files themselves). A
file's ctime is no sign: the mirror's own hard links to it change it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpumanager.volume.discovery import BIN_DIR, SourceFile
from gpumanager.volume.ldcache import LdCache
from gpumanager.volume.rootfs import DriverRoot, ResolveError

#: How long the driver files must be left alone before a half-installed look is taken as the host's state.
SETTLE_SECONDS = 60.0
#: How soon the keeper looks again while an install seems to be going on (instead of its period).
RETRY_SECONDS = 10.0
#: ``libnvidia-ml.so.550.54.15``: a driver library named with the driver version (``libGL.so.1.7.0`` is not).
_DRIVER_VERSIONED = re.compile(r"\.so\.(\d{3,}(?:\.\d+)+)\Z")
_NAMED = 6  # files named in a message, then a count


@dataclass(frozen=True)
class InstallCheck:
    """What :func:`check_install` found; every field is '' when nothing is wrong."""

    #: the mirrored libraries carry several driver versions: which files have which
    mixed: str = ""
    #: files or directories changed after the cache was written
    after_cache: str = ""
    #: why the root looks half-installed now (mixed or after_cache, with a change within settle)
    in_progress: str = ""


def driver_version_of(basename: str) -> str | None:
    """``libnvidia-ml.so.550.54.15`` -> ``550.54.15``; None for names without a driver version."""
    match = _DRIVER_VERSIONED.search(basename)
    return match.group(1) if match else None


def check_install(
    root: DriverRoot,
    cache: LdCache,
    sources: Iterable[SourceFile],
    prefixes: Sequence[str],
    *,
    now: float,
    settle: float,
) -> InstallCheck:
    """Look at the libraries to mirror (``sources``) and the cache entries for ``prefixes``.

    ``now`` is the time (seconds since the epoch) to compare the files' times with; a ``settle``
    of 0 never reports an install in progress.
    """
    libs: dict[str, SourceFile] = {}
    for source in sources:
        if source.dir != BIN_DIR and not source.digest:
            libs.setdefault(source.host_path, source)
    mixed = _mixed(list(libs.values()))
    try:
        cache_st = os.stat(cache.path)
    except OSError:
        return InstallCheck(mixed=mixed)
    written = cache_st.st_mtime_ns
    newest = max(cache_st.st_mtime_ns, cache_st.st_ctime_ns)
    changed: list[str] = []
    dirs: dict[str, Path] = {}
    for source in libs.values():
        dirs.setdefault(source.host_path.rsplit("/", 1)[0] or "/", source.path.parent)
    for entry in cache.entries:
        if entry.is_elf and entry.key.startswith(tuple(prefixes)):
            host_dir = entry.value.rsplit("/", 1)[0] or "/"
            if host_dir not in dirs:
                try:
                    dirs[host_dir] = root.agent_path(root.resolve(host_dir))
                except ResolveError:
                    continue
    watched = [(s.host_path, s.path, False) for s in libs.values()]
    watched += [(d + "/", p, True) for d, p in dirs.items()]
    for host_path, agent_path, is_dir in watched:
        try:
            st = os.stat(agent_path)
        except OSError:
            continue
        when = max(st.st_mtime_ns, st.st_ctime_ns) if is_dir else st.st_mtime_ns
        newest = max(newest, when)
        if when > written:
            changed.append(host_path)
    after = f"changed after {cache.path} was written: {_names(sorted(changed))}" if changed else ""
    recent = abs(int(now * 1e9) - newest) < int(settle * 1e9)
    in_progress = ""
    if (mixed or after) and recent:
        why = "; ".join(part for part in (mixed, after) if part)
        in_progress = (
            f"the driver in {root.root} looks half-installed ({why}), and its files changed within the last "
            f"{settle:g} s"
        )
    return InstallCheck(mixed=mixed, after_cache=after, in_progress=in_progress)


def _mixed(libs: Sequence[SourceFile]) -> str:
    by_version: dict[str, list[str]] = {}
    for source in libs:
        version = driver_version_of(source.basename)
        if version is not None:
            by_version.setdefault(version, []).append(source.host_path)
    if len(by_version) < 2:
        return ""
    reference = _reference(libs)
    parts = [
        f"{version}{' (that of ' + reference[1] + ')' if reference and reference[0] == version else ''}: "
        f"{_names(paths)}"
        for version, paths in sorted(by_version.items(), key=lambda kv: reference is None or kv[0] != reference[0])
    ]
    return "libraries of several driver versions: " + "; ".join(parts)


def _reference(libs: Sequence[SourceFile]) -> tuple[str, str] | None:
    """The driver version libcuda (else libnvidia-ml) reports, 64-bit first, and that file's name."""
    for stem in ("libcuda.so.", "libnvidia-ml.so."):
        for source in sorted(libs, key=lambda s: s.dir != "lib64"):
            version = driver_version_of(source.basename)
            if version is not None and source.basename == stem + version:
                return version, source.basename
    return None


def _names(paths: Sequence[str]) -> str:
    shown = ", ".join(paths[:_NAMED])
    return shown if len(paths) <= _NAMED else f"{shown} and {len(paths) - _NAMED} more"
