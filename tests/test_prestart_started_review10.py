"""A container's record is marked started only once its start is answered: a PreStartContainer refused after
the allocator's checks (the replaced-GPU check, its files that cannot be written) leaves the record not
started, in memory and in the checkpoint; the kubelet's next try of the start marks it."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpumanager.allocation.allocator import Allocator
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.device.types import GPUInfo
from gpumanager.deviceplugin.devices import DeviceLayout
from gpumanager.deviceplugin.handlers import Handlers
from gpumanager.deviceplugin.replaced import ReplacedRefusal
from gpumanager.deviceplugin.servicer import RequestError
from tests.alloc_fixtures import MIB, FakePods, core_ids, make_pod, uid_of
from tests.test_lifecycle_review import _one_gpu

GPUS = [GPUInfo(0, "GPU-0000", "Tesla T4", 0, 16384 * MIB, "00000000:10:00.0", 0)]


class _Refusing:
    """A replaced-GPU check that refuses the start (a replacement without room yet, or for good)."""

    active = True

    def __init__(self, lasting: bool) -> None:
        self.lasting = lasting
        self.refuse = True

    def check(self, alloc: Any) -> None:
        if self.refuse:
            raise ReplacedRefusal(
                f"pod {alloc.pod_uid} container {alloc.container} cannot start yet", lasting=self.lasting
            )


def _handlers(allocator: Allocator, prepared: Any, replaced: Any = None) -> Handlers:
    return Handlers(
        allocator=allocator,
        layout=DeviceLayout(GPUS),
        owner=lambda *_: (uid_of("p"), "c"),
        prepared=prepared,
        replaced=replaced,
    )


def _setup(tmp_path: Path) -> tuple[Allocator, list[str]]:
    allocator = _one_gpu(tmp_path, FakePods([make_pod("p", [("c", 50, 4)])]))
    ids = core_ids(0, 50)
    allocator.allocate(ids)
    return allocator, ids


def _started(allocator: Allocator) -> bool:
    record = allocator.get(uid_of("p"), "c")
    assert record is not None
    return record.started


def _started_after_restart(tmp_path: Path, allocator: Allocator) -> bool:
    allocator.close()
    after = _one_gpu(tmp_path, FakePods([make_pod("p", [("c", 50, 4)])]))
    after.load()
    return _started(after)


def test_a_start_whose_files_cannot_be_written_leaves_the_record_not_started(tmp_path: Path) -> None:
    allocator, ids = _setup(tmp_path)
    written: list[str] = []

    def full_disk(alloc: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "/etc/gpu-manager/vm/x/vcuda.config")

    with pytest.raises(RequestError) as failed:
        _handlers(allocator, full_disk).pre_start_core(pb.PreStartContainerRequest(devices_ids=ids))
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE
    assert not _started(allocator), "its files were not written: the container did not start"
    # The kubelet's next try, the disk with room again: started, and so recorded.
    _handlers(allocator, lambda a: written.append(a.container)).pre_start_core(
        pb.PreStartContainerRequest(devices_ids=ids)
    )
    assert written == ["c"]
    assert _started(allocator)
    assert _started_after_restart(tmp_path, allocator)


def test_a_start_whose_files_cannot_be_written_is_not_recorded_started_in_the_checkpoint(tmp_path: Path) -> None:
    allocator, ids = _setup(tmp_path)

    def full_disk(alloc: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "/etc/gpu-manager/vm/x/vcuda.config")

    with pytest.raises(RequestError):
        _handlers(allocator, full_disk).pre_start_core(pb.PreStartContainerRequest(devices_ids=ids))
    assert not _started_after_restart(tmp_path, allocator)


@pytest.mark.parametrize("lasting", [False, True])
def test_a_start_refused_by_the_replaced_gpu_check_leaves_the_record_not_started(tmp_path: Path, lasting: bool) -> None:
    allocator, ids = _setup(tmp_path)
    written: list[str] = []
    replaced = _Refusing(lasting)
    with pytest.raises(RequestError) as failed:
        _handlers(allocator, lambda a: written.append(a.container), replaced).pre_start_core(
            pb.PreStartContainerRequest(devices_ids=ids)
        )
    assert failed.value.code == (grpc.StatusCode.FAILED_PRECONDITION if lasting else grpc.StatusCode.UNAVAILABLE)
    assert written == [], "refused before its files"
    assert not _started(allocator)
    if not lasting:
        replaced.refuse = False  # room on the replacement now
        _handlers(allocator, lambda a: written.append(a.container), replaced).pre_start_core(
            pb.PreStartContainerRequest(devices_ids=ids)
        )
        assert written == ["c"] and _started(allocator)
        assert _started_after_restart(tmp_path, allocator)
    else:
        assert not _started_after_restart(tmp_path, allocator)


def test_an_allocate_of_the_ids_after_a_refused_start_is_answered_as_a_repeat(tmp_path: Path) -> None:
    """Not marked started, the record of the IDs is not taken as given on to another container: the
    kubelet repeating the container's Allocate gets the same answer, the same allocation."""
    allocator, ids = _setup(tmp_path)
    first = allocator.response_of(uid_of("p"), "c")

    def full_disk(alloc: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "/etc/gpu-manager/vm/x/vcuda.config")

    with pytest.raises(RequestError):
        _handlers(allocator, full_disk).pre_start_core(pb.PreStartContainerRequest(devices_ids=ids))
    again = allocator.allocate(ids)
    assert first is not None and again == first
    assert [a.key for a in allocator.allocations()] == [(uid_of("p"), "c")]
    assert not _started(allocator)


def test_a_record_released_while_the_files_were_written_is_not_marked_started(tmp_path: Path) -> None:
    from gpumanager.allocation.allocator import AllocationError

    allocator, ids = _setup(tmp_path)
    alloc = allocator.prepare_start(ids, (uid_of("p"), "c"))
    assert not alloc.started
    allocator.release_pod(uid_of("p"))
    with pytest.raises(AllocationError) as refused:
        allocator.mark_started(alloc)
    assert refused.value.kind == "unavailable" and "container c" in str(refused.value)
    assert allocator.get(uid_of("p"), "c") is None
