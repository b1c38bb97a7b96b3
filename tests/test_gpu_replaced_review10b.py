"""A container started again from its saved answer on a (smaller) replacement GPU counts there only once
its start succeeded: a start the replaced-GPU check let through but that failed after (its files could not
be written, its record could not be marked started) takes no room on the replacement, in memory or in
the state kept for the next start of the agent, so another container waiting for that room is not
refused for it. Two starts at once still cannot both take the last room: the check reserves it until the
start is noted or dropped."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpumanager.allocation.allocator import AllocationError, Allocator
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.device.types import GPUInfo
from gpumanager.deviceplugin.devices import DeviceLayout
from gpumanager.deviceplugin.handlers import Handlers
from gpumanager.deviceplugin.replaced import FILE, ReplacedGPUs, ReplacedRefusal
from gpumanager.deviceplugin.servicer import RequestError
from tests.alloc_fixtures import MIB, FakePods, core_ids, make_pod, uid_of
from tests.test_lifecycle_review import _one_gpu

OLD = GPUInfo(0, "GPU-old", "Tesla T4", 0, 16384 * MIB, "00000000:10:00.0", 0)
NEW = GPUInfo(0, "GPU-new", "Tesla T4", 0, 8192 * MIB, "00000000:10:00.0", 0)  # the same device node
IDS = {"a": core_ids(0, 40), "b": core_ids(0, 40, start=40)}


def _setup(tmp_path: Path) -> Allocator:
    """Two 6 GiB shares answered on GPU 0 (16 GiB) before it was replaced by an 8 GiB GPU."""
    pods = FakePods([make_pod(name, [("c", 40, 24)]) for name in IDS])
    allocator = _one_gpu(tmp_path, pods)
    for ids in IDS.values():
        allocator.allocate(ids)
    assert sorted(a.pod_uid for a in allocator.allocations()) == sorted(uid_of(n) for n in IDS)
    return allocator


def _guard(tmp_path: Path, allocator: Allocator, was: dict[int, GPUInfo]) -> ReplacedGPUs:
    guard = ReplacedGPUs(was, [NEW], [], allocator.allocations, state_path=tmp_path / "checkpoint" / FILE)
    guard.note_held(allocator.allocations())
    return guard


def _owner(resource: str, ids: Any, pod: Any, since: Any, listed: Any) -> tuple[str, str]:
    return next((uid_of(name), "c") for name, mine in IDS.items() if set(mine) == set(ids))


def _start(allocator: Allocator, guard: ReplacedGPUs, pod: str, prepared: Any = lambda a: None) -> None:
    Handlers(
        allocator=allocator, layout=DeviceLayout([NEW]), owner=_owner, prepared=prepared, replaced=guard
    ).pre_start_core(pb.PreStartContainerRequest(devices_ids=IDS[pod]))


def _full_disk(alloc: ContainerAllocation) -> None:
    raise OSError(errno.ENOSPC, "No space left on device", "/etc/gpu-manager/vm/x/vcuda.config")


def _saved_started(tmp_path: Path) -> list[list[str]]:
    path = tmp_path / "checkpoint" / FILE
    return json.loads(path.read_text())["started"] if path.exists() else []


def test_a_start_whose_files_cannot_be_written_takes_no_room_on_the_replacement(tmp_path: Path) -> None:
    allocator = _setup(tmp_path)
    guard = _guard(tmp_path, allocator, {0: OLD})
    with pytest.raises(RequestError) as failed:
        _start(allocator, guard, "a", _full_disk)
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE and "cannot write its files" in str(failed.value)
    assert _saved_started(tmp_path) == [], "pod a did not start: not kept as started on the replacement"
    _start(allocator, guard, "b")  # the room pod a would have taken is free: b starts
    assert _saved_started(tmp_path) == [[uid_of("b"), "c"]]
    # Pod a's next try waits for room now (b runs there), naming b.
    with pytest.raises(RequestError) as waits:
        _start(allocator, guard, "a")
    assert waits.value.code == grpc.StatusCode.UNAVAILABLE and "default/b" in str(waits.value)


def test_a_start_failed_before_an_agent_restart_takes_no_room_after_it(tmp_path: Path) -> None:
    allocator = _setup(tmp_path)
    guard = _guard(tmp_path, allocator, {0: OLD})
    with pytest.raises(RequestError):
        _start(allocator, guard, "a", _full_disk)
    # The agent restarts: the saved inventory names the new GPU, the state file what the first start found.
    again = _guard(tmp_path, allocator, {0: NEW})
    assert again.active
    _start(allocator, again, "b")
    assert _saved_started(tmp_path) == [[uid_of("b"), "c"]]


def test_a_start_whose_record_cannot_be_marked_started_takes_no_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    allocator = _setup(tmp_path)
    guard = _guard(tmp_path, allocator, {0: OLD})

    def refuse(alloc: ContainerAllocation) -> None:
        raise AllocationError(f"pod {alloc.pod_uid} container {alloc.container} changed meanwhile", "unavailable")

    with monkeypatch.context() as patch:
        patch.setattr(allocator, "mark_started", refuse)
        with pytest.raises(RequestError) as failed:
            _start(allocator, guard, "a")
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE
    assert _saved_started(tmp_path) == []
    _start(allocator, guard, "b")
    assert _saved_started(tmp_path) == [[uid_of("b"), "c"]]


def test_two_starts_at_once_cannot_both_take_the_last_room() -> None:
    """The check reserves the room until the start is noted (it counts there from then on) or dropped."""
    mib = 1 << 20
    held = [
        ContainerAllocation(pod, "c", (0,), 40, 6144 * mib, namespace="default", pod_name=pod, started=True)
        for pod in ("a", "b")
    ]
    guard = ReplacedGPUs({0: OLD}, [NEW], [], lambda: held)
    guard.note_held(held)
    assert guard.check(held[0])  # a's start goes on: its room reserved
    with pytest.raises(ReplacedRefusal) as crowded:
        guard.check(held[1])  # while a's start is in flight
    assert not crowded.value.lasting and "default/a" in str(crowded.value)
    guard.forget(held[0])  # a's start failed after the check
    assert guard.check(held[1])
    guard.note_started(held[1])  # b started: it counts there
    with pytest.raises(ReplacedRefusal):
        guard.check(held[0])
