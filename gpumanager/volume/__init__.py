"""The driver mirror (vdriver): host NVIDIA driver files staged for containers.

Reads the driver root's ``ld.so.cache`` and the ELF facts of each library, mirrors the
libraries and binaries named in ``volume.conf`` into versioned trees under the volume base
(``/etc/gpu-manager/vdriver``), swaps ``libcuda.so.1`` / ``libnvidia-ml.so.1`` for the
interceptor in the share-mode tree, and publishes each tree through a stable symlink
(``vdriver/nvidia``, ``vdriver/origin``) replaced atomically. Old trees are removed once no
process maps them and no container has them mounted.

Entry point: :func:`build_vdriver`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gpumanager.volume.errors import NotElfError, VolumeError

if TYPE_CHECKING:
    from gpumanager.volume.config import VolumeConfig, VolumeSpec, load_volume_config
    from gpumanager.volume.manager import VdriverResult, VolumeOutcome, build_vdriver
    from gpumanager.volume.version import DriverVersion

# Loaded on first use: reading ELF files (pyelftools) is the slowest import of the agent, and the
# agent registers with the kubelet before it builds the mirror.
_LAZY = {
    "VolumeConfig": "config",
    "VolumeSpec": "config",
    "load_volume_config": "config",
    "VdriverResult": "manager",
    "VolumeOutcome": "manager",
    "build_vdriver": "manager",
    "DriverVersion": "version",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "DriverVersion",
    "NotElfError",
    "VdriverResult",
    "VolumeConfig",
    "VolumeError",
    "VolumeOutcome",
    "VolumeSpec",
    "build_vdriver",
    "load_volume_config",
]
