"""The checkpoint journal under crashes and failing disks: nothing answered is lost, nothing refused comes back."""

from __future__ import annotations

import errno
import itertools
import json
import os
from pathlib import Path

import pytest

from gpumanager.allocation import journal
from gpumanager.allocation.allocator import AllocationError, _put, _put_text
from gpumanager.allocation.records import ContainerAllocation
from tests.alloc_fixtures import FakePods, make_allocator


def _alloc(i: int) -> ContainerAllocation:
    return ContainerAllocation(
        pod_uid=f"pod-{i}", container="main", minors=(i % 4,), cores=100, memory=1 << 30, namespace="ns"
    )


def _store_with(tmp_path: Path, count: int) -> tuple[Path, journal.CheckpointStore]:
    """A store with an empty snapshot and ``count`` puts journaled after it (closed)."""
    path = tmp_path / "cp"
    store = journal.CheckpointStore(path)
    store.load()
    store.write_snapshot({"PodGPUMapping": {}}, store.switch())
    for i in range(count):
        a = _alloc(i)
        store.record(_put(a))
    store.close()
    return path, store


def _segment(path: Path) -> Path:
    (seg,) = [p for p in path.parent.glob(path.name + ".journal-*") if p.name.split("-")[-1].isdigit()]
    return seg


def _offsets(data: bytes) -> list[int]:
    """Where each record of a segment starts."""
    starts, pos = [], 0
    while pos < len(data) and data[pos] != 0:
        starts.append(pos)
        pos = data.index(b"\n", pos) + 1
    return starts


def test_a_crash_after_a_damaged_segment_was_set_aside_loses_nothing_at_the_next_start(tmp_path: Path) -> None:
    """A start that finds damage replays what it can and sets the segment aside; if it dies before its
    snapshot holds what it replayed, the next start must still have those changes, and report the damage."""
    path, _ = _store_with(tmp_path, 4)
    seg = _segment(path)
    data = bytearray(seg.read_bytes())
    third = _offsets(bytes(data))[2]
    data[third + 20] ^= 0x01  # a bit flip in the third record's body
    seg.write_bytes(bytes(data))

    first = journal.CheckpointStore(path).load()  # this start dies before writing its snapshot
    assert first.problems and f"offset {third}" in first.problems[0]
    assert {"pod-0", "pod-1"} <= set(first.document["PodGPUMapping"]) if first.document else False

    again = journal.CheckpointStore(path).load()
    assert again.document is not None
    assert {"pod-0", "pod-1"} <= set(again.document["PodGPUMapping"])
    assert again.problems and str(seg) in again.problems[0] and f"offset {third}" in again.problems[0]
    assert list(path.parent.glob(seg.name + ".corrupt-*")), "a copy is kept aside for the operator"


def test_records_after_a_damaged_one_in_the_same_segment_are_replayed(tmp_path: Path) -> None:
    """Each record has its own checksum: one flipped bit costs that record, not the rest of its segment."""
    path, _ = _store_with(tmp_path, 6)
    seg = _segment(path)
    data = bytearray(seg.read_bytes())
    second = _offsets(bytes(data))[1]
    data[second + 30] ^= 0x10
    seg.write_bytes(bytes(data))

    loaded = journal.CheckpointStore(path).load()
    assert loaded.document is not None
    assert set(loaded.document["PodGPUMapping"]) == {"pod-0", "pod-2", "pod-3", "pod-4", "pod-5"}
    assert loaded.problems and f"damaged record at offset {second}" in loaded.problems[0]


def test_zeros_in_the_middle_of_a_segment_cost_only_the_records_they_cover(tmp_path: Path) -> None:
    """A block read back empty in the middle: the records after it are replayed, the damage reported."""
    path, _ = _store_with(tmp_path, 6)
    seg = _segment(path)
    data = bytearray(seg.read_bytes())
    starts = _offsets(bytes(data))
    data[starts[2] : starts[3]] = b"\0" * (starts[3] - starts[2])
    seg.write_bytes(bytes(data))

    loaded = journal.CheckpointStore(path).load()
    assert loaded.document is not None
    assert set(loaded.document["PodGPUMapping"]) == {"pod-0", "pod-1", "pod-3", "pod-4", "pod-5"}
    assert loaded.problems and f"offset {starts[2]}" in loaded.problems[0]


def test_a_record_whose_write_failed_is_not_read_back_from_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After EIO the page cache may still hold what the failed write copied into it: a restart (not a
    reboot) would read the refused change back as if it had been answered."""
    path, _ = _store_with(tmp_path, 1)
    store = journal.CheckpointStore(path)
    store.load()
    real = os.pwrite
    calls: list[int] = []

    def written_then_eio(fd: int, data: bytes, offset: int) -> int:
        calls.append(offset)
        if len(calls) == 1:  # the record's write (the next one clears it)
            real(fd, data, offset)  # into the page cache; the flush O_DSYNC asks for fails
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", written_then_eio)
    refused = _alloc(7)
    with pytest.raises(OSError):
        store.sync(store.stage(_put(refused), _put_text(refused)))
    monkeypatch.setattr(os, "pwrite", real)
    store.close()

    loaded = journal.CheckpointStore(path).load()  # the agent restarted before a snapshot was written
    assert loaded.document is not None
    assert "pod-7" not in loaded.document["PodGPUMapping"]
    assert "pod-0" in loaded.document["PodGPUMapping"]


class _Crash(BaseException):
    """The agent dying at this point."""


def test_a_crash_while_setting_an_unusable_checkpoint_aside_never_replays_its_journal_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unusable snapshot is set aside with its journal. Were the snapshot moved first and the start to
    die before the segments follow, the next start would replay the segments over nothing, reporting
    nothing: every allocation the snapshot held gone from our records without a word."""
    pods = FakePods()
    alloc = make_allocator(tmp_path, pods)
    path = alloc.checkpoint_path
    store = journal.CheckpointStore(path)
    store.load()
    seq = store.switch()
    store.write_snapshot({"PodGPUMapping": {"held": {"c": {"Devices": ["/dev/nvidia0"], "Cores": 100}}}}, seq)
    store.record(_put(_alloc(1)))
    store.close()
    path.write_text(json.dumps({"PodGPUMapping": ["held"], "JournalSegment": seq}))  # unusable: a list

    def dies(self: journal.CheckpointStore, why: str) -> None:
        raise _Crash

    monkeypatch.setattr(journal.CheckpointStore, "set_aside_segments", dies)
    with pytest.raises(_Crash):
        alloc.load()
    monkeypatch.undo()

    with pytest.raises(AllocationError):  # the next start finds the unusable snapshot again
        make_allocator(tmp_path, pods).load()
    assert not journal.CheckpointStore(path).exists(), "and its journal set aside with it"


def test_allocation_error_is_what_an_unusable_snapshot_raises(tmp_path: Path) -> None:
    """(The start's path the crash test above interrupts.)"""
    alloc = make_allocator(tmp_path, FakePods())
    path = alloc.checkpoint_path
    path.parent.mkdir(parents=True)
    path.write_text('{"PodGPUMapping": ["held"]}')
    with pytest.raises(AllocationError):
        alloc.load()
    assert not path.exists()


def test_damage_then_whole_records_then_a_last_record_cut_short(tmp_path: Path) -> None:
    """Reading goes on past the damage, and a last record cut short by a crash is still only that."""
    path, _ = _store_with(tmp_path, 5)
    seg = _segment(path)
    data = bytearray(seg.read_bytes())
    starts = _offsets(bytes(data))
    data[starts[1] + 25] ^= 0x04
    end = data.index(b"\0", starts[4])
    data[starts[4] + 30 : end] = b"\0" * (end - starts[4] - 30)  # the last write cut short
    seg.write_bytes(bytes(data))

    loaded = journal.CheckpointStore(path).load()
    assert loaded.document is not None
    assert set(loaded.document["PodGPUMapping"]) == {"pod-0", "pod-2", "pod-3"}
    assert len(loaded.problems) == 1 and f"damaged record at offset {starts[1]}" in loaded.problems[0]
    assert f"offset {starts[4]}" not in loaded.problems[0]


def test_zeros_between_every_record_cost_no_record(tmp_path: Path) -> None:
    """Many gaps (each read as damage) are each passed over once; the problem line stays short."""
    path, _ = _store_with(tmp_path, 40)
    seg = _segment(path)
    data = seg.read_bytes()
    starts = [*_offsets(data), data.index(b"\0")]
    gapped = b"".join(data[a:b] + b"\0" * 8 for a, b in itertools.pairwise(starts))
    seg.write_bytes(gapped + b"\0" * (len(data) - len(gapped)))

    loaded = journal.CheckpointStore(path).load()
    assert loaded.document is not None
    assert set(loaded.document["PodGPUMapping"]) == {f"pod-{i}" for i in range(40)}
    (problem,) = loaded.problems
    assert problem.startswith(f"journal {seg}: zeros at offset {starts[1]} with records after them")
    assert "more problems" in problem and len(problem) < 600


def test_an_entry_from_the_journal_that_cannot_be_trusted_is_named_with_its_segment_and_offset(
    tmp_path: Path,
) -> None:
    """The snapshot may hold another value, or none: the operator is told where the one refused was read."""
    alloc = make_allocator(tmp_path, FakePods())
    path = alloc.checkpoint_path
    store = journal.CheckpointStore(path)
    store.load()
    store.write_snapshot({"PodGPUMapping": {}}, store.switch())
    uid = "0c1f6c2e-3d55-4c4e-9a43-1f4a4f1b2c3d"
    good = {"Devices": ["/dev/nvidia0"], "Cores": 100, "Memory": 1 << 30}
    store.record({"op": "put", "pod": uid, "container": "a", "entry": good})
    store.record({"op": "put", "pod": uid, "container": "b", "entry": {**good, "Devices": ["/dev/nvidia1"]}})
    store.record({"op": "put", "pod": uid, "container": "b", "entry": {**good, "Cores": 150}})
    store.close()
    seg = _segment(path)
    third = _offsets(seg.read_bytes())[2]

    parsed = alloc.load()
    assert parsed.untrusted == [(uid, "b")]
    (problem,) = [p for p in parsed.problems if "container b" in p]
    assert "Cores 150" in problem and f"{seg} at offset {third}" in problem


def test_a_journal_entry_naming_a_gpu_this_node_lacks_is_named_with_its_segment_and_offset(tmp_path: Path) -> None:
    alloc = make_allocator(tmp_path, FakePods())
    path = alloc.checkpoint_path
    store = journal.CheckpointStore(path)
    store.load()
    store.write_snapshot({"PodGPUMapping": {}}, store.switch())
    uid = "0c1f6c2e-3d55-4c4e-9a43-1f4a4f1b2c3d"
    store.record(
        {"op": "put", "pod": uid, "container": "a", "entry": {"Devices": ["/dev/nvidia9"], "Cores": 100, "Memory": 0}}
    )
    store.close()

    parsed = alloc.load()
    (problem,) = parsed.problems
    assert "not on this node" in problem and f"{_segment(path)} at offset 0" in problem


def test_a_change_whose_write_failed_is_never_reported_durable_however_many_failures_follow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that staged its change and looks for the outcome late (preempted between staging under the
    allocator's lock and waiting) must learn that its write failed, even after many more failures, each
    followed by a snapshot that let changes be staged again."""
    path, _ = _store_with(tmp_path, 0)
    store = journal.CheckpointStore(path)
    store.load()

    def eio(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pwrite", eio)
    late = store.stage(_put(_alloc(0)))
    for i in range(1, 40):
        with pytest.raises(OSError):
            store.sync(store.stage(_put(_alloc(i))))  # written with the late one's change: both fail
        store.write_snapshot({"PodGPUMapping": {}}, store.switch())  # the state written whole: staging resumes
    with pytest.raises(OSError):
        store.sync(late)


def test_where_hard_links_cannot_be_made_the_damaged_segment_is_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = _store_with(tmp_path, 3)
    seg = _segment(path)
    data = bytearray(seg.read_bytes())
    data[30] ^= 0x01
    seg.write_bytes(bytes(data))

    def no_links(src: object, dst: object, **_: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    loaded = journal.CheckpointStore(path).load()
    assert loaded.problems
    (copy,) = tmp_path.glob(seg.name + ".corrupt-*")
    assert copy.read_bytes() == bytes(data) and seg.exists() and not copy.samefile(seg)
