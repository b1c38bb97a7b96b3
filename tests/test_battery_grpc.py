"""Battery: device-plugin calls no well-behaved kubelet sends, straight to the agent's sockets.

Every malformed call is refused with a status other than INTERNAL/UNKNOWN, naming what was
wrong (the device ID, the count); none changes the allocation state, and the agent stays ready.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpumanager import names
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from simnode.cluster import SimCluster, gpu_pod
from tests.battery_fixtures import readyz, spec_a100_pcie_x2, wait_agent_matches

CORE = names.VCORE_ID_PREFIX
MEM = names.VMEMORY_ID_PREFIX


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimCluster, Any, Any]]:
    tmp = tmp_path_factory.mktemp("grpc")
    cluster = SimCluster(tmp / "node", spec_a100_pcie_x2(tmp / "spec.json"))
    cluster.start()
    core = grpc.insecure_channel(f"unix://{cluster.kubelet.plugin_dir / names.VCORE_SOCKET}")
    memory = grpc.insecure_channel(f"unix://{cluster.kubelet.plugin_dir / names.VMEMORY_SOCKET}")
    try:
        yield cluster, pb_grpc.DevicePluginStub(core), pb_grpc.DevicePluginStub(memory)
    finally:
        core.close()
        memory.close()
        cluster.stop()


def _alloc(*ids: str) -> Any:
    return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=list(ids))])


CASES: dict[str, tuple[str, Any, str]] = {
    "no container request": ("Allocate", pb.AllocateRequest(), ""),
    "empty ID list": ("Allocate", _alloc(), "no device"),
    "unknown ID": ("Allocate", _alloc(f"{CORE}99999"), "99999"),
    "memory ID on the core socket": ("Allocate", _alloc(f"{MEM}0"), f"{MEM}0"),
    "ID with no number": ("Allocate", _alloc(f"{CORE}x"), f"{CORE}x"),
    "foreign ID": ("Allocate", _alloc("nvidia.com/gpu-0"), "nvidia.com/gpu-0"),
    "doubled ID": ("Allocate", _alloc(f"{CORE}1", f"{CORE}1"), f"{CORE}1"),
    "PreStart unknown ID": ("PreStartContainer", pb.PreStartContainerRequest(devices_ids=[f"{CORE}77777"]), "77777"),
    "PreStart nothing": ("PreStartContainer", pb.PreStartContainerRequest(), ""),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_call_is_refused_clearly(node: tuple[SimCluster, Any, Any], case: str) -> None:
    cluster, core, _ = node
    method, request, named = CASES[case]
    with pytest.raises(grpc.RpcError) as info:
        getattr(core, method)(request, timeout=10)
    err: Any = info.value
    assert err.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), err
    assert named in err.details(), err.details()
    status, body = readyz(cluster)
    assert status == 200, body
    wait_agent_matches(cluster, [])


@pytest.mark.parametrize(
    ("available", "must", "size"),
    [([0, 1], [], 5), ([0], [150], 1), ([0, 1, 2], [2, 2], 2), ([], [], 0), ([99999], [], 1)],
)
def test_preferred_allocation_never_names_what_was_not_offered(
    node: tuple[SimCluster, Any, Any], available: list[int], must: list[int], size: int
) -> None:
    """GetPreferredAllocation is advisory: an impossible request gets no preference, never a wrong one."""
    _, core, _ = node
    request = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=[f"{CORE}{i}" for i in available],
                must_include_deviceIDs=[f"{CORE}{i}" for i in must],
                allocation_size=size,
            )
        ]
    )
    (answer,) = core.GetPreferredAllocation(request, timeout=10).container_responses
    chosen = list(answer.deviceIDs)
    offered = set(request.container_requests[0].available_deviceIDs) | set(
        request.container_requests[0].must_include_deviceIDs
    )
    assert set(chosen) <= offered, chosen
    assert len(chosen) <= size, chosen


def test_vmemory_answers_every_container_request(node: tuple[SimCluster, Any, Any]) -> None:
    _, _, memory = node
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=[f"{MEM}{i}"]) for i in range(3)]
    )
    assert len(memory.Allocate(request, timeout=10).container_responses) == 3


def test_after_the_barrage_a_pod_still_runs(node: tuple[SimCluster, Any, Any], tmp_path: Path) -> None:
    cluster, _, _ = node
    run = cluster.run_pod(gpu_pod("after", [("main", 100, 0)]))
    wait_agent_matches(cluster, [run])
    cluster.delete(run)
    wait_agent_matches(cluster, [])
