"""The driver-mirror keeper: the mount paths it reports before any build succeeded."""

from __future__ import annotations

import json
from pathlib import Path

from gpumanager.volume.keeper import MirrorKeeper
from tests.volume_fixtures import DEFAULT_VOLUME_CONF


def _conf(path: Path, base: Path) -> Path:
    conf = json.loads(DEFAULT_VOLUME_CONF.read_text())
    for volume in conf["volume"]:
        volume["base"] = str(base)
    path.write_text(json.dumps(conf))
    return path


def test_keeper_reports_the_configured_paths_when_the_first_build_fails(tmp_path: Path) -> None:
    """The agent answers Allocate with the keeper's paths from its first build on: when that build
    fails (no ld.so.cache yet), they must still be the volume.conf ones, where an earlier tree may
    lie and where the next build publishes, not /etc/gpu-manager/vdriver."""
    base = tmp_path / "elsewhere"
    root = tmp_path / "host"
    root.mkdir()
    keeper = MirrorKeeper(
        volume_config=str(_conf(tmp_path / "volume.conf", base)),
        driver_root=str(root),
        share_mode=True,
        interceptor=str(tmp_path / "libcuda-control.so"),
        proc_root=str(tmp_path),
    )
    assert keeper.build() is False
    assert "ld.so.cache" in keeper.error
    assert keeper.nvidia == str(base / "nvidia")
    assert keeper.origin == str(base / "origin")
