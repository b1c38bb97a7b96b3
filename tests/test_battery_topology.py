"""Battery: NVLink islands and three NUMA nodes on a spec no other test uses.

Device IDs carry their GPU's NUMA node; multi-GPU requests land inside an NVLink island when one
can hold them, the smallest that can, whatever order the kubelet offers the IDs in.
"""

from __future__ import annotations

from pathlib import Path

from gpumanager import names
from simnode.cluster import SimCluster, gpu_pod
from tests.battery_fixtures import answered, spec_islands

NUMA = [0, 0, 0, 1, 1, 2, 2]  # by NVML index; minors are 10 + index


def test_device_ids_carry_numa_and_islands_are_kept_together(tmp_path: Path) -> None:
    spec = spec_islands(tmp_path / "spec.json")
    with SimCluster(tmp_path / "node", spec, fill="random") as cluster:
        devices = cluster.kubelet.devices(names.VCORE_RESOURCE)
        by_numa: dict[int, int] = {}
        for dev in devices.values():
            assert len(dev.numa_nodes) == 1, dev
            by_numa[dev.numa_nodes[0]] = by_numa.get(dev.numa_nodes[0], 0) + 1
        assert by_numa == {0: 300, 1: 200, 2: 200}
        pair = cluster.run_pod(gpu_pod("pair", [("main", 200, 0)]))
        assert set(answered(pair)["main"][0]) == {13, 14}, answered(pair)  # the two-GPU island
        trio = cluster.run_pod(gpu_pod("trio", [("main", 300, 0)]))
        assert set(answered(trio)["main"][0]) == {10, 11, 12}, answered(trio)  # the three-GPU island
        rest = cluster.run_pod(gpu_pod("rest", [("main", 200, 0)]))
        assert set(answered(rest)["main"][0]) == {15, 16}, answered(rest)  # the last two, one NUMA node
