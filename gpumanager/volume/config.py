"""``volume.conf``: which binaries and libraries go into which driver volume."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpumanager.volume.errors import VolumeError

log = logging.getLogger(__name__)

NVIDIA_VOLUME = "nvidia"
ORIGIN_VOLUME = "origin"


@dataclass(frozen=True)
class VolumeSpec:
    """One volume: mirrored into ``base/name``; ``libraries`` are soname prefixes, ``binaries`` file names."""

    name: str
    base: Path
    mode: str
    binaries: tuple[str, ...]
    libraries: tuple[str, ...]

    @property
    def path(self) -> Path:
        """The stable path of the volume, the one container mounts name."""
        return self.base / self.name


@dataclass(frozen=True)
class VolumeConfig:
    """The parsed ``volume.conf``: its file and its volumes in file order."""

    path: Path
    volumes: tuple[VolumeSpec, ...]

    def with_base(self, base: Path | None) -> VolumeConfig:
        """The same volumes with every ``base`` replaced by ``base`` (no change when None)."""
        if base is None:
            return self
        return replace(self, volumes=tuple(replace(v, base=base) for v in self.volumes))


def mount_sources(config: VolumeConfig) -> tuple[Path | None, Path | None]:
    """The stable paths containers mount, as upstream picks them: the share-mode one (the volume
    named ``nvidia``) and the exclusive one (the last volume of any other name); None when not configured."""
    nvidia = next((v.path for v in config.volumes if v.name == NVIDIA_VOLUME), None)
    origin = next((v.path for v in reversed(config.volumes) if v.name != NVIDIA_VOLUME), None)
    return nvidia, origin


def load_volume_config(path: Path) -> VolumeConfig:
    """Read and validate ``path``; VolumeError names the file and the offending value."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise VolumeError(f"cannot read volume config {path}: {err.strerror or err}") from err
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise VolumeError(f"volume config {path} is not valid JSON: {err}") from err
    except RecursionError:
        raise VolumeError(f"volume config {path} is not valid JSON: nested too deeply") from None
    except ValueError as err:  # a number of more than 4300 digits (int() refuses it)
        raise VolumeError(f"volume config {path} cannot be read: {str(err)[:120]}") from None
    return parse_volume_config(raw, path)


def parse_volume_config(raw: Any, path: Path) -> VolumeConfig:
    """Validate the decoded JSON of a volume config (``path`` is for messages)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("volume"), list):
        raise VolumeError(f'volume config {path}: expected an object with a "volume" list')
    volumes: list[VolumeSpec] = []
    seen: set[tuple[Path, str]] = set()
    for i, item in enumerate(raw["volume"]):
        where = f"volume config {path}: volume[{i}]"
        if not isinstance(item, dict):
            raise VolumeError(f"{where}: expected an object, got {item!r}")
        name = item.get("name")
        if (
            not isinstance(name, str)
            or not name
            or "/" in name
            or "\0" in name
            or name.startswith(".")
            or name != name.strip()
            or not _path_text(name)
        ):
            raise VolumeError(f"{where}: name {name!r} must be a non-empty directory name not starting with '.'")
        base = item.get("base")
        if not isinstance(base, str) or not base.startswith("/") or "\0" in base or not _path_text(base):
            raise VolumeError(f"{where} ({name}): base {base!r} must be an absolute path")
        mode = item.get("mode", "ro")
        if not isinstance(mode, str):
            raise VolumeError(f"{where} ({name}): mode {mode!r} must be a string")
        components = item.get("components")
        if components is None:
            components = {}
        if not isinstance(components, dict):
            raise VolumeError(f"{where} ({name}): components must be an object, got {components!r}")
        unknown = sorted(set(components) - {"binaries", "libraries"})
        if unknown:
            raise VolumeError(f"{where} ({name}): unknown component key(s) {unknown}")
        if not components:
            # As upstream: a volume without any component is not registered.
            log.warning("%s (%s) has no components; skipped", where, name)
            continue
        binaries = _names(components.get("binaries", []), f"{where} ({name}).components.binaries")
        libraries = _names(components.get("libraries", []), f"{where} ({name}).components.libraries")
        key = (Path(base), name)
        if key in seen:
            raise VolumeError(f"{where}: volume {name!r} with base {base!r} appears twice")
        seen.add(key)
        volumes.append(VolumeSpec(name, Path(base), mode, binaries, libraries))
    return VolumeConfig(path, tuple(volumes))


def _names(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise VolumeError(f"{where}: expected a list of names, got {value!r}")
    for entry in value:
        if (
            not isinstance(entry, str)
            or entry in ("", ".", "..")
            or "/" in entry
            or "\0" in entry
            or entry != entry.strip()
            or not _path_text(entry)
        ):
            raise VolumeError(f"{where}: {entry!r} is not a file name")
    return tuple(value)


def _path_text(text: str) -> bool:
    """True when ``text`` can be part of a path: JSON may carry lone surrogates (``\\ud800``), which cannot."""
    try:
        os.fsencode(text)
    except UnicodeEncodeError:
        return False
    return True
