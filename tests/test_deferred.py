"""Work a kubelet call does not wait for runs once its answer has left (gpumanager.deferred)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from gpumanager import deferred
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from gpumanager.deviceplugin.server import PluginServer
from gpumanager.deviceplugin.servicer import RequestError, ResourceServicer
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of


class _Context:
    """A call context that keeps its callbacks until the test ends the call."""

    def __init__(self, *, ended: bool = False) -> None:
        self.callbacks: list[Callable[[], None]] = []
        self.ended = ended

    def add_callback(self, callback: Callable[[], None]) -> bool:
        if self.ended:
            return False
        self.callbacks.append(callback)
        return True

    def end(self) -> None:
        """The call ends: its callbacks hand the work over; returns once it has run."""
        for callback in self.callbacks:
            callback()
        assert deferred.drain(5)


def test_outside_a_call_work_runs_at_once() -> None:
    ran: list[int] = []
    deferred.later(ran.append, 1)
    assert ran == [1]


def test_inside_a_call_work_waits_for_the_end_of_the_call_and_keeps_its_order() -> None:
    ran: list[int] = []
    context = _Context()
    outer = deferred.begin()
    deferred.later(ran.append, 1)
    deferred.later(ran.append, 2)
    assert ran == []
    deferred.end(outer, context)
    assert ran == []  # the answer has not left yet
    context.end()
    assert ran == [1, 2]
    deferred.later(ran.append, 3)  # collection ended with the call
    assert ran == [1, 2, 3]


def test_a_call_that_has_ended_already_runs_its_work_at_once() -> None:
    ran: list[int] = []
    outer = deferred.begin()
    deferred.later(ran.append, 1)
    deferred.end(outer, _Context(ended=True))
    assert ran == [1]


def test_a_nested_call_leaves_its_work_to_the_outer_call() -> None:
    ran: list[str] = []
    context = _Context()
    outer = deferred.begin()
    deferred.later(ran.append, "outer")
    inner = deferred.begin()
    deferred.later(ran.append, "inner")
    deferred.end(inner, _Context())  # its own context never ends: the outer one carries the work
    deferred.end(outer, context)
    context.end()
    assert ran == ["outer", "inner"]


def test_work_that_raises_is_logged_and_the_rest_still_runs(caplog: pytest.LogCaptureFixture) -> None:
    ran: list[int] = []

    def boom() -> None:
        raise ValueError("no such thing")

    context = _Context()
    outer = deferred.begin()
    deferred.later(boom)
    deferred.later(ran.append, 1)
    deferred.end(outer, context)
    with caplog.at_level(logging.ERROR, logger="gpumanager.deferred"):
        context.end()
    assert ran == [1]
    assert "no such thing" in caplog.text


def _served(tmp_path: Path, allocate: Callable[[pb.AllocateRequest], pb.AllocateResponse]) -> PluginServer:
    servicer = ResourceServicer(
        "example.com/r", devices=lambda: b"", options=pb.DevicePluginOptions(), allocate=allocate
    )
    server = PluginServer(servicer, tmp_path / "r.sock")
    server.start()
    return server


@pytest.mark.parametrize("refused", [False, True])
def test_the_kubelet_has_its_answer_before_the_deferred_work_runs(tmp_path: Path, refused: bool) -> None:
    """The deferred work waits until the client has the answer: run before it (in the handler), it would
    wait in vain and the call would miss its deadline. A refused call's work runs after its error too."""
    answered = threading.Event()
    finished = threading.Event()

    def after_answer() -> None:
        if answered.wait(10):
            finished.set()

    def allocate(request: pb.AllocateRequest) -> pb.AllocateResponse:
        deferred.later(after_answer)
        if refused:
            raise RequestError(grpc.StatusCode.NOT_FOUND, "no such pod")
        return pb.AllocateResponse(container_responses=[pb.ContainerAllocateResponse(envs={"A": "b"})])

    server = _served(tmp_path, allocate)
    try:
        with grpc.insecure_channel(f"unix://{tmp_path / 'r.sock'}") as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["a"])])
            if refused:
                with pytest.raises(grpc.RpcError) as raised:
                    stub.Allocate(request, timeout=3)
                assert raised.value.code() == grpc.StatusCode.NOT_FOUND
            else:
                assert stub.Allocate(request, timeout=3).container_responses[0].envs == {"A": "b"}
            answered.set()
            assert finished.wait(10), "the deferred work never ran"
    finally:
        server.stop()


def test_an_allocation_is_logged_and_told_to_listeners_once_answered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The allocator's "allocated" line and its listeners (threads it wakes) wait for the answer; the
    allocation itself is made and durable before it."""
    pods = FakePods([make_pod("a", [("main", 30, 4)])])
    allocator = make_allocator(tmp_path, pods)
    told: list[int] = []
    allocator.add_listener(lambda: told.append(1))
    context = _Context()
    caplog.set_level(logging.INFO, logger="gpumanager.allocation.allocator")
    outer = deferred.begin()
    allocator.allocate(core_ids(0, 30))
    deferred.end(outer, context)
    assert allocator.allocations_of(uid_of("a"))
    assert not told and "allocated" not in caplog.text
    context.end()
    assert told and "allocated default/a container main" in caplog.text


def test_deferred_work_that_blocks_holds_up_no_other_call(tmp_path: Path) -> None:
    """Work left for after an answer may wait (a full log pipe, a lock held across a slow disk): the
    server's other calls are answered meanwhile (gRPC's polling thread, which starts every call, only
    hands the work over)."""
    release = threading.Event()
    first = threading.Event()

    def allocate(request: pb.AllocateRequest) -> pb.AllocateResponse:
        if not first.is_set():
            first.set()
            deferred.later(release.wait, 10)
        return pb.AllocateResponse(container_responses=[pb.ContainerAllocateResponse()])

    server = _served(tmp_path, allocate)
    try:
        with grpc.insecure_channel(f"unix://{tmp_path / 'r.sock'}") as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["a"])])
            stub.Allocate(request, timeout=5)
            for _ in range(3):  # each would wait for the blocked work if it ran on the polling thread
                stub.Allocate(request, timeout=3)
            stub.GetDevicePluginOptions(pb.Empty(), timeout=3)
    finally:
        release.set()
        server.stop()
    assert deferred.drain(5)


def test_a_context_that_does_not_say_true_gets_its_work_run_at_once() -> None:
    class _Odd:
        def add_callback(self, callback: Callable[[], None]) -> object:
            return "yes"  # truthy, but no promise to call back

    ran: list[int] = []
    outer = deferred.begin()
    deferred.later(ran.append, 1)
    deferred.end(outer, _Odd())  # type: ignore[arg-type]
    assert ran == [1]
