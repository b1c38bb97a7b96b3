"""Upstream's registration flow on the simulated node: gpu-client from the driver mirror, exec'd as
the vcuda-controller library does it, against the agent; and a process that registers before the
kubelet's status update names its container."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumanager import names
from gpumanager.vmanager import files
from simnode.cluster import PodRun, SimCluster, gpu_pod
from simnode.upstream_library import CgroupError, container_of
from tests.gpu_client_fixtures import CLIENT, client_built
from tests.test_agent_volume import volume_conf
from tests.volume_fixtures import V1, DriverStore, driver_store, install_driver

__all__ = ["client_built", "driver_store"]

BLOCK = names.MEMORY_BLOCK_BYTES


def container_id(run: PodRun, container: str) -> str:
    """The ID SimCluster gives a container (and names its cgroup after)."""
    return f"{run.uid[:8]}{container}".replace("-", "")


def gpu_client(cluster: SimCluster, run: PodRun, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    sock = cluster.vm_path / run.uid / names.VCUDA_SOCKET
    return subprocess.run(
        [str(CLIENT), "--addr", str(sock), "--bus-id", "", "--pod-uid", run.uid, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# -- the library's flow, end to end --------------------------------------------------------------


@pytest.fixture
def mirrored(tmp_path: Path, sim_built: Path, client_built: Path, driver_store: DriverStore) -> Iterator[SimCluster]:
    root = tmp_path / "host"
    install_driver(driver_store, root, V1)
    flags = [
        f"--volume-config={volume_conf(tmp_path)}",
        f"--driver-root={root}",
        f"--vcuda-library={driver_store.interceptor(0)}",
        f"--gpu-client={client_built}",
    ]
    with SimCluster(tmp_path / "node", "v100-pcie-x4", agent_flags=flags) as cluster:
        yield cluster


def run_library(cluster: SimCluster, run: PodRun, cgroup_line: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    """The stand-in in the container's view: its mounts from the Allocate answer, its cgroup file."""
    mounts = {m.container_path: m.host_path for m in run.core["main"].response.mounts}
    cgroup_file = tmp / f"cgroup-{run.uid}"
    cgroup_file.write_text(f"11:pids:/kubepods/pod{run.uid}\n{cgroup_line}\n1:name=systemd:/\n")
    args = [f"--cgroup-file={cgroup_file}", f"--nvidia-root={mounts['/usr/local/nvidia']}"]
    args.append(f"--vcuda-root={mounts['/etc/vcuda']}")
    return subprocess.run(
        [sys.executable, "-m", "simnode.upstream_library", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_upstream_library_registers_with_the_mirrors_gpu_client(mirrored: SimCluster, tmp_path: Path) -> None:
    run = mirrored.run_pod(gpu_pod("legacy-app", [("main", 30, 8)]))
    mirror = Path(run.core["main"].response.mounts[0].host_path)
    assert (mirror / "bin" / "gpu-client").read_bytes() == CLIENT.read_bytes()
    cid = container_id(run, "main")
    done = run_library(mirrored, run, f"9:memory:/kubepods/pod{run.uid}/{cid}", tmp_path)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["config"] == str(mirrored.vm_path / run.uid / cid / "vcuda.config")
    assert (seen["pod_uid"], seen["container_name"]) == (run.uid, "main")
    assert (seen["gpu_memory"], seen["utilization"], seen["hard_limit"], seen["enable"]) == (8 * BLOCK, 30, 1, 1)
    assert seen["pids"] == [run.pids["main"]]


def test_upstream_library_dies_when_registration_fails(mirrored: SimCluster, tmp_path: Path) -> None:
    """A container that is not the pod's (here: another pod's cgroup) is refused, and the library exits(-1)."""
    run = mirrored.run_pod(gpu_pod("victim", [("main", 30, 8)]))
    other = "0f0e0d0c-0b0a-4909-8807-060504030201"
    done = run_library(mirrored, run, f"9:memory:/kubepods/pod{other}/{'ab' * 32}", tmp_path)
    assert done.returncode == 255
    assert "PERMISSION_DENIED" in done.stderr and "exited 1" in done.stderr
    assert not (mirrored.vm_path / run.uid / ("ab" * 32)).exists()


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("9:memory:/kubepods/burstable/pod0b6e-11/3f2a", ("0b6e-11", "3f2a")),
        (
            "4:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0b6e_11.slice/"
            "cri-containerd-3f2a.scope",
            ("0b6e-11", "3f2a"),
        ),
        ("7:cpu,memory:/kubepods.slice/kubepods-pod0b6e_11.slice/docker-3f2a.scope", ("0b6e-11", "3f2a")),
        ("3:memory:/kubepods-besteffort-pod0b6e_11.slice/crio-3f2a.scope", ("0b6e-11", "3f2a")),
    ],
)
def test_the_stand_in_reads_cgroups_as_the_library(line: str, expected: tuple[str, str]) -> None:
    assert container_of(f"1:name=systemd:/\n{line}\n") == expected


def test_the_stand_in_has_no_cgroup_v2_support_like_the_library() -> None:
    with pytest.raises(CgroupError, match="no memory controller"):
        container_of("0::/kubepods.slice/kubepods-pod0b6e_11.slice/cri-containerd-3f2a.scope\n")


# -- a process that registers before the kubelet's status update ----------------------------------


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path, client_built: Path) -> Iterator[SimCluster]:
    with SimCluster(tmp_path, "h100-nvlink-x8") as c:
        yield c


def test_a_lone_gpu_container_is_recognised_by_its_cgroup(cluster: SimCluster) -> None:
    run = cluster.admit(gpu_pod("early", [("main", 20, 4), ("sidecar", 0, 0)]))
    cluster.start_containers(run, publish_status=False)
    cid = container_id(run, "main")
    done = gpu_client(cluster, run, "--cont-id", cid)
    assert done.returncode == 0, done.stderr
    assert files.read_pids(cluster.vm_path / run.uid / cid / names.PIDS_CONFIG_FILE) == [run.pids["main"]]
    config = files.unpack((cluster.vm_path / run.uid / cid / names.VCUDA_CONFIG_FILE).read_bytes())
    assert (config.container_name, config.utilization) == ("main", 20)


def test_two_gpu_containers_wait_for_the_status(cluster: SimCluster) -> None:
    """Two candidates for one cgroup: the call waits until the status names the container."""
    run = cluster.admit(gpu_pod("pair", [("a", 20, 4), ("b", 30, 4)]))
    cluster.start_containers(run, publish_status=False)
    results: dict[str, subprocess.CompletedProcess[str]] = {}
    callers = [
        threading.Thread(
            target=lambda: results.update(b=gpu_client(cluster, run, "--cont-id", container_id(run, "b")))
        ),
        threading.Thread(target=lambda: results.update(a=gpu_client(cluster, run, "--cont-name", "a"))),
    ]
    for t in callers:
        t.start()
    time.sleep(1.5)
    assert not results  # both still waiting for the status
    cluster.publish_status(run)
    for t in callers:
        t.join(timeout=30)
    assert results["b"].returncode == 0, results["b"].stderr
    assert results["a"].returncode == 0, results["a"].stderr
    b_dir = cluster.vm_path / run.uid / container_id(run, "b")
    assert files.read_pids(b_dir / names.PIDS_CONFIG_FILE) == [run.pids["b"]]
    assert files.unpack((b_dir / names.VCUDA_CONFIG_FILE).read_bytes()).utilization == 30
    assert files.read_pids(cluster.vm_path / "configs" / run.uid / "a" / names.PIDS_CONFIG_FILE) == [run.pids["a"]]


def test_a_container_the_status_never_names_is_refused_within_the_callers_deadline(cluster: SimCluster) -> None:
    run = cluster.admit(gpu_pod("never", [("a", 20, 4), ("b", 30, 4)]))
    cluster.start_containers(run, publish_status=False)
    started = time.monotonic()
    done = gpu_client(cluster, run, "--cont-id", container_id(run, "a"), "--timeout", "3")
    assert time.monotonic() - started < 10
    assert done.returncode == 1
    assert f"container ID '{container_id(run, 'a')}' is not a container of pod default/never" in done.stderr
    assert "PERMISSION_DENIED" in done.stderr and "(waited " in done.stderr
    assert not (cluster.vm_path / run.uid / container_id(run, "a")).exists()
