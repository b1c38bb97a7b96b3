"""Finding a volume's files in the driver root: binaries on its PATH, libraries through its ld.so.cache.

Binaries the agent brings itself (``gpu-client``) are taken from the agent's files instead.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpumanager.volume.config import VolumeSpec
from gpumanager.volume.ldcache import CacheArch, LdCache
from gpumanager.volume.rootfs import DEFAULT_SEARCH_PATH, DriverRoot, ResolveError
from gpumanager.volume.version import DriverVersion, version_from_libcuda

log = logging.getLogger(__name__)

BIN_DIR = "bin"

# (st_dev, st_ino, st_size, st_mtime_ns, st_mode): a file's identity for "has it changed?".
Identity = tuple[int, int, int, int, int]


def identity_of(st: os.stat_result) -> Identity:
    """The identity tuple of a stat result."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)


@dataclass(frozen=True)
class SourceFile:
    """A driver file to mirror: the mirror directory it goes to, its resolved host path and identity."""

    dir: str
    host_path: str
    path: Path
    identity: Identity
    found_as: str
    #: never hard-linked into a tree (a file of the agent's own, not of the driver)
    copy_only: bool = False
    #: a file of the agent's own: the sha256 of its bytes, which stands for it in the fingerprint
    #: (its device and inode change at every start of the agent's container)
    digest: str = ""

    @property
    def basename(self) -> str:
        """The file's own name (that of the resolved file, not of the link that led to it)."""
        return self.host_path.rsplit("/", 1)[-1]

    @property
    def name(self) -> str:
        """The name in the tree: a binary's name as volume.conf gives it (the name containers run,
        whatever file a host link leads to), a library's own file name."""
        return self.found_as if self.dir == BIN_DIR else self.basename


class Discovery:
    """Looks files up in one driver root; results and warnings are memoised across volumes."""

    def __init__(
        self,
        root: DriverRoot,
        cache: LdCache,
        lib_dirs: dict[CacheArch, str],
        search_path: Sequence[str] = DEFAULT_SEARCH_PATH,
        provided: dict[str, SourceFile] | None = None,
    ) -> None:
        self.root = root
        self.cache = cache
        self.lib_dirs = lib_dirs
        self.search_path = tuple(search_path)
        self.provided = dict(provided or {})  # binaries the agent brings itself (gpu-client), by name
        self.warnings: list[str] = []
        self._resolved: dict[str, tuple[str, Path, Identity] | None] = {}
        self._binaries: dict[str, str | None] = {}

    def sources(self, volume: VolumeSpec) -> list[SourceFile]:
        """The files of ``volume``: binaries first, then libraries in cache order, each resolved file once."""
        found: list[SourceFile] = []
        seen: set[str] = set()
        # Binaries by name: two names of one file (a link to a multi-call binary) are both run.
        for name in dict.fromkeys(volume.binaries):
            if name in self.provided:
                found.append(self.provided[name])
                continue
            host_path = self._binary(name)
            if host_path is not None:
                self._add(found, set(), BIN_DIR, host_path, name)
        if volume.libraries:
            prefixes = tuple(volume.libraries)
            # ldconfig lists the glibc-hwcaps builds of a soname before the plain one; the loader
            # takes them only on a CPU of their level, but the mirror flattens directories, so the
            # plain build (which runs on every CPU) is used where there is one.
            baseline = {(e.key, e.flags) for e in self.cache.entries if not e.glibc_hwcaps}
            for entry in self.cache.entries:
                if not entry.is_elf or not entry.key.startswith(prefixes):
                    continue
                if entry.glibc_hwcaps and (entry.key, entry.flags) in baseline:
                    log.debug(
                        "%s: %s for %s left out, the plain build is used", self.cache.path, entry.value, entry.key
                    )
                    continue
                directory = self.lib_dirs.get(entry.arch)
                if directory is None:
                    log.debug("%s: %s is for %s, foreign to this host; skipped", self.cache.path, entry.key, entry.arch)
                    continue
                self._add(found, seen, directory, entry.value, entry.key)
        return found

    def _add(self, found: list[SourceFile], seen: set[str], directory: str, host_path: str, found_as: str) -> None:
        resolved = self._resolve(host_path, found_as)
        if resolved is None:
            return
        real, agent_path, identity = resolved
        if real in seen:
            return
        seen.add(real)
        found.append(SourceFile(directory, real, agent_path, identity, found_as))

    def _binary(self, name: str) -> str | None:
        if name not in self._binaries:
            host_path = self.root.find_binary(name, self.search_path)
            if host_path is None:
                self._warn(f"binary {name!r} not found on the PATH of driver root {self.root.root}; skipped")
            self._binaries[name] = host_path
        return self._binaries[name]

    def _resolve(self, host_path: str, found_as: str) -> tuple[str, Path, Identity] | None:
        if host_path not in self._resolved:
            result: tuple[str, Path, Identity] | None = None
            try:
                real = self.root.resolve(host_path)
                agent_path = self.root.agent_path(real)
                st = os.stat(agent_path)
                if not stat.S_ISREG(st.st_mode):
                    raise ResolveError(f"{real} is not a regular file")
                result = (real, agent_path, identity_of(st))
            except (ResolveError, OSError) as err:
                self._warn(f"{found_as}: cannot use {host_path} in driver root {self.root.root}: {err}; skipped")
            self._resolved[host_path] = result
        return self._resolved[host_path]

    def _warn(self, message: str) -> None:
        # Reported by the caller from the run's warnings (the keeper: once, not at every recheck).
        log.debug("%s", message)
        self.warnings.append(message)


def driver_version(sources: Sequence[SourceFile]) -> DriverVersion | None:
    """The version of the first real ``libcuda.so.<version>``, 64-bit directory first."""
    ordered = sorted(sources, key=lambda s: s.dir != "lib64")
    for source in ordered:
        version = version_from_libcuda(source.basename)
        if version is not None:
            return version
    return None
