"""PreStartContainer answers only once what it changed in the records is durable: a swap of two identical
pods' records, the take-over of an allocation freed before its container started, the gathering of a pod's
records split between pods, and the mark that the container started. When the write fails the start is
refused (UNAVAILABLE, the kubelet tries it again) and the record is not marked started; the kubelet's next
try writes the state before it is answered, also when it finds nothing left to change."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from gpumanager import names
from gpumanager.allocation import journal
from gpumanager.allocation.allocator import AllocationError, Allocator
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of
from tests.test_model_seeds_review9 import _mounted, _pod, _start

LATER = "2026-11-21T10:00:01Z"


def _full(self: object, *args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _disk_full(monkeypatch: pytest.MonkeyPatch, *, snapshot_too: bool = True) -> None:
    monkeypatch.setattr(journal._Segment, "write_at", _full)
    if snapshot_too:
        monkeypatch.setattr(journal.CheckpointStore, "write_snapshot", _full)


def _crash(alloc: Allocator) -> None:
    """The process ends without its stop: nothing written at stop."""
    alloc._closing.set()
    alloc._store.close()


def _restarted(tmp_path: Path, pods: FakePods) -> Allocator:
    after = make_allocator(tmp_path, pods)
    after.load()
    return after


def _refused(alloc: Allocator, ids: list[str], owner: tuple[str, str]) -> AllocationError:
    with pytest.raises(AllocationError) as caught:
        alloc.pre_start(ids, owner)
    exc = caught.value
    assert exc.kind == "unavailable", exc
    text = str(exc)
    # Not "PreStartContainer check failed": the kubelet would mark the pod failed for good.
    assert not text.startswith(names.PRESTART_FAILED), text
    assert owner[0] in text and f"container {owner[1]}" in text, text
    assert "No space left on device" in text and "cannot write checkpoint" in text, text
    return exc


def _identical_pair() -> FakePods:
    return FakePods([make_pod("x", [("main", 60, 4)]), make_pod("y", [("main", 60, 4)], created=LATER)])


def _both_allocated(tmp_path: Path) -> tuple[FakePods, Allocator, list[str], list[str]]:
    """Two identical pods x and y, both allocated: ``first`` matched to x, ``second`` to y."""
    pods = _identical_pair()
    alloc = make_allocator(tmp_path, pods)
    alloc.probe_checkpoint()
    first, second = core_ids(2, 60), core_ids(3, 60)
    alloc.allocate(first)
    alloc.allocate(second)
    return pods, alloc, first, second


def test_a_swap_that_cannot_be_written_is_refused_and_written_by_the_kubelets_next_try(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pods, alloc, first, second = _both_allocated(tmp_path)  # first matched to x, given by the kubelet to y
    x_record = alloc.get(uid_of("x"), "main")
    assert x_record is not None
    gpus_of_first = x_record.minors
    _disk_full(monkeypatch)
    _refused(alloc, first, (uid_of("y"), "main"))
    y = alloc.get(uid_of("y"), "main")
    assert y is not None and not y.started, "refused: the container did not start"
    _refused(alloc, first, (uid_of("y"), "main"))  # the disk still full: refused again
    monkeypatch.undo()
    started = alloc.pre_start(first, (uid_of("y"), "main"))
    assert started.minors == gpus_of_first and started.started
    _crash(alloc)
    after = _restarted(tmp_path, pods)
    y = after.get(uid_of("y"), "main")
    x = after.get(uid_of("x"), "main")
    assert y is not None and y.minors == gpus_of_first and y.started
    assert x is not None and frozenset(x.device_ids) == frozenset(second) and not x.started


def test_a_swap_refused_unwritten_is_made_again_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pods, alloc, first, _second = _both_allocated(tmp_path)
    x_record = alloc.get(uid_of("x"), "main")
    assert x_record is not None
    gpus_of_first = x_record.minors
    _disk_full(monkeypatch)
    _refused(alloc, first, (uid_of("y"), "main"))
    _crash(alloc)
    monkeypatch.undo()
    after = _restarted(tmp_path, pods)
    x = after.get(uid_of("x"), "main")
    assert x is not None and frozenset(x.device_ids) == frozenset(first), "the swap was never answered"
    started = after.pre_start(first, (uid_of("y"), "main"))  # the kubelet's next try
    assert started.key == (uid_of("y"), "main") and started.minors == gpus_of_first
    _crash(after)
    third = _restarted(tmp_path, pods)
    y = third.get(uid_of("y"), "main")
    assert y is not None and y.minors == gpus_of_first and y.started


def test_a_retry_that_finds_nothing_to_change_writes_the_unwritten_change_before_it_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """x started with its IDs; the kubelet then names y as their holder: y takes x's started record (nothing
    left to mark). That swap cannot be written: refused. The kubelet's next try finds y holding the IDs,
    started, nothing to change: it is answered only once the state is written."""
    pods, alloc, first, _second = _both_allocated(tmp_path)
    x_started = alloc.pre_start(first, (uid_of("x"), "main"))
    assert x_started.key == (uid_of("x"), "main") and x_started.started
    _disk_full(monkeypatch, snapshot_too=False)  # the journal cannot be written; a whole snapshot can
    _refused(alloc, first, (uid_of("y"), "main"))
    y = alloc.get(uid_of("y"), "main")
    assert y is not None and frozenset(y.device_ids) == frozenset(first) and y.started
    monkeypatch.undo()
    alloc.pre_start(first, (uid_of("y"), "main"))
    _crash(alloc)
    after = _restarted(tmp_path, pods)
    y = after.get(uid_of("y"), "main")
    assert y is not None and frozenset(y.device_ids) == frozenset(first) and y.started


def test_a_retry_that_finds_nothing_to_change_is_refused_while_the_state_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _pods, alloc, first, _second = _both_allocated(tmp_path)
    alloc.pre_start(first, (uid_of("x"), "main"))
    _disk_full(monkeypatch)
    _refused(alloc, first, (uid_of("y"), "main"))
    _refused(alloc, first, (uid_of("y"), "main"))


def test_a_start_whose_started_mark_cannot_be_written_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pods = FakePods([make_pod("a", [("main", 50, 4)])])
    alloc = make_allocator(tmp_path, pods)
    alloc.probe_checkpoint()
    ids = core_ids(0, 50)
    alloc.allocate(ids)
    _disk_full(monkeypatch)
    _refused(alloc, ids, (uid_of("a"), "main"))
    record = alloc.get(uid_of("a"), "main")
    assert record is not None and not record.started
    monkeypatch.undo()
    assert alloc.pre_start(ids, (uid_of("a"), "main")).started
    _crash(alloc)
    record = _restarted(tmp_path, pods).get(uid_of("a"), "main")
    assert record is not None and record.started


def test_a_restart_of_a_started_container_needs_no_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing changes and nothing is unwritten: answered, the disk full or not."""
    pods = FakePods([make_pod("a", [("main", 50, 4)])])
    alloc = make_allocator(tmp_path, pods)
    alloc.probe_checkpoint()
    ids = core_ids(0, 50)
    alloc.allocate(ids)
    alloc.pre_start(ids, (uid_of("a"), "main"))
    _disk_full(monkeypatch)
    assert alloc.pre_start(ids, (uid_of("a"), "main")).started


def test_a_take_over_of_a_freed_allocation_that_cannot_be_written_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b's IDs were matched to a (first in line); a is deleted before its start; b starts with those IDs
    and takes a's allocation over. Unwritten, a restart would find a's allocation freed and b holding
    nothing while it runs on a's GPU."""
    a, b = uid_of("a"), uid_of("b")
    pods = FakePods([make_pod("a", [("main", 50, 4)]), make_pod("b", [("main", 50, 4)], created=LATER)])
    alloc = make_allocator(tmp_path, pods)
    alloc.probe_checkpoint()
    ids = core_ids(0, 50)
    alloc.allocate(ids)
    guessed = alloc.get(a, "main")
    assert guessed is not None
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != a]
    alloc.release_pod(a)
    _disk_full(monkeypatch)
    _refused(alloc, ids, (b, "main"))
    monkeypatch.undo()
    started = alloc.pre_start(ids, (b, "main"))
    assert started.key == (b, "main") and started.minors == guessed.minors
    _crash(alloc)
    record = _restarted(tmp_path, pods).get(b, "main")
    assert record is not None and record.started and record.minors == guessed.minors
    assert record.answered == (a, "main")


def test_a_take_over_refused_unwritten_is_made_again_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = uid_of("a"), uid_of("b")
    pods = FakePods([make_pod("a", [("main", 50, 4)]), make_pod("b", [("main", 50, 4)], created=LATER)])
    alloc = make_allocator(tmp_path, pods)
    alloc.probe_checkpoint()
    ids = core_ids(0, 50)
    alloc.allocate(ids)
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != a]
    alloc.release_pod(a)
    _disk_full(monkeypatch)
    _refused(alloc, ids, (b, "main"))
    _crash(alloc)
    monkeypatch.undo()
    after = _restarted(tmp_path, pods)
    started = after.pre_start(ids, (b, "main"))
    assert started.key == (b, "main") and started.answered == (a, "main")


def test_a_gathering_of_split_records_that_cannot_be_written_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The records of d's IDs lie in c and in d (tests/test_model_seed1377_review10.py); d's start gathers
    them in d. Unwritten, a restart would leave one in c, freed (and given out) when c ends while d's
    container runs on it."""
    pods = FakePods(
        [_pod("a", 1, init=False, cores=20, blocks=8), _pod("b", 2, init=False, cores=20, blocks=8)]
        + [_pod(n, i, init=True, cores=20, blocks=8) for i, n in ((3, "c"), (4, "d"))]
    )
    alloc = make_allocator(tmp_path, pods)
    alloc.probe_checkpoint()
    ids_a, ids_b, ids_c, ids_d = core_ids(0, 20), core_ids(1, 20), core_ids(2, 20), core_ids(3, 20)
    alloc.allocate(ids_b)
    alloc.allocate(ids_c)
    alloc.allocate(ids_c)
    answer_d_setup = _mounted(alloc.allocate(ids_d))
    answer_d_main = _mounted(alloc.allocate(ids_d))
    alloc.allocate(ids_a)
    _start(alloc, ids_c, ("c", "main"))
    _start(alloc, ids_a, ("a", "main"))
    _start(alloc, ids_b, ("b", "main"))
    split = {a.key[0] for a in alloc.allocations() if frozenset(a.device_ids) == frozenset(ids_d)}
    assert split == {uid_of("c"), uid_of("d")}
    _disk_full(monkeypatch)
    _refused(alloc, ids_d, (uid_of("d"), "main"))
    monkeypatch.undo()
    assert {answer_d_setup, answer_d_main} <= _start(alloc, ids_d, ("d", "main"))
    _crash(alloc)
    after = _restarted(tmp_path, pods)
    held = {a.key: a.answered for a in after.allocations() if frozenset(a.device_ids) == frozenset(ids_d)}
    assert held == {(uid_of("d"), "setup"): answer_d_setup, (uid_of("d"), "main"): answer_d_main}
