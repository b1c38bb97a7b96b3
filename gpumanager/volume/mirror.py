"""The mirror rules: which files, soname links and interceptor names make up one volume's tree.

Given a volume's source files this builds a :class:`TreePlan` (nothing is written here):

- each usable ELF file (not blacklisted) as ``<dir>/<basename>``, a binary under its volume.conf
  name; for a name taken twice the first (the loader's preference, cache order) wins;
- relative symlinks ``<soname> -> <basename>`` and the dev name (the soname without its trailing
  version, ``libcuda.so``) ``-> <basename>`` when the soname differs from the file name; a soname
  or dev name that is not a plain file name (empty, ``.``, ``..``, holding ``/``) gets no link, with
  a warning (the file is still mirrored);
- volumes whose name contains ``nvidia``: ``libGLX_indirect.so.0`` and ``libGLX_indirect.so``
  pointing at ``libGLX_nvidia``;
- share mode, volume ``nvidia``: ``libcuda-control.so`` (the interceptor) in the directory of its ELF
  class, and ``libcuda.so.1``, ``libcuda.so``, ``libnvidia-ml.so.1``, ``libnvidia-ml.so`` as hard
  links to it; the real ``libcuda.so.<version>``/``libnvidia-ml.so.<version>`` stay beside them,
  one of each per directory: the one the cache prefers (the interceptor loads the newest
  ``libcuda.so.<version>`` beside it, so a stale driver's file left on the host is left out);
  In the directory of the other class those four names are left out (no interceptor for it there),
  so such processes fail to load the driver instead of escaping the limits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpumanager.volume.blacklist import blacklist_reason
from gpumanager.volume.config import NVIDIA_VOLUME, VolumeSpec
from gpumanager.volume.discovery import BIN_DIR, Identity, SourceFile
from gpumanager.volume.elffacts import ElfFacts
from gpumanager.volume.errors import NotElfError

log = logging.getLogger(__name__)

CONTROL_LIBRARY = "libcuda-control.so"
SWAPPED_SONAME_PREFIXES = ("libcuda.so", "libnvidia-ml.so")
GLX_NVIDIA_PREFIX = "libGLX_nvidia"
GLX_INDIRECT = "libGLX_indirect.so.0"
DIRS = (BIN_DIR, "lib", "lib64")
DIR_FOR_BITS = {64: "lib64", 32: "lib"}


@dataclass(frozen=True)
class FileEntry:
    """A regular file cloned from ``source``; ``copy_only`` forbids hard-linking to the source."""

    source: Path
    host_path: str
    identity: Identity
    copy_only: bool = False


@dataclass(frozen=True)
class Interceptor:
    """The interceptor library: its file, identity, ELF class and the sha256 of its bytes."""

    path: Path
    identity: Identity
    bits: int
    digest: str = ""


@dataclass
class TreePlan:
    """Everything one volume tree holds, by path relative to the tree."""

    volume: str
    files: dict[str, FileEntry] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # hard link name -> file name in the tree
    links: dict[str, str] = field(default_factory=dict)  # symlink name -> relative target
    warnings: list[str] = field(default_factory=list)


def devname(soname: str) -> str:
    """The development name of a soname: its trailing version removed (``libcuda.so.1`` -> ``libcuda.so``)."""
    return soname.rstrip(".0123456789")


def plan_volume(
    volume: VolumeSpec,
    sources: Sequence[SourceFile],
    facts_of: Callable[[SourceFile], ElfFacts],
    *,
    share_mode: bool,
    interceptor: Interceptor | None,
) -> TreePlan:
    """Apply the mirror rules to ``sources`` of ``volume``.

    ``facts_of`` reads a file's ELF facts and raises NotElfError for a non-ELF file, which is
    then skipped with a warning. ``interceptor`` is required for the ``nvidia`` volume in share mode.
    """
    plan = TreePlan(volume.name)
    swap = share_mode and volume.name == NVIDIA_VOLUME
    nvidia_named = NVIDIA_VOLUME in volume.name
    swapped: list[tuple[str, str]] = []
    real: dict[tuple[str, str], SourceFile] = {}  # (directory, swapped prefix) -> the file kept
    for source in sources:
        if swap and source.basename == CONTROL_LIBRARY:
            log.info("%s: %s is replaced by the configured interceptor", volume.name, source.host_path)
            continue
        try:
            facts = facts_of(source)
        except NotElfError as err:
            _warn(plan, f"volume {volume.name}: {err}; skipped")
            continue
        reason = blacklist_reason(source.host_path, facts)
        if reason is not None:
            log.info("volume %s: %s not mirrored: %s", volume.name, source.host_path, reason)
            continue
        rel = f"{source.dir}/{source.name}"
        if rel in plan.files:
            _warn(
                plan,
                f"volume {volume.name}: {source.host_path} skipped, {rel} already comes from "
                f"{plan.files[rel].host_path}",
            )
            continue
        plan.files[rel] = FileEntry(source.path, source.host_path, source.identity, copy_only=source.copy_only)
        soname = facts.soname
        if soname is None or source.dir == BIN_DIR:
            continue
        if not usable_name(soname):
            _warn(
                plan,
                f"volume {volume.name}: {source.host_path} has the soname {soname!r}, not a file name; "
                "mirrored without soname links",
            )
            continue
        family = next((p for p in SWAPPED_SONAME_PREFIXES if soname.startswith(p)), None) if swap else None
        if family is not None:
            kept = real.setdefault((source.dir, family), source)
            if kept is not source:
                del plan.files[rel]
                _warn(
                    plan,
                    f"volume {volume.name}: {source.host_path} left out: {source.dir}/ holds {kept.host_path}, "
                    f"the {soname} the cache prefers (the interceptor would load the newest {family}.<version>)",
                )
                continue
        _soname_links(plan, source.dir, source.basename, soname, source.host_path)
        if not nvidia_named:
            continue
        if swap and soname.startswith(SWAPPED_SONAME_PREFIXES):
            swapped.append((source.dir, soname))
        if soname.startswith(GLX_NVIDIA_PREFIX):
            _soname_links(plan, source.dir, source.basename, GLX_INDIRECT, source.host_path)
    if swap:
        _install_interceptor(plan, swapped, interceptor)
    for rel in [rel for rel in plan.links if rel in plan.files or rel in plan.aliases]:
        log.debug("volume %s: symlink %s dropped, a file has that name", volume.name, rel)
        del plan.links[rel]
    return plan


def usable_name(name: str) -> bool:
    """True when ``name`` can be a link's name in a tree directory: one path component, not ``.``/``..``."""
    return name not in ("", ".", "..") and "/" not in name and "\0" not in name


def _soname_links(plan: TreePlan, directory: str, basename: str, soname: str, host_path: str) -> None:
    if soname == basename:
        return
    for name in (soname, devname(soname)):
        if not usable_name(name):
            _warn(
                plan,
                f"volume {plan.volume}: {host_path} has the soname {soname!r}, whose name without its version "
                f"({name!r}) is not a file name; no link made for it",
            )
            continue
        rel = f"{directory}/{name}"
        if name == basename or rel in plan.links:
            continue  # never a link over the file itself; the first file to claim a name keeps it
        plan.links[rel] = basename


def _install_interceptor(plan: TreePlan, swapped: list[tuple[str, str]], interceptor: Interceptor | None) -> None:
    if interceptor is None:
        raise ValueError("share mode needs the interceptor for the nvidia volume")
    home = DIR_FOR_BITS[interceptor.bits]
    control = f"{home}/{CONTROL_LIBRARY}"
    plan.files[control] = FileEntry(interceptor.path, str(interceptor.path), interceptor.identity, copy_only=True)
    for directory, soname in swapped:
        for name in (soname, devname(soname)):
            if not usable_name(name):
                continue
            rel = f"{directory}/{name}"
            plan.links.pop(rel, None)
            if rel in plan.files:
                _warn(
                    plan,
                    f"volume {plan.volume}: the driver file {rel} has its soname as file name; the "
                    "interceptor replaces it and cannot load it",
                )
                del plan.files[rel]
            if directory == home:
                plan.aliases[rel] = control
    others = sorted({d for d, _ in swapped if d != home})
    for directory in others:
        _warn(
            plan,
            f"volume {plan.volume}: {directory}/ gets no libcuda.so.1/libnvidia-ml.so.1 in share mode: "
            f"the interceptor {interceptor.path} is {interceptor.bits}-bit",
        )


def _warn(plan: TreePlan, message: str) -> None:
    log.debug("%s", message)  # reported by the caller from the plan's warnings
    plan.warnings.append(message)
