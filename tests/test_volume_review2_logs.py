"""The driver mirror's warnings reach the log once, not twice at every recheck of an unchanged host."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from gpumanager.volume.keeper import MirrorKeeper
from tests.volume_fixtures import (
    DEFAULT_VOLUME_CONF,
    DriverStore,
    driver_store,  # noqa: F401  (pytest fixture)
    install_driver,
)


def _keeper(tmp_path: Path, store: DriverStore) -> MirrorKeeper:
    root = tmp_path / "host"
    install_driver(store, root)
    conf = json.loads(DEFAULT_VOLUME_CONF.read_text())
    for volume in conf["volume"]:
        volume["base"] = str(tmp_path / "vdriver")
    (tmp_path / "volume.conf").write_text(json.dumps(conf))
    return MirrorKeeper(
        volume_config=str(tmp_path / "volume.conf"),
        driver_root=str(root),
        share_mode=True,
        interceptor=str(store.interceptor(0)),
        proc_root=str(tmp_path),
    )


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


def test_a_warning_is_logged_once_across_rechecks(
    tmp_path: Path,
    driver_store: DriverStore,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    keeper = _keeper(tmp_path, driver_store)
    caplog.set_level(logging.DEBUG, logger="gpumanager.volume")
    assert keeper.build()
    # the fake host has no gpu-client on its PATH, and its nvidia-cuda-mps-server is a shell script
    assert len(_warnings(caplog, "'gpu-client' not found")) == 1
    assert len(_warnings(caplog, "volume nvidia: " + str(tmp_path / "host/usr/bin/nvidia-cuda-mps-server"))) == 1
    caplog.clear()
    assert keeper.build()
    assert keeper.build()
    assert _warnings(caplog, "gpu-client") == []


def test_a_new_warning_is_logged_when_it_appears(
    tmp_path: Path,
    driver_store: DriverStore,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    keeper = _keeper(tmp_path, driver_store)
    assert keeper.build()
    (tmp_path / "host" / "usr" / "bin" / "nvidia-smi").unlink()
    caplog.set_level(logging.DEBUG, logger="gpumanager.volume")
    caplog.clear()
    assert keeper.build()
    assert len(_warnings(caplog, "'nvidia-smi' not found")) == 1
    assert _warnings(caplog, "gpu-client") == []
