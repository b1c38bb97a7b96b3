"""The driver mirror, as shipped: what the default volume.conf gives containers."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest

from gpumanager.selftest.mirror import HELPER_PREFIXES
from gpumanager.volume import tree
from gpumanager.volume.config import load_volume_config
from gpumanager.volume.keeper import MirrorKeeper
from tests.volume_fixtures import LIB64, V1, DriverStore, driver_store, install_driver

__all__ = ["driver_store"]  # the session fixture, used by name

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


def _keeper_on(tmp_path: Path, driver_store: DriverStore) -> tuple[MirrorKeeper, Path]:
    root = tmp_path / "host"
    install_driver(driver_store, root)
    conf = json.loads((ROOT / "deploy" / "volume.conf").read_text())
    for volume in conf["volume"]:
        volume["base"] = str(tmp_path / "vdriver")
    (tmp_path / "volume.conf").write_text(json.dumps(conf))
    keeper = MirrorKeeper(
        volume_config=str(tmp_path / "volume.conf"),
        driver_root=str(root),
        share_mode=True,
        interceptor=str(driver_store.interceptor()),
        period=300.0,
        retry=10.0,
        settle=0.0,
    )
    return keeper, root / LIB64.lstrip("/") / f"libcuda.so.{V1}"


def test_a_driver_file_changed_while_copied_is_read_again_soon(
    tmp_path: Path, driver_store: DriverStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In the agent's pod the host's driver and the vdriver trees are two mounts: every file is
    # copied. An installer writing libcuda while it is copied fails the build; the next try must
    # come at the install retry (seconds), not after the 5-minute period with no tree to serve.
    keeper, libcuda = _keeper_on(tmp_path, driver_store)
    link = os.link
    host = str(tmp_path / "host")

    def across_mounts(src: str | Path, dst: str | Path) -> None:
        if str(src).startswith(host):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        link(src, dst)

    monkeypatch.setattr(tree.os, "link", across_mounts)
    copy_data = tree._copy_data
    written: list[bool] = []

    def installer_writes(src: int, dst: int, size: int) -> None:
        if not written and os.readlink(f"/proc/self/fd/{src}") == str(libcuda):
            written.append(True)
            with libcuda.open("r+b") as stream:
                stream.write(b"\x7fELF")  # same bytes, a new mtime: the file is being rewritten
            os.utime(libcuda, ns=(time.time_ns(), time.time_ns() + 1_000_000))
        copy_data(src, dst, size)

    monkeypatch.setattr(tree, "_copy_data", installer_writes)
    assert keeper.build() is False and written
    assert "changed while the driver mirror read it" in keeper.error
    assert keeper.next_check == 10.0
    assert keeper.build() is True, keeper.error
    assert keeper.share_problem == ""
    assert keeper.next_check == 300.0
