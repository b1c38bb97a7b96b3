"""The driver the self-test runs against: the node's real libraries and a mirror with the interceptor.

The real ``libcuda.so.1`` and ``libnvidia-ml.so.1`` are found as the agent finds them: through the
``ld.so.cache`` of the driver root, resolved inside that root.  Two directories are laid out:
``direct`` (the real libraries under their sonames: programs without the interceptor) and
``mirror`` (gpu-manager's layout: the interceptor as ``libcuda.so.1``, ``libcuda.so``,
``libnvidia-ml.so.1``, ``libnvidia-ml.so``; the real files beside it under their full names).
Both also hold the driver's helpers that libcuda opens by soname (the PTX JIT compiler): in the
agent's pod the image's own ld.so.cache does not know the host's driver, so they must be on
``LD_LIBRARY_PATH`` or ``cuModuleLoadData`` fails with ``CUDA_ERROR_JIT_COMPILER_NOT_FOUND``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from gpumanager.volume.errors import VolumeError
from gpumanager.volume.ldcache import read_ldcache
from gpumanager.volume.rootfs import DriverRoot, ResolveError

log = logging.getLogger(__name__)

SONAMES = ("libcuda.so.1", "libnvidia-ml.so.1")
# Libraries the real libcuda dlopens by soname (PTX JIT, fatbinaries, and their compiler back end).
HELPER_PREFIXES = (
    "libnvidia-ptxjitcompiler.so.",
    "libnvidia-fatbinaryloader.so.",
    "libnvidia-gpucomp.so.",
    "libnvidia-nvvm.so.",
)


class SelftestError(Exception):
    """Something the self-test needs is missing or unusable; the message names it."""


@dataclass(frozen=True)
class Driver:
    """The real libraries, as files the agent can open."""

    libcuda: Path
    libnvml: Path
    helpers: tuple[tuple[str, Path], ...] = ()  # (soname, file) of HELPER_PREFIXES found


def find_driver(driver_root: Path) -> Driver:
    """The node's real libcuda and libnvidia-ml (64-bit), through the root's ld.so.cache."""
    cache_path = driver_root / "etc" / "ld.so.cache"
    try:
        cache = read_ldcache(cache_path)
    except VolumeError as err:
        raise SelftestError(f"--driver-root {driver_root}: {err}") from err
    root = DriverRoot(driver_root)
    found: dict[str, Path] = {}
    for entry in cache.entries:
        wanted = entry.key in SONAMES or entry.key.startswith(HELPER_PREFIXES)
        if wanted and entry.key not in found and entry.is_elf and entry.bits == 64:
            try:
                found[entry.key] = root.agent_path(root.resolve(entry.value))
            except ResolveError as err:
                log.warning("%s: %s", cache_path, err)
    missing = [name for name in SONAMES if name not in found]
    if missing:
        raise SelftestError(
            f"--driver-root {driver_root}: {cache_path} lists no usable {', '.join(missing)} (is the NVIDIA driver "
            "installed there?)"
        )
    helpers = tuple(sorted((name, path) for name, path in found.items() if name not in SONAMES))
    return Driver(found["libcuda.so.1"], found["libnvidia-ml.so.1"], helpers)


def lay_out(base: Path, driver: Driver, interceptor: Path) -> tuple[Path, Path]:
    """Creates ``base/direct`` and ``base/mirror``; returns both."""
    direct, mirror = base / "direct", base / "mirror"
    direct.mkdir()
    mirror.mkdir()
    for soname, real in zip(SONAMES, (driver.libcuda, driver.libnvml), strict=True):
        (direct / soname).symlink_to(real)
        if not real.name.startswith(soname.removesuffix("1")) or real.name == soname:
            raise SelftestError(f"{real}: expected the driver's file under its full name ({soname[:-1]}<version>)")
        (mirror / real.name).symlink_to(real)
        for name in (soname, soname.removesuffix(".1")):
            (mirror / name).symlink_to(interceptor)
    for soname, real in driver.helpers:
        (direct / soname).symlink_to(real)
        (mirror / soname).symlink_to(real)
    return direct, mirror
