"""Device-plugin changes whose checkpoint write fails: what memory holds against what the next start reads.

A release of an ended pod and an adoption from the kubelet's records are derived again at the next start (the
pod is still gone, the kubelet still holds the IDs), so a write lost with a restart is redone; a journal
damaged at start stays on disk until the whole state is written, so the start after a failed write finds the
damage again. A PreStartContainer swap is the kubelet's word, given once: answered while its record is not
durable, a restart brings back the records as they were before it."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from gpumanager.allocation import journal
from gpumanager.allocation.allocator import AllocationError, Allocator
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of
from tests.test_dra_checkpoint import Node, api_claim


def _full(self: object, *args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _disk_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal._Segment, "write_at", _full)
    monkeypatch.setattr(journal.CheckpointStore, "write_snapshot", _full)


def _crash(alloc: Allocator) -> None:
    """The process ends without its stop: nothing written at stop."""
    alloc._closing.set()
    alloc._store.close()


def test_a_release_that_cannot_be_written_is_made_again_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pods = FakePods([make_pod("a", [("main", 50, 4)]), make_pod("b", [("main", 30, 4)])])
    alloc = make_allocator(tmp_path, pods)
    alloc.probe_checkpoint()
    for name, ids in (("a", core_ids(0, 50)), ("b", core_ids(1, 30))):
        alloc.allocate(ids)
        alloc.pre_start(ids, (uid_of(name), "main"))
    _disk_full(monkeypatch)
    pods.items = [p for p in pods.items if p["metadata"]["name"] != "a"]  # a ended and was deleted
    assert alloc.recycle() == [uid_of("a")]
    assert alloc.checkpoint_error, "the release is in memory only"
    _crash(alloc)
    monkeypatch.undo()
    after = make_allocator(tmp_path, pods)
    after.load()
    assert {a.pod_uid for a in after.allocations()} == {uid_of("a"), uid_of("b")}, "the checkpoint had a"
    assert after.recycle() == [uid_of("a")], "a is still gone: released again at the first look"
    _crash(after)
    third = make_allocator(tmp_path, pods)
    third.load()
    assert {a.pod_uid for a in third.allocations()} == {uid_of("b")}


def test_a_damaged_journal_whose_state_cannot_be_written_at_start_is_found_damaged_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start that found damage writes the whole state; when it cannot, the damaged segment is left in
    place, so the next start doubts the claims again (a release lost with it is checked)."""
    api = {"one": api_claim("u1", "one"), "two": api_claim("u2", "two")}
    node = Node(tmp_path, api)
    node.allocator.probe_checkpoint()
    node.prepare("u1", "one")
    node.allocator.compact()  # u1 in the snapshot
    node.prepare("u2", "two")
    (segment,) = (tmp_path / "cp").glob("gpumanager_internal_checkpoint.journal-*")
    data = bytearray(segment.read_bytes())
    data[30] ^= 0xFF  # u2's record damaged
    segment.write_bytes(bytes(data))
    _disk_full(monkeypatch)
    first = Node(tmp_path, api)
    first.allocator.load()
    assert first.allocator.claims_in_doubt and first.allocator.checkpoint_error
    _crash(first.allocator)
    monkeypatch.undo()
    second = Node(tmp_path, api)
    loaded = second.allocator.load()
    assert second.allocator.claims_in_doubt and loaded.problems
    second.preparer.restore_files(verify_recovered=True)
    assert [c.uid for c in second.allocator.claims()] == ["u1", "u2"], "u2 rebuilt from its files and the API server"


def test_a_prestart_swap_that_cannot_be_written_is_not_answered_as_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """x and y ask for the same cores; the kubelet gives y the IDs matched to x (first) and x the others. y's
    start swaps the two records. When that cannot be written, PreStartContainer must fail (the kubelet
    retries it, and the retry writes the state) or else the swap must be what the next start reads: answered
    'done' unwritten, a restart brings back x holding the GPUs y runs on, freed when x ends while y runs."""
    later = "2026-11-21T10:00:01Z"
    pods = FakePods([make_pod("x", [("main", 60, 4)]), make_pod("y", [("main", 60, 4)], created=later)])
    alloc = make_allocator(tmp_path, pods)
    alloc.probe_checkpoint()
    first, second = core_ids(2, 60), core_ids(3, 60)
    alloc.allocate(first)
    alloc.allocate(second)
    x_record, y_record = alloc.get(uid_of("x"), "main"), alloc.get(uid_of("y"), "main")
    assert x_record is not None and frozenset(x_record.device_ids) == frozenset(first)
    assert y_record is not None and y_record.minors != x_record.minors
    gpus_of_first = x_record.minors
    monkeypatch.setattr(journal._Segment, "write_at", _full)
    try:
        started = alloc.pre_start(first, (uid_of("y"), "main"))
    except AllocationError:
        return  # refused: the kubelet retries the start
    assert started.minors == gpus_of_first
    _crash(alloc)
    monkeypatch.undo()
    after = make_allocator(tmp_path, pods)
    after.load()
    y = after.get(uid_of("y"), "main")
    assert y is not None and y.minors == gpus_of_first and y.started, "y runs on the GPUs of the IDs it got"
