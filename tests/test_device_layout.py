"""Fake device IDs: per-GPU ranges, health and NUMA per device, mapping back to GPUs."""

from __future__ import annotations

import pytest

from gpumanager import names
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.device.types import GPUInfo
from gpumanager.deviceplugin.devicelists import DeviceLists
from gpumanager.deviceplugin.devices import DeviceLayout, UnknownDeviceError
from simnode.agent_process import SPEC_DIR
from simnode.gpusim_state import load_spec

MIB = 1 << 20


def gpu(index: int, memory_mib: int, numa: int | None = 0) -> GPUInfo:
    return GPUInfo(
        index=index,
        uuid=f"GPU-{index}",
        name="Test",
        minor=index,
        memory_total=memory_mib * MIB,
        pci_bus_id=f"00000000:{index + 16:02x}:00.0",
        numa_node=numa,
    )


def test_core_ids_are_per_gpu_ranges() -> None:
    layout = DeviceLayout([gpu(0, 1024), gpu(1, 1024)])
    ids = layout.ids_of_gpu(names.VCORE_RESOURCE, 1)
    assert ids[0] == "tencent.com/vcuda-core-100"
    assert ids[-1] == "tencent.com/vcuda-core-199"
    assert layout.count(names.VCORE_RESOURCE) == 200
    assert layout.gpu_of(names.VCORE_RESOURCE, "tencent.com/vcuda-core-99") == 0
    assert layout.gpu_of(names.VCORE_RESOURCE, "tencent.com/vcuda-core-100") == 1


def test_memory_ids_are_contiguous_runs_of_floor_blocks() -> None:
    # 1000 MiB -> 3 blocks of 256 MiB (floor), 2048 MiB -> 8 blocks.
    layout = DeviceLayout([gpu(0, 1000), gpu(1, 2048)])
    assert layout.count(names.VMEMORY_RESOURCE) == 11
    assert layout.ids_of_gpu(names.VMEMORY_RESOURCE, 0) == [f"tencent.com/vcuda-memory-268435456-{n}" for n in range(3)]
    assert layout.ids_of_gpu(names.VMEMORY_RESOURCE, 1)[0] == "tencent.com/vcuda-memory-268435456-3"
    assert layout.gpu_of(names.VMEMORY_RESOURCE, "tencent.com/vcuda-memory-268435456-2") == 0
    assert layout.gpu_of(names.VMEMORY_RESOURCE, "tencent.com/vcuda-memory-268435456-3") == 1
    assert layout.gpu_of(names.VMEMORY_RESOURCE, "tencent.com/vcuda-memory-268435456-10") == 1


@pytest.mark.parametrize(
    ("resource", "device_id"),
    [
        (names.VCORE_RESOURCE, "tencent.com/vcuda-core-200"),
        (names.VCORE_RESOURCE, "tencent.com/vcuda-core-x"),
        (names.VCORE_RESOURCE, "nvidia.com/gpu-0"),
        (names.VMEMORY_RESOURCE, "tencent.com/vcuda-memory-268435456-11"),
        (names.VMEMORY_RESOURCE, "tencent.com/vcuda-core-1"),
    ],
)
def test_unknown_ids_are_refused_with_the_id_named(resource: str, device_id: str) -> None:
    layout = DeviceLayout([gpu(0, 1000), gpu(1, 2048)])
    with pytest.raises(UnknownDeviceError, match=device_id.replace(".", r"\.")):
        layout.gpu_of(resource, device_id)


def test_devices_carry_health_and_numa() -> None:
    layout = DeviceLayout([gpu(0, 512, numa=0), gpu(1, 512, numa=1), gpu(2, 512, numa=None)])
    devices = layout.devices(names.VCORE_RESOURCE, {1: False})
    by_gpu = {d.ID: d for d in devices}
    assert by_gpu["tencent.com/vcuda-core-0"].health == "Healthy"
    assert by_gpu["tencent.com/vcuda-core-150"].health == "Unhealthy"
    assert [n.ID for n in by_gpu["tencent.com/vcuda-core-150"].topology.nodes] == [1]
    assert not by_gpu["tencent.com/vcuda-core-250"].HasField("topology")
    assert sum(d.health == "Unhealthy" for d in devices) == 100


@pytest.mark.parametrize("spec", ["t4-x1", "v100-pcie-x4", "h100-nvlink-x8", "h200-x16"])
def test_prepared_lists_are_protobufs_own_encoding(spec: str) -> None:
    node = load_spec(SPEC_DIR / f"{spec}.json")
    gpus = [
        gpu(i, g.memory_mib, numa=g.numa_node if i % 2 else None)  # with and without a NUMA node
        for i, g in enumerate(node.gpus)
    ]
    layout = DeviceLayout(gpus)
    lost = [len(gpus) - 1]
    lists = DeviceLists(layout, gpus, unhealthy=lost)

    def expected(unhealthy: set[int]) -> dict[str, bytes]:
        health = {g.index: g.index not in unhealthy for g in gpus}
        return {
            r: pb.ListAndWatchResponse(devices=layout.devices(r, health)).SerializeToString()
            for r in (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE)
        }

    def encoded() -> dict[str, bytes]:
        return {r: lists.encoded(r) for r in (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE)}

    assert encoded() == expected(set(lost))
    assert lists.set_healthy(lost[0], True)
    assert encoded() == expected(set())
    assert lists.set_healthy(0, False) and not lists.set_healthy(0, False)
    assert encoded() == expected({0})
