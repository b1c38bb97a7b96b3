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
import sys
from dataclasses import dataclass
from pathlib import Path

from gpumanager.volume.elffacts import ELF_MAGIC, ElfFacts, read_elf_facts
from gpumanager.volume.errors import NotElfError, VolumeError
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


#: Entry points the interceptor hooks and the self-test's programs call through it (cu* names only: the
#: driver's own libcuda, put in the interceptor's place, must still run and show every path escaping).
INTERCEPTOR_EXPORTS = (
    "cuInit",
    "cuGetProcAddress",
    "cuDevicePrimaryCtxRetain",
    "cuMemAlloc_v2",
    "cuMemAlloc",
    "cuMemAllocPitch_v2",
    "cuMemAllocManaged",
    "cuMemAllocAsync",
    "cuMemAllocFromPoolAsync",
    "cuMemCreate",
    "cuMemMap",
    "cuArray3DCreate_v2",
    "cuMipmappedArrayCreate",
    "cuGraphAddMemAllocNode",
    "cuMemGetInfo_v2",
    "cuDeviceTotalMem_v2",
    "cuLaunchKernel",
)
ELF_CLASSES = {1: 32, 2: 64}


class SelftestError(Exception):
    """Something the self-test needs is missing or unusable; the message names it."""


def check_interceptor(path: Path) -> None:
    """SelftestError naming ``path`` unless it is a library the dynamic linker loads into this host's
    processes (the class and machine of this Python) and exports :data:`INTERCEPTOR_EXPORTS`.  The linker
    skips a library of another class or machine silently and takes the next ``libcuda.so.1`` on the search
    path: the programs would then run without the interceptor and every row say ESCAPED."""
    try:
        with path.open("rb") as stream:
            ident = stream.read(16)
    except OSError as err:
        raise SelftestError(f"--vcuda-library {path}: cannot read it: {err.strerror or err}") from err
    if ident[:4] != ELF_MAGIC:
        raise SelftestError(f"--vcuda-library {path}: not an ELF file (not the interceptor libcuda-control.so)")
    host = _host_elf()
    bits = ELF_CLASSES.get(ident[4], 0)
    if host is not None and bits != host.bits:
        raise SelftestError(
            f"--vcuda-library {path}: a {bits or 'unknown'}-bit ELF file; this host's processes are {host.bits}-bit "
            "(the dynamic linker would skip it and the programs run without the interceptor)"
        )
    try:
        facts = read_elf_facts(path)
        exported = _exported_functions(path)
    except Exception as err:  # NotElfError, OSError, and pyelftools' many errors on a damaged file
        raise SelftestError(f"--vcuda-library {path}: not a readable ELF object: {err}") from err
    if host is not None and facts.machine != host.machine:
        raise SelftestError(
            f"--vcuda-library {path}: built for {facts.machine}; this host is {host.machine} (the dynamic linker "
            "would skip it and the programs run without the interceptor)"
        )
    missing = [name for name in INTERCEPTOR_EXPORTS if name not in exported]
    if missing:
        raise SelftestError(
            f"--vcuda-library {path}: exports none of the CUDA entry points the interceptor must export (cuInit, "
            "cuMemAlloc_v2, cuLaunchKernel, ...): not the interceptor libcuda-control.so"
            if len(missing) == len(INTERCEPTOR_EXPORTS)
            else f"--vcuda-library {path}: does not export {', '.join(missing)}, which the interceptor must export"
        )


def _host_elf() -> ElfFacts | None:
    """This Python's own ELF facts (what the children are); None when they cannot be read."""
    try:
        return read_elf_facts(Path(sys.executable).resolve())
    except (NotElfError, OSError) as err:
        log.warning("cannot read %s to compare the interceptor's ELF class and machine: %s", sys.executable, err)
        return None


def _exported_functions(path: Path) -> set[str]:
    """The functions ``path`` defines in its dynamic symbol table."""
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import SymbolTableSection

    names: set[str] = set()
    with path.open("rb") as stream:
        elf = ELFFile(stream)
        table = elf.get_section_by_name(".dynsym")
        if not isinstance(table, SymbolTableSection):
            return names
        for sym in table.iter_symbols():
            if sym["st_shndx"] != "SHN_UNDEF" and sym["st_info"]["bind"] in ("STB_GLOBAL", "STB_WEAK"):
                names.add(sym.name)
    return names


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
