"""The node's set of GPUs differs across an agent restart: device IDs stay on their physical GPU.

The kubelet keeps the vcuda-core IDs it gave each running container across our restart. When the
driver no longer counts a GPU (fallen off the bus before a reboot), counts a new one, or numbers
them in another order, NVML indexes move; the IDs must not move with them, or the kubelet's IDs
name another GPU than the one the container runs on, and it offers capacity the node lacks.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from gpumanager.device import inventory, nvml
from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.faults import STALL_ENV
from simnode.cluster import SimCluster, admission_annotations, gpu_pod
from simnode.gpusim_state import GpuSimState
from simnode.kubelet import AllocationError, PluginRPCError
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


@pytest.mark.parametrize("agent_down", [False, True, "our checkpoint lost"])
def test_pod_deleted_before_a_restart_does_not_keep_its_gpu(tmp_path: Path, agent_down: object) -> None:
    """The kubelet drops a deleted pod's entries from kubelet_internal_checkpoint only at its next
    admission of a pod with devices: at our start the file still names it. Deleted while we ran (our
    checkpoint freed it) or while we were down, it must not hold its GPU after the start."""
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "one.json", [gpu(0)]))
    with cluster:
        assert cluster.agent is not None
        gone = cluster.run_pod(gpu_pod("gone", [("main", 100, 0)]))
        if agent_down:
            cluster.agent.signal(signal.SIGKILL)
            cluster.agent.wait()
            cluster.delete(gone, wait=True)
        else:
            cluster.delete(gone, wait=True)
            wait_agent_matches(cluster, [])
            cluster.agent.signal(signal.SIGKILL)
            cluster.agent.wait()
        if agent_down == "our checkpoint lost":  # rebuilt from the kubelet's records
            for f in (cluster.agent.workdir / "checkpoint").iterdir():
                if f.name.startswith("gpumanager_internal_checkpoint"):
                    f.write_text("{not json")
        kept = [e.pod_uid for e in cluster.kubelet.checkpoint_entries()]
        assert gone.uid in kept  # as the kubelet leaves it
        cluster.start_agent()
        # At once: an Allocate right after the start must not find the GPU taken by the deleted pod.
        after = cluster.run_pod(gpu_pod("after", [("main", 100, 0)]))
        assert answered(after)["main"][0] == (0,)
        wait_agent_matches(cluster, [after])


def test_allocate_during_a_slow_load_waits_for_it(tmp_path: Path) -> None:
    """The kubelet calls Allocate without a deadline and fails the pod's admission for good on an
    error: an Allocate that arrives while the agent is still loading its state (a slow disk, a long
    journal) waits for the load rather than failing the pod after a few seconds."""
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "one.json", [gpu(0)]))
    with cluster:
        assert cluster.agent is not None
        live = [cluster.run_pod(gpu_pod("before", [("main", 50, 4)]))]
        cluster.agent.signal(signal.SIGKILL)
        cluster.agent.wait()
        launched = time.monotonic()
        cluster.start_agent(wait=False, env={STALL_ENV: "recovery:12"})
        cluster.kubelet.wait_for_registration(names.VCORE_RESOURCE, since=launched, timeout=30, with_devices=True)
        cluster.kubelet.wait_for_registration(names.VMEMORY_RESOURCE, since=launched, timeout=30, with_devices=True)
        live.append(cluster.run_pod(gpu_pod("during-the-load", [("main", 50, 4)])))
        assert answered(live[-1])["main"][0] == (0,)
        wait_agent_matches(cluster, live)


def test_a_stop_answers_the_calls_waiting_for_the_start(tmp_path: Path) -> None:
    """SIGTERM while an Allocate waits for a slow start: the call is answered that the agent stops
    (not left to the server's cancellation), and the agent exits cleanly."""
    # vcuda-core first (its GetPreferredAllocation logs the line waited for below): the kubelet's order over a
    # container's limits is random otherwise.
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "one.json", [gpu(0)]), fill="sorted")
    with cluster:
        assert cluster.agent is not None
        cluster.agent.signal(signal.SIGKILL)
        cluster.agent.wait()
        launched = time.monotonic()
        agent = cluster.start_agent(wait=False, env={STALL_ENV: "recovery:60"})
        for resource in (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE):
            cluster.kubelet.wait_for_registration(resource, since=launched, timeout=30, with_devices=True)
        errors: list[BaseException] = []

        def admit() -> None:
            try:
                cluster.admit(gpu_pod("waiting", [("main", 50, 4)]))
            except PluginRPCError as exc:
                errors.append(exc)

        caller = threading.Thread(target=admit, daemon=True)
        caller.start()
        # GetPreferredAllocation waits a few seconds, then the kubelet's Allocate waits for the start.
        agent.wait_for_log("returning no preference", timeout=30)
        time.sleep(1.0)
        agent.signal(signal.SIGTERM)
        assert agent.wait() == 0
        caller.join(30)
        assert len(errors) == 1 and "the agent is stopping" in str(errors[0]), errors


def _info(index: int, uuid: str, bus: str) -> GPUInfo:
    return GPUInfo(index=index, uuid=uuid, name="GPU", minor=index, memory_total=1 << 30, pci_bus_id=bus)


def test_places_of_the_gpus_nvml_counts_now() -> None:
    """Each saved GPU keeps its place by UUID; a GPU swapped in at a missing one's PCI address takes its
    place; a GPU counted but lost takes a free saved place; a new one goes after them; a saved GPU not
    counted stays, with no NVML index."""
    known = {i: _info(i, f"U{i}", f"bus{i}") for i in range(4)}
    # U1 gone, U3 counted first, a new GPU at U2's address, a lost one.
    counted: list[GPUInfo | None] = [_info(0, "U3", "bus3"), _info(1, "U0", "bus0"), _info(2, "N", "bus2"), None]
    assert nvml._places(known, counted) == {3: 0, 0: 1, 2: 2, 1: 3}
    counted = [_info(0, "U0", "bus0"), _info(1, "U2", "bus2"), _info(2, "N", "busN")]
    assert nvml._places(known, counted) == {0: 0, 2: 1, 4: 2, 1: None, 3: None}
    assert nvml._places(known, [_info(0, "X", "bus0")]) is None  # another node's inventory


def test_an_inventory_written_by_a_newer_agent_is_used(tmp_path: Path) -> None:
    """A newer version may save more about each GPU: after a downgrade its inventory still keeps the GPUs'
    places (the fields this version knows are read, the others left)."""
    path = tmp_path / inventory.FILE
    gpus = [_info(0, "U0", "bus0"), _info(1, "U1", "bus1")]
    inventory.save(path, gpus, NodeTopology(levels=((0, 20), (20, 0))))
    doc = json.loads(path.read_text())
    for g in doc["gpus"]:
        g["pcie_generation"] = 5
    doc["saved_by"] = "a newer agent"
    path.write_text(json.dumps(doc))
    loaded, topology = inventory.load(path)
    assert loaded == {g.index: g for g in gpus}
    assert topology is not None and topology.levels == ((0, 20), (20, 0))
