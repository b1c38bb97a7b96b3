"""The driver mirror, as shipped: what the default volume.conf gives containers."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumanager.selftest.mirror import HELPER_PREFIXES
from gpumanager.volume.config import load_volume_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("volume", ["nvidia", "origin"])
@pytest.mark.parametrize("helper", HELPER_PREFIXES)
def test_shipped_volumes_hold_the_helpers_libcuda_opens(volume: str, helper: str) -> None:
    # libcuda dlopens these by soname (PTX JIT and its compiler back end: libnvidia-gpucomp from
    # driver 545, libnvidia-nvvm for JIT LTO); a container finds them only in the mirror it mounts,
    # shared (nvidia) and whole-GPU (origin) alike, or cuModuleLoadData fails.
    config = load_volume_config(ROOT / "deploy" / "volume.conf")
    spec = next(v for v in config.volumes if v.name == volume)
    assert any(helper.startswith(prefix) for prefix in spec.libraries), (volume, helper, spec.libraries)
