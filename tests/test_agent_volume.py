"""The agent builds the driver mirror at start and mounts it into containers; a broken mirror is not fatal."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from simnode.cluster import SimCluster, gpu_pod
from tests.volume_fixtures import (
    DEFAULT_VOLUME_CONF,
    LIB32,
    LIB64,
    LIBX32,
    V1,
    DriverStore,
    driver_store,
    install_driver,
    remove_libcuda,
)

__all__ = ["driver_store"]


def volume_conf(tmp_path: Path) -> Path:
    conf = json.loads(DEFAULT_VOLUME_CONF.read_text())
    for volume in conf["volume"]:
        volume["base"] = str(tmp_path / "vdriver")
    path = tmp_path / "volume.conf"
    path.write_text(json.dumps(conf))
    return path


def test_share_containers_mount_the_mirror_with_the_interceptor(
    tmp_path: Path, sim_built: Path, driver_store: DriverStore
) -> None:
    root = tmp_path / "host"
    install_driver(driver_store, root, V1)
    interceptor = driver_store.interceptor(0)
    flags = [f"--volume-config={volume_conf(tmp_path)}", f"--driver-root={root}", f"--vcuda-library={interceptor}"]
    with SimCluster(tmp_path / "node", "v100-pcie-x4", agent_flags=flags) as c:
        share = c.run_pod(gpu_pod("share", [("c", 30, 4)]))
        mounts = {m.container_path: m.host_path for m in share.core["c"].response.mounts}
        assert mounts["/usr/local/nvidia"] == str(tmp_path / "vdriver" / "nvidia")
        lib = Path(mounts["/usr/local/nvidia"]) / "lib64" / "libcuda.so.1"
        assert lib.read_bytes() == interceptor.read_bytes()
        whole = c.run_pod(gpu_pod("whole", [("c", 100, 0)]))
        assert whole.core["c"].response.mounts[0].host_path == str(tmp_path / "vdriver" / "origin")


def test_broken_volume_config_is_reported_and_the_plugin_still_serves(tmp_path: Path, sim_built: Path) -> None:
    bad = tmp_path / "volume.conf"
    bad.write_text("{not json")
    with SimCluster(tmp_path / "node", "t4-x1", agent_flags=[f"--volume-config={bad}"]) as c:
        run = c.run_pod(gpu_pod("still", [("c", 100, 0)]))
        assert run.core["c"].response.mounts[0].host_path == "/etc/gpu-manager/vdriver/origin"
        assert c.agent is not None
        with urllib.request.urlopen(f"http://127.0.0.1:{c.agent.query_port}/healthz", timeout=5) as resp:
            health = json.loads(resp.read())
        assert "volume" in health["errors"] and str(bad) in health["errors"]["volume"]


def test_an_unexpected_failure_of_the_mirror_build_is_reported_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Raised out of the build, it ended the agent's background start: no /healthz, no pod cache.
    from gpumanager.volume import keeper, manager

    def broken(**_: object) -> None:
        raise AssertionError("a damaged library the reader did not expect")

    monkeypatch.setattr(manager, "build_vdriver", broken)
    mirror = keeper.MirrorKeeper(
        volume_config=str(tmp_path / "volume.conf"),
        driver_root=str(tmp_path),
        share_mode=True,
        interceptor=str(tmp_path / "libcuda-control.so"),
    )
    assert mirror.build() is False
    assert "AssertionError: a damaged library the reader did not expect" in mirror.error
    assert "not built" in mirror.share_problem


def test_a_mirror_without_libcuda_is_built_but_refuses_shares(tmp_path: Path, driver_store: DriverStore) -> None:
    # It counted as ready: shared containers then got no interceptor under libcuda.so.1.
    from gpumanager.volume.keeper import MirrorKeeper

    root = tmp_path / "host"
    install_driver(driver_store, root, V1)
    remove_libcuda(root, LIB64, LIB32, LIBX32)
    (tmp_path / "proc").mkdir()
    mirror = MirrorKeeper(
        volume_config=str(volume_conf(tmp_path)),
        driver_root=str(root),
        share_mode=True,
        interceptor=str(driver_store.interceptor(0)),
        proc_root=str(tmp_path / "proc"),
    )
    assert mirror.build() is True and mirror.error == ""
    tree = (tmp_path / "vdriver" / "nvidia").resolve()
    assert mirror.share_problem == (
        f"share mode has no interceptor: the share-mode tree {tree} has no libcuda.so.1 swapped for the "
        f"interceptor: {root}/etc/ld.so.cache has no libcuda.so.* entry"
    )
    install_driver(driver_store, root, V1)  # the driver is back: shares are served again
    assert mirror.build() is True and mirror.share_problem == ""
