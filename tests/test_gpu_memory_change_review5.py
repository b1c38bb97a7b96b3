"""A GPU whose memory size differs across an agent restart (the same GPU with ECC turned on, or one
replaced at the same place by a smaller one): the vcuda-memory IDs are numbered from each GPU's size, so
the node advertises fewer of them and IDs the kubelet gave running containers are no longer listed."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

from gpumanager import names
from simnode.cluster import SimCluster, admission_annotations, gpu_pod
from tests.battery_fixtures import agent_allocated, answered, gpu, write_spec

BLOCK = names.MEMORY_BLOCK_BYTES


def _spec(path: Path, gpus: list[dict[str, Any]]) -> Path:
    return write_spec(path, gpus, lambda i, j: "PHB")


def _restart_with(cluster: SimCluster, path: Path, gpus: list[dict[str, Any]]) -> None:
    assert cluster.agent is not None
    cluster.agent.signal(signal.SIGKILL)
    cluster.agent.wait()
    cluster.spec = _spec(path, gpus)
    cluster.start_agent()


def _memory_number(device_id: str) -> int:
    return int(device_id.rsplit("-", 1)[1])


def test_containers_holding_memory_ids_no_longer_listed_start_again(tmp_path: Path) -> None:
    """Every memory ID of two 16 GiB GPUs is held; ECC is turned on in GPU 1 (15 GiB) while the agent is
    down, so the last four IDs are no longer advertised. The kubelet calls PreStartContainer for each
    container start (a crashed container restarted) with the IDs it holds: that start must not be refused
    for IDs that only counted memory, and the agent reports the over-committed GPU and who holds it."""
    full = [gpu(i, memory_mib=16384) for i in range(2)]
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "two.json", full))
    with cluster:
        live = [
            cluster.run_pod(gpu_pod(f"p{i}", [("main", 50, 64)], annotations=admission_annotations([[i]], 1)))
            for i in range(2)
        ]
        assert [answered(r)["main"][0] for r in live] == [(0,), (1,)]
        held = {i for r in live for i in r.memory["main"].device_ids}
        assert len(held) == 128
        ecc = dict(full[1], memory_mib=15360)  # the same GPU (same UUID), 1 GiB less with ECC on
        _restart_with(cluster, tmp_path / "ecc.json", [full[0], ecc])
        cluster.kubelet.wait_for_devices(names.VMEMORY_RESOURCE, 124, timeout=30)
        gone = sorted(i for i in held if _memory_number(i) >= 124)
        assert len(gone) == 4
        holders = [r for r in live if set(r.memory["main"].device_ids) & set(gone)]
        assert holders
        for run in holders:  # its container restarted: the kubelet's PreStartContainer calls again
            cluster.start_containers(run)
        # The metric of memory allocated shows what the GPU's holders hold, beyond its capacity.
        assert agent_allocated(cluster)[1] == (50, 64 * BLOCK)
        assert cluster.agent is not None
        lines = [line for line in cluster.agent.log_text().splitlines() if "beyond its capacity" in line]
        assert lines, "no line for the GPU its holders now over-commit"
        assert all("GPU 1" in line and "15360 MiB" in line and "default/p1 container main" in line for line in lines)
        assert not any("default/p0" in line for line in lines)


def test_allocations_on_a_gpu_gone_or_replaced_are_named_at_start(tmp_path: Path) -> None:
    """Three GPUs each hold a share; while the agent is down GPU 0 is replaced (another UUID at its PCI
    address) and GPU 1 falls off the bus. The agent starts, keeps the IDs in place, and says which pods
    hold a GPU that is gone or is another one now (their containers cannot use what they were given)."""
    full = [gpu(i, memory_mib=16384) for i in range(3)]
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "three.json", full))
    with cluster:
        for i in range(3):
            cluster.run_pod(gpu_pod(f"p{i}", [("main", 50, 8)], annotations=admission_annotations([[i]], 1)))
        new = dict(gpu(9, memory_mib=16384), pci_bus_id=full[0]["pci_bus_id"], minor=0)
        _restart_with(cluster, tmp_path / "changed.json", [new, full[2]])
        cluster.kubelet.wait_for_devices(
            names.VCORE_RESOURCE,
            lambda d: len(d) == 300 and sum(x.healthy for x in d.values()) == 200,
            timeout=30,
        )
        assert cluster.agent is not None
        lines = cluster.agent.log_text().splitlines()
        replaced = [line for line in lines if "default/p0 container main" in line and "replaced" in line]
        assert replaced and full[0]["uuid"] in replaced[0] and new["uuid"] in replaced[0], lines[-20:]
        gone = [line for line in lines if "default/p1 container main" in line and "no longer counts" in line]
        assert gone and full[1]["uuid"] in gone[0], lines[-20:]
        assert not [line for line in lines if "default/p2" in line and ("replaced" in line or "no longer" in line)]
        # A new share still goes to the replaced GPU or GPU 2, never to the lost one.
        run = cluster.run_pod(gpu_pod("after", [("main", 50, 8)]))
        assert answered(run)["main"][0] in ((0,), (2,))


def test_a_gpu_over_committed_by_a_smaller_replacement_is_whole_again_once_its_holder_ends(tmp_path: Path) -> None:
    """GPU 0 is replaced by one with half the memory while a 12 GiB share holds it: nothing more is placed
    there while the share runs (a new share goes to GPU 1), and once its pod ends GPU 0's new size is free
    in full, nothing of the old charge left behind."""
    full = [gpu(i, memory_mib=16384) for i in range(2)]
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "two.json", full))
    with cluster:
        big = cluster.run_pod(gpu_pod("big", [("main", 50, 48)], annotations=admission_annotations([[0]], 1)))
        small = dict(gpu(9, memory_mib=8192), pci_bus_id=full[0]["pci_bus_id"], minor=0)
        _restart_with(cluster, tmp_path / "replaced.json", [small, full[1]])
        cluster.kubelet.wait_for_devices(names.VCORE_RESOURCE, 200, timeout=30)
        assert agent_allocated(cluster)[0] == (50, 48 * BLOCK)
        other = cluster.run_pod(gpu_pod("other", [("main", 20, 4)]))
        assert answered(other)["main"][0] == (1,)
        cluster.delete(big, wait=True)
        deadline = time.monotonic() + 30
        while agent_allocated(cluster)[0] != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert agent_allocated(cluster)[0] == (0, 0)
        whole_new = cluster.run_pod(
            gpu_pod("fills-it", [("main", 50, 32)], annotations=admission_annotations([[0]], 2))
        )
        assert answered(whole_new)["main"][0] == (0,)
        assert agent_allocated(cluster)[0] == (50, 32 * BLOCK)
