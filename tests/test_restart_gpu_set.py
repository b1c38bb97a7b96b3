"""The node's set of GPUs differs across an agent restart: device IDs stay on their physical GPU.

The kubelet keeps the vcuda-core IDs it gave each running container across our restart. When the
driver no longer counts a GPU (fallen off the bus before a reboot), counts a new one, or numbers
them in another order, NVML indexes move; the IDs must not move with them, or the kubelet's IDs
name another GPU than the one the container runs on, and it offers capacity the node lacks.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from simnode.cluster import SimCluster, admission_annotations, gpu_pod
from simnode.gpusim_state import GpuSimState
from simnode.kubelet import AllocationError
from tests.battery_fixtures import answered, assert_no_overcommit, gpu, memory_of, wait_agent_matches, write_spec


def _spec(path: Path, gpus: list[dict[str, Any]]) -> Path:
    return write_spec(path, gpus, lambda i, j: "PHB")


def _core_ids_of(gpu_slot: int) -> set[str]:
    return {f"{names.VCORE_ID_PREFIX}{n}" for n in range(gpu_slot * 100, gpu_slot * 100 + 100)}


def _unhealthy(cluster: SimCluster) -> set[str]:
    return {i for i, d in cluster.kubelet.devices(names.VCORE_RESOURCE).items() if not d.healthy}


def _restart_with(cluster: SimCluster, path: Path, gpus: list[dict[str, Any]]) -> None:
    assert cluster.agent is not None
    cluster.agent.signal(signal.SIGKILL)
    cluster.agent.wait()
    cluster.spec = _spec(path, gpus)
    cluster.start_agent()


def test_gpu_no_longer_counted_keeps_the_other_gpus_ids(tmp_path: Path) -> None:
    """4 GPUs, whole-GPU pods on minors 2 and 3; GPU 1 is gone at the restart (NVML counts 3, indexes
    shift); then it is back at the next restart."""
    full = [gpu(i) for i in range(4)]
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "four.json", full))
    with cluster:
        # Placed by the agent (no gpu-admission): the kubelet takes the IDs of the GPU Allocate uses.
        live = [cluster.run_pod(gpu_pod(f"p{m}", [("main", 100, 0)])) for m in range(4)]
        assert [answered(r)["main"][0] for r in live] == [(0,), (1,), (2,), (3,)]
        for run in live[:2]:
            cluster.delete(run)
        live = live[2:]
        held_ids = {r.name: set(r.core["main"].device_ids) for r in live}
        assert held_ids == {"p2": _core_ids_of(2), "p3": _core_ids_of(3)}, held_ids

        _restart_with(cluster, tmp_path / "three.json", [full[0], full[2], full[3]])
        cluster.kubelet.wait_for_devices(names.VCORE_RESOURCE, lambda d: len(d) == 400, timeout=30)
        cluster.kubelet.wait_for_devices(
            names.VCORE_RESOURCE, lambda d: {i for i, x in d.items() if not x.healthy} == _core_ids_of(1), timeout=30
        )
        wait_agent_matches(cluster, live)
        # One GPU (minor 0) is free: the kubelet must see one GPU's worth of IDs, not two.
        live.append(cluster.run_pod(gpu_pod("new-0", [("main", 100, 0)])))
        assert answered(live[-1])["main"][0] == (0,)
        with pytest.raises(AllocationError):
            cluster.admit(gpu_pod("new-1", [("main", 100, 0)]))
        cluster.delete(next(r for r in cluster.runs.values() if r.name == "new-1"))
        # The IDs p3 holds name the GPU it runs on: that GPU (now NVML index 2) lost -> exactly its IDs.
        with GpuSimState(cluster.agent.state if cluster.agent else Path()) as state:
            state.set_lost(2)
        cluster.kubelet.wait_for_devices(
            names.VCORE_RESOURCE,
            lambda d: {i for i, x in d.items() if not x.healthy} == _core_ids_of(1) | _core_ids_of(3),
            timeout=30,
        )
        with GpuSimState(cluster.agent.state if cluster.agent else Path()) as state:
            state.set_lost(2, False)

        _restart_with(cluster, tmp_path / "four-again.json", full)
        cluster.kubelet.wait_for_devices(
            names.VCORE_RESOURCE, lambda d: len(d) == 400 and all(x.healthy for x in d.values()), timeout=30
        )
        wait_agent_matches(cluster, live)
        live.append(cluster.run_pod(gpu_pod("back", [("main", 100, 0)])))
        assert answered(live[-1])["main"][0] == (1,)
        assert_no_overcommit(live, memory_of(cluster))


def test_gpus_numbered_in_another_order_and_one_added(tmp_path: Path) -> None:
    """The driver numbers the same GPUs in another order and counts a new one first: every GPU's IDs
    stay where they were, the new GPU's IDs come after them."""
    full = [gpu(i) for i in range(3)]
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "three.json", full))
    with cluster:
        # Placed by the agent (no gpu-admission): the kubelet takes the IDs of the GPU Allocate uses.
        live = [cluster.run_pod(gpu_pod(f"p{i}", [("main", 100, 0) if i else ("main", 50, 4)])) for i in range(2)]
        minor = answered(live[1])["main"][0][0]
        assert set(live[1].core["main"].device_ids) == _core_ids_of(minor)
        moved = [gpu(7), full[2], full[1], full[0]]
        _restart_with(cluster, tmp_path / "four.json", moved)
        cluster.kubelet.wait_for_devices(names.VCORE_RESOURCE, 400, timeout=30)
        wait_agent_matches(cluster, live)
        # That GPU lost at its new NVML index: the IDs the kubelet gave the pod on it turn Unhealthy.
        assert cluster.agent is not None
        with GpuSimState(cluster.agent.state) as state:
            state.set_lost(next(i for i, g in enumerate(moved) if g["minor"] == minor))
        cluster.kubelet.wait_for_devices(
            names.VCORE_RESOURCE,
            lambda d: {i for i, x in d.items() if not x.healthy} == _core_ids_of(minor),
            timeout=30,
        )
        live.append(cluster.run_pod(gpu_pod("on-the-new-gpu", [("main", 100, 0)])))
        assert_no_overcommit(live, memory_of(cluster))


def test_gpu_replaced_at_the_same_place_takes_its_ids(tmp_path: Path) -> None:
    """A GPU swapped for another (new UUID, same PCI address and minor) while the node was down: its
    IDs are the new GPU's, no GPU is listed lost."""
    full = [gpu(i) for i in range(3)]
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "three.json", full))
    with cluster:
        live = [cluster.run_pod(gpu_pod("p2", [("main", 100, 0)], annotations=admission_annotations([[2]], 1)))]
        new = dict(gpu(9), pci_bus_id=full[1]["pci_bus_id"], minor=1)
        _restart_with(cluster, tmp_path / "replaced.json", [full[0], new, full[2]])
        cluster.kubelet.wait_for_devices(
            names.VCORE_RESOURCE, lambda d: len(d) == 300 and all(x.healthy for x in d.values()), timeout=30
        )
        wait_agent_matches(cluster, live)
        for i in range(2):
            live.append(cluster.run_pod(gpu_pod(f"new-{i}", [("main", 100, 0)])))
        assert sorted(answered(r)["main"][0] for r in live) == [(0,), (1,), (2,)]
        assert_no_overcommit(live, memory_of(cluster))
