"""The kubelet's calls that arrive between registration and the allocation state being loaded."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import grpc
import pytest

from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.deviceplugin.late import LateHandlers
from gpumanager.deviceplugin.servicer import RequestError


class Loaded:
    """Stands in for the handlers built once the state is loaded."""

    def allocate_core(self, request: pb.AllocateRequest) -> pb.AllocateResponse:
        ids = list(request.container_requests[0].devices_ids)
        return pb.AllocateResponse(container_responses=[pb.ContainerAllocateResponse(envs={"IDS": ",".join(ids)})])


def prefer(resource: str, available: Sequence[str], must: Sequence[str], size: int) -> list[str]:
    return list(available)[:size]


def request(*ids: str) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=list(ids))])


def test_a_call_before_the_state_is_loaded_waits_for_it_and_is_served() -> None:
    late = LateHandlers(wait_seconds=30)
    answers: list[pb.AllocateResponse] = []
    caller = threading.Thread(target=lambda: answers.append(late.allocate_core(request("a", "b"))))
    caller.start()
    assert answers == []  # waiting: nothing to answer with yet
    late.attach(Loaded(), prefer)  # type: ignore[arg-type]
    caller.join(30)
    assert [r.container_responses[0].envs["IDS"] for r in answers] == ["a,b"]
    assert late.prefer("r", ["x", "y", "z"], [], 2) == ["x", "y"]


def test_a_state_that_cannot_be_loaded_refuses_with_the_reason() -> None:
    late = LateHandlers(wait_seconds=30)
    late.fail("the allocation state could not be loaded: disk on fire")
    with pytest.raises(RequestError, match="disk on fire") as err:
        late.allocate_core(request("a"))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_the_wait_is_bounded() -> None:
    late = LateHandlers(wait_seconds=0.01)
    with pytest.raises(
        RequestError, match=r"still loading its allocation state \(waited .* the start may take 0\.01 s"
    ) as err:
        late.allocate_core(request("a"))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_pre_start_and_preference_wait_less_than_allocate() -> None:
    """PreStartContainer has the kubelet's 30 s deadline, GetPreferredAllocation an answer without us:
    each waits its own bound, within the start's."""
    late = LateHandlers(wait_seconds=30, pre_start_seconds=0.01, prefer_seconds=0.01)
    with pytest.raises(RequestError, match=r"PreStartContainer: .*still loading"):
        late.pre_start_core(pb.PreStartContainerRequest(devices_ids=["a"]))
    with pytest.raises(RequestError, match=r"GetPreferredAllocation: .*still loading"):
        late.prefer("r", ["x"], [], 1)
    assert late.remaining() > 1  # Allocate would still wait
