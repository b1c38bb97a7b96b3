"""Share mode without a usable interceptor: whole GPUs are still served from the origin mirror."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from gpumanager.volume.keeper import MirrorKeeper
from simnode.cluster import SimCluster, gpu_pod
from simnode.kubelet import PluginRPCError
from tests.volume_fixtures import DEFAULT_VOLUME_CONF, V1, DriverStore, driver_store, install_driver

__all__ = ["driver_store"]

MISSING = "/nonexistent/libcuda-control.so"


def test_the_mirror_keeper_builds_origin_and_refuses_shares(tmp_path: Path, driver_store: DriverStore) -> None:
    # The build failed as a whole: no origin tree, and whole-GPU containers mounted a path that did not exist.
    root = tmp_path / "host"
    install_driver(driver_store, root, V1)
    conf = json.loads(DEFAULT_VOLUME_CONF.read_text())
    for volume in conf["volume"]:
        volume["base"] = str(tmp_path / "vdriver")
    (tmp_path / "volume.conf").write_text(json.dumps(conf))
    (tmp_path / "proc").mkdir()
    mirror = MirrorKeeper(
        volume_config=str(tmp_path / "volume.conf"),
        driver_root=str(root),
        share_mode=True,
        interceptor=MISSING,
        proc_root=str(tmp_path / "proc"),
    )
    assert mirror.build() is True and mirror.error == ""
    assert mirror.origin == str(tmp_path / "vdriver" / "origin")
    assert (Path(mirror.origin) / "lib64" / "libcuda.so.1").is_file()
    assert not (tmp_path / "vdriver" / "nvidia").exists()
    assert mirror.share_problem == (
        f"share mode has no interceptor: interceptor library {MISSING}: No such file or directory; "
        f"the share-mode tree {tmp_path / 'vdriver' / 'nvidia'} is not built"
    )


def test_a_node_without_the_interceptor_serves_whole_gpus_and_refuses_shares(tmp_path: Path, sim_built: Path) -> None:
    workdir = tmp_path / "node"
    with SimCluster(workdir, "v100-pcie-x4", agent_flags=[f"--vcuda-library={MISSING}"]) as c:
        with pytest.raises(PluginRPCError) as err:
            c.admit(gpu_pod("share", [("c", 30, 4)]))
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert "30 tencent.com/vcuda-core is a share, but share mode has no interceptor: " in err.value.details
        assert f"interceptor library {MISSING}: No such file or directory" in err.value.details
        whole = c.run_pod(gpu_pod("whole", [("c", 100, 0)]))
        origin = whole.core["c"].response.mounts[0].host_path
        assert origin == str(workdir / "vdriver" / "origin") and Path(origin).is_dir()
        assert c.agent is not None
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(f"http://127.0.0.1:{c.agent.query_port}/readyz", timeout=5)
        missing = json.loads(answer.value.read())["missing"]
        assert MISSING in missing["interceptor"]
