"""What Allocate and PreStartContainer accept as device IDs, and how they name what they refuse."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from gpumanager import names
from gpumanager.allocation.ids import in_order, number
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.deviceplugin.devices import DeviceLayout
from gpumanager.deviceplugin.handlers import Handlers
from gpumanager.deviceplugin.servicer import RequestError
from tests.test_device_layout import gpu

MEM = names.VMEMORY_ID_PREFIX
CORE = names.VCORE_ID_PREFIX


def handlers() -> Handlers:
    never: Any = None  # allocate_memory and pre_start_memory use the layout alone
    return Handlers(allocator=never, layout=DeviceLayout([gpu(0, 1024), gpu(1, 1024)]), owner=never, prepared=never)


def allocate_memory(ids: list[str]) -> pb.AllocateResponse:
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
    return handlers().allocate_memory(request)


def test_a_node_s_own_ids_are_accepted() -> None:
    assert len(allocate_memory([f"{MEM}{n}" for n in range(8)]).container_responses) == 1
    handlers().pre_start_memory(pb.PreStartContainerRequest(devices_ids=[f"{MEM}0", f"{MEM}7"]))


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([f"{MEM}0", f"{MEM}1", f"{MEM}0"], f"device ID {MEM}0 appears more than once"),
        ([f"{MEM}0", f"{CORE}1"], f"device ID '{CORE}1' is not a {names.VMEMORY_RESOURCE} device of this node"),
        ([f"{MEM}1", f"{MEM}8"], f"device ID '{MEM}8' is past the last {names.VMEMORY_RESOURCE} device"),
        ([f"{MEM}1", f"{MEM}x"], f"device ID '{MEM}x' is not a {names.VMEMORY_RESOURCE} device"),
        # A digit of another script: int() refuses it, and the message that names it must not fail.
        ([f"{MEM}1", f"{MEM}\u00b2"], f"device ID '{MEM}\u00b2' is not a {names.VMEMORY_RESOURCE} device"),
    ],
)
def test_a_wrong_id_is_refused_by_name(ids: list[str], message: str) -> None:
    with pytest.raises(RequestError) as refused:
        allocate_memory(ids)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in str(refused.value)
    if "past the last" in message:
        # A start of a container whose memory IDs a GPU with less memory since no longer numbers: accepted
        # (tests/test_gpu_memory_change_review5.py).
        handlers().pre_start_memory(pb.PreStartContainerRequest(devices_ids=ids))
        return
    with pytest.raises(RequestError, match="device ID"):
        handlers().pre_start_memory(pb.PreStartContainerRequest(devices_ids=ids))


def test_ids_of_one_resource_are_put_in_the_order_of_their_numbers() -> None:
    shuffled = [f"{CORE}{n}" for n in (105, 7, 99, 1000, 10, 0, 100, 9)]
    assert list(in_order(shuffled)) == sorted(shuffled, key=number)
    assert in_order([]) == ()
