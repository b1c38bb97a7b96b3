"""A running pod's container started again (from the kubelet's saved Allocate answer, PreStartContainer
called, no Allocate) after the GPU at its place was replaced while the agent was down.

The saved answer names the old GPU: ``NVIDIA_VISIBLE_DEVICES=<old UUID>`` and the device node
``/dev/nvidia<old minor>``; the kubelet never asks for a new answer. The agent keeps the place's device
IDs (``gpumanager_node_inventory``), so the container's IDs still name the place. Its start must either
run on the GPU now at that place within its budget (the saved device node reaches it, and its share fits
there beside the containers started there since), or be refused at PreStartContainer naming the pod, the
container, the old and the new UUID and what to do: never on another GPU, never beyond the new GPU."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpumanager import names
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.device.types import GPUInfo
from gpumanager.deviceplugin.replaced import ReplacedGPUs, ReplacedRefusal
from gpumanager.vmanager import files
from simnode.cluster import PodRun, SimCluster, admission_annotations, gpu_pod
from simnode.kubelet import PluginRPCError
from tests.battery_fixtures import answered, gpu, write_spec

BLOCK = names.MEMORY_BLOCK_BYTES


def _spec(path: Path, gpus: list[dict[str, Any]]) -> Path:
    return write_spec(path, gpus, lambda i, j: "PHB")


def _restart_with(cluster: SimCluster, path: Path, gpus: list[dict[str, Any]]) -> None:
    """The node is down (the agent killed), the GPUs changed; the agent starts on the new ones."""
    assert cluster.agent is not None
    cluster.agent.signal(signal.SIGKILL)
    cluster.agent.wait()
    cluster.spec = _spec(path, gpus)
    cluster.start_agent()
    cluster.kubelet.wait_for_devices(names.VCORE_RESOURCE, 100 * len(gpus), timeout=30)


def _refusal(cluster: SimCluster, run: PodRun) -> PluginRPCError:
    with pytest.raises(PluginRPCError) as caught:
        cluster.start_containers(run)
    return caught.value


def _config(cluster: SimCluster, run: PodRun, container: str = "main") -> files.VcudaConfig:
    return files.unpack((cluster.vm_path / "configs" / run.uid / container / names.VCUDA_CONFIG_FILE).read_bytes())


def _log(cluster: SimCluster) -> str:
    assert cluster.agent is not None
    return cluster.agent.log_text()


def test_restart_on_a_replacement_at_the_same_device_node_runs_there_within_its_budget(tmp_path: Path) -> None:
    """GPU 0 is replaced by another of the same size at its PCI address, which the driver numbers
    /dev/nvidia0 again: the saved answer's device node reaches the new GPU, so the container starts there
    with its budget in vcuda.config, and the log says it runs on the new GPU (its saved env still names
    the old UUID)."""
    old = [gpu(i, memory_mib=16384) for i in range(2)]
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "before.json", old))
    with cluster:
        run = cluster.run_pod(gpu_pod("p0", [("main", 50, 8)], annotations=admission_annotations([[0]], 1)))
        assert answered(run)["main"][0] == (0,)
        saved = dict(run.core["main"].response.envs)
        assert saved["NVIDIA_VISIBLE_DEVICES"] == old[0]["uuid"]
        new = dict(gpu(7, memory_mib=16384), pci_bus_id=old[0]["pci_bus_id"], minor=0)
        _restart_with(cluster, tmp_path / "after.json", [new, old[1]])
        cluster.start_containers(run)  # accepted
        config = _config(cluster, run)
        assert (config.gpu_memory, config.utilization, config.enable) == (8 * BLOCK, 50, 1)
        lines = [line for line in _log(cluster).splitlines() if "default/p0" in line and "starts again" in line]
        assert lines, _log(cluster)[-3000:]
        assert old[0]["uuid"] in lines[0] and new["uuid"] in lines[0] and "/dev/nvidia0" in lines[0]


def test_restart_of_a_share_larger_than_the_smaller_replacement_is_refused(tmp_path: Path) -> None:
    """A 12 GiB share on GPU 0; GPU 0 is replaced by an 8 GiB GPU at /dev/nvidia0: the container's
    budget cannot fit the new GPU, so its start is refused for good (the pod is to be placed again),
    naming the pod, the container, both UUIDs and the sizes."""
    old = [gpu(i, memory_mib=16384) for i in range(2)]
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "before.json", old))
    with cluster:
        run = cluster.run_pod(gpu_pod("big", [("main", 50, 48)], annotations=admission_annotations([[0]], 1)))
        new = dict(gpu(7, memory_mib=8192), pci_bus_id=old[0]["pci_bus_id"], minor=0)
        _restart_with(cluster, tmp_path / "after.json", [new, old[1]])
        err = _refusal(cluster, run)
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION, err
        for part in (names.PRESTART_FAILED, "default/big", "container main", old[0]["uuid"], new["uuid"]):
            assert part in err.details, (part, err.details)
        assert "12288 MiB" in err.details and "8192 MiB" in err.details and "delete the pod" in err.details
        assert "default/big" in _log(cluster) and new["uuid"] in _log(cluster)


def test_restarts_on_a_smaller_replacement_never_overcommit_it(tmp_path: Path) -> None:
    """Two 6 GiB shares on GPU 0; it is replaced by an 8 GiB GPU (same device node). Both containers
    start again after the node's reboot: the first fits and starts, the second would take the GPU past
    its memory and waits (UNAVAILABLE, the kubelet tries again), and starts once the first pod is gone."""
    old = [gpu(i, memory_mib=16384) for i in range(2)]
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "before.json", old))
    with cluster:
        runs = [
            cluster.run_pod(gpu_pod(f"s{i}", [("main", 40, 24)], annotations=admission_annotations([[0]], 1)))
            for i in range(2)
        ]
        assert [answered(r)["main"][0] for r in runs] == [(0,), (0,)]
        new = dict(gpu(7, memory_mib=8192), pci_bus_id=old[0]["pci_bus_id"], minor=0)
        _restart_with(cluster, tmp_path / "after.json", [new, old[1]])
        cluster.start_containers(runs[0])
        err = _refusal(cluster, runs[1])
        assert err.code == grpc.StatusCode.UNAVAILABLE, err
        assert names.PRESTART_FAILED not in err.details  # the pod is not failed: it waits for room
        for part in ("default/s1", "container main", old[0]["uuid"], new["uuid"], "default/s0", "8192 MiB"):
            assert part in err.details, (part, err.details)
        cluster.delete(runs[0], wait=True)
        cluster.start_containers(runs[1])
        assert _config(cluster, runs[1]).gpu_memory == 24 * BLOCK


@pytest.mark.parametrize("other_takes_the_old_node", [False, True])
def test_restart_whose_saved_device_node_is_not_the_new_gpu_is_refused(
    tmp_path: Path, other_takes_the_old_node: bool
) -> None:
    """GPU 0 is replaced and the driver numbers the new one /dev/nvidia5 (or /dev/nvidia1, the other GPU
    now /dev/nvidia0): the saved answer's /dev/nvidia0 does not reach the GPU at the container's place
    (it is no GPU, or another GPU, whose charge does not count the container). Its start is refused,
    naming the device nodes and both UUIDs; it never runs on the other GPU."""
    old = [gpu(i, memory_mib=16384) for i in range(2)]
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "before.json", old))
    with cluster:
        run = cluster.run_pod(gpu_pod("p0", [("main", 50, 8)], annotations=admission_annotations([[0]], 1)))
        if other_takes_the_old_node:
            new = dict(gpu(7, memory_mib=16384), pci_bus_id=old[0]["pci_bus_id"], minor=1)
            after = [new, dict(old[1], minor=0)]
        else:
            new = dict(gpu(7, memory_mib=16384), pci_bus_id=old[0]["pci_bus_id"], minor=5)
            after = [new, old[1]]
        _restart_with(cluster, tmp_path / "after.json", after)
        err = _refusal(cluster, run)
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION, err
        expected = (names.PRESTART_FAILED, "default/p0", "container main", old[0]["uuid"], new["uuid"])
        for part in (*expected, "/dev/nvidia0", f"/dev/nvidia{new['minor']}", "delete the pod"):
            assert part in err.details, (part, err.details)
        if other_takes_the_old_node:
            assert old[1]["uuid"] in err.details  # the GPU the saved device node reaches now


def test_a_gpu_not_replaced_starts_again_as_before(tmp_path: Path) -> None:
    """GPU 1 is untouched while GPU 0 is replaced: GPU 1's container starts again with no refusal and no
    line about a replacement."""
    old = [gpu(i, memory_mib=16384) for i in range(2)]
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "before.json", old))
    with cluster:
        run = cluster.run_pod(gpu_pod("p1", [("main", 50, 8)], annotations=admission_annotations([[1]], 1)))
        new = dict(gpu(7, memory_mib=8192), pci_bus_id=old[0]["pci_bus_id"], minor=3)
        _restart_with(cluster, tmp_path / "after.json", [new, old[1]])
        cluster.start_containers(run)
        assert _config(cluster, run).gpu_memory == 8 * BLOCK
        assert not [line for line in _log(cluster).splitlines() if "default/p1" in line and "starts again" in line]


def _info(index: int, uuid: str, minor: int, memory_mib: int) -> GPUInfo:
    return GPUInfo(index, uuid, "NVIDIA A100-PCIE-40GB", minor, memory_mib << 20, f"00000000:{16 + index:02X}:00.0")


def test_an_init_container_and_its_pods_containers_share_the_room_on_a_replacement() -> None:
    """After the node's reboot a pod's init container runs again, then its app containers: the pod holds
    the larger of the two on the (smaller) replacement, not their sum, so both start; another pod's share
    that would take the GPU past its memory waits."""
    old = _info(0, "GPU-old", 0, 16384)
    new = _info(0, "GPU-new", 0, 8192)
    mib = 1 << 20

    def alloc(pod: str, container: str, memory_mib: int, *, init: bool = False) -> ContainerAllocation:
        return ContainerAllocation(
            pod, container, (0,), 30, memory_mib * mib, namespace="default", pod_name=pod, started=True, init=init
        )

    held = [alloc("a", "setup", 6144, init=True), alloc("a", "main", 6144), alloc("b", "main", 4096)]
    guard = ReplacedGPUs({0: old}, [new], [], lambda: held)
    assert guard.active and guard.note_held(held) == {h.key for h in held}
    guard.check(held[0])
    guard.check(held[1])  # max(6144, 6144) of pod a, not 12288
    with pytest.raises(ReplacedRefusal) as caught:
        guard.check(held[2])  # 6144 + 4096 > 8192
    assert not caught.value.lasting and "default/a" in str(caught.value) and "GPU-new" in str(caught.value)


def test_nothing_is_looked_at_when_every_device_node_reaches_its_gpu() -> None:
    """The common case: the saved inventory names the GPUs there now (a lost one as saved): no check."""
    gpus = [_info(0, "GPU-a", 0, 16384), _info(1, "GPU-b", 1, 16384)]
    guard = ReplacedGPUs({g.index: g for g in gpus}, gpus, [1], lambda: [])
    assert not guard.active


def test_what_a_start_found_holds_across_another_restart_of_the_agent(tmp_path: Path) -> None:
    """The agent that found GPU 0 replaced saves the new inventory; restarted again before every container
    started, it still checks them: the share already running on the smaller replacement is counted there
    (the other waits); a pod answered since with the new GPU is not checked."""
    old = [gpu(i, memory_mib=16384) for i in range(2)]
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "before.json", old))
    with cluster:
        runs = [
            cluster.run_pod(gpu_pod(f"s{i}", [("main", 40, 24)], annotations=admission_annotations([[0]], 1)))
            for i in range(2)
        ]
        new = dict(gpu(7, memory_mib=8192), pci_bus_id=old[0]["pci_bus_id"], minor=0)
        _restart_with(cluster, tmp_path / "after.json", [new, old[1]])
        cluster.start_containers(runs[0])
        _restart_with(cluster, tmp_path / "again.json", [new, old[1]])  # the inventory names the new GPU now
        err = _refusal(cluster, runs[1])
        assert err.code == grpc.StatusCode.UNAVAILABLE and "default/s0" in err.details, err
        cluster.start_containers(runs[0])  # counted there already: it starts again
        cluster.delete(runs[0], wait=True)
        cluster.delete(runs[1], wait=True)
        # A pod answered with the new GPU is none of those: started again after yet another restart of the
        # agent, it is not checked against the old GPU.
        fresh = cluster.run_pod(gpu_pod("fresh", [("main", 40, 24)], annotations=admission_annotations([[0]], 1)))
        _restart_with(cluster, tmp_path / "last.json", [new, old[1]])
        cluster.start_containers(fresh)
        assert not [line for line in _log(cluster).splitlines() if "default/fresh" in line and "replaced" in line]
