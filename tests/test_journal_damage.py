"""The checkpoint journal under damage, odd input and failing disks: nothing answered is lost without a
word, nothing released comes back, and no input ends the start in a traceback."""

from __future__ import annotations

import errno
import json
import os
import zlib
from pathlib import Path
from typing import Any

import pytest

from gpumanager.allocation import journal
from gpumanager.allocation.allocator import AllocationError
from gpumanager.allocation.journal import CheckpointStore
from gpumanager.allocation.records import ContainerAllocation
from tests.alloc_fixtures import FakePods, make_allocator

NAME = "gpumanager_internal_checkpoint"
UID = "0b1e0c2a-0000-4000-8000-0000000000%02d"


def put(pod: str, cores: int = 1) -> dict[str, Any]:
    return {
        "op": "put",
        "pod": pod,
        "container": "c",
        "entry": {"Devices": ["/dev/nvidia0"], "Cores": cores, "Memory": 0},
    }


def journal_of(tmp_path: Path, count: int) -> tuple[Path, Path, list[int]]:
    """A journal of ``count`` puts in one segment: the checkpoint path, the segment and each record's offset."""
    path = tmp_path / NAME
    store = CheckpointStore(path)
    offsets = []
    for i in range(count):
        offsets.append(store._segment.offset if store._segment is not None else 0)
        store.record(put(f"pod{i}"))
    assert store._segment is not None
    segment = store._segment.path
    store.close()
    return path, segment, offsets


def overwrite(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("damage", "at"),
    [
        (b"\0" * 20, 30),  # a block read back as zeros inside record 10
        (b"\0", 0),  # zeros at the start of record 10
        (b"8", 0),  # record 10's length field: 0x8... reaches past every later record
    ],
    ids=["zeros-inside", "zeros-at-start", "length-field"],
)
def test_damage_before_written_records_is_reported_not_taken_for_the_end(
    tmp_path: Path, damage: bytes, at: int
) -> None:
    path, segment, offsets = journal_of(tmp_path, 40)
    overwrite(segment, offsets[10] + at, damage)
    loaded = CheckpointStore(path).load()
    assert loaded.document is not None
    # Every record but the damaged one (each has its own checksum: reading goes on at the next whole one).
    assert set(loaded.document["PodGPUMapping"]) == {f"pod{i}" for i in range(40)} - {"pod10"}
    assert loaded.problems and str(segment) in loaded.problems[0], "damage taken for the end without a word"
    assert f"offset {offsets[10]}" in loaded.problems[0]
    # A copy is kept aside; the segment stays until the start's snapshot holds what was read from it.
    assert segment.exists() and list(tmp_path.glob(NAME + ".journal-*.corrupt-*"))


def test_zeros_inside_an_older_segment_are_damage_too(tmp_path: Path) -> None:
    path, segment, offsets = journal_of(tmp_path, 20)
    overwrite(segment, offsets[5], b"\0")
    store = CheckpointStore(path)
    store.load(quarantine=False)
    store.switch()
    store.record(put("later"))
    store.close()
    loaded = CheckpointStore(path).load(quarantine=False)
    assert loaded.problems and str(segment) in loaded.problems[0]


def test_a_write_cut_short_while_a_spare_segment_waits_is_the_end_not_damage(tmp_path: Path) -> None:
    """The compactor prepares the next segment ahead of need: the segment written to is then not the last
    file, and a crash in its last write must still read as the end of the journal."""
    path = tmp_path / NAME
    store = CheckpointStore(path)
    store.record(put("kept"))
    store.set_spare(store.make_spare(store.reserve()))
    segment = store._segment
    assert segment is not None
    record = journal._record(put("torn"))
    overwrite(segment.path, segment.offset, record[: len(record) // 2])  # a crash mid-write, no close
    loaded = CheckpointStore(path).load()
    assert loaded.problems == []
    assert loaded.document is not None and list(loaded.document["PodGPUMapping"]) == ["kept"]
    assert segment.path.exists()


def test_the_last_record_cut_short_is_still_ignored(tmp_path: Path) -> None:
    path, segment, offsets = journal_of(tmp_path, 5)
    data = segment.read_bytes()
    end = data.index(b"\0")
    overwrite(segment, offsets[4] + 30, b"\0" * (end - offsets[4] - 30))
    loaded = CheckpointStore(path).load()
    assert loaded.problems == []
    assert loaded.document is not None and len(loaded.document["PodGPUMapping"]) == 4


def _segment_record(change: Any) -> bytes:
    body = json.dumps(change).encode()
    return b"%08x %08x " % (len(body), zlib.crc32(body)) + body + b"\n"


@pytest.mark.parametrize(
    "case",
    [
        "mapping-null",
        "pod-entry-a-list",
        "pod-entry-a-string",
        "nested-too-deep",
        "segment-a-directory",
        "batch-not-a-list",
        "device-number-too-long",
    ],
)
def test_odd_checkpoints_are_set_aside_or_read_never_a_traceback(tmp_path: Path, case: str) -> None:
    path = tmp_path / "checkpoint" / NAME
    path.parent.mkdir()
    pod = UID % 1
    snapshot: bytes = b'{"PodGPUMapping": {}}'
    records: list[Any] = []
    # JournalSegment 0: a snapshot of this agent, which its journal continues.
    if case == "mapping-null":
        snapshot, records = b'{"PodGPUMapping": null, "JournalSegment": 0}', [put(pod, 50)]
    elif case == "pod-entry-a-list":
        snapshot, records = json.dumps({"PodGPUMapping": {pod: []}, "JournalSegment": 0}).encode(), [put(pod, 50)]
    elif case == "pod-entry-a-string":
        snapshot, records = json.dumps({"PodGPUMapping": {pod: "x"}, "JournalSegment": 0}).encode(), [put(pod, 50)]
    elif case == "nested-too-deep":
        snapshot = b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    elif case == "segment-a-directory":
        (path.parent / (NAME + ".journal-9")).mkdir()
    elif case == "batch-not-a-list":
        (path.parent / (NAME + ".journal-9")).write_bytes(_segment_record({"batch": 5}))
    else:
        entry = {"Devices": ["/dev/nvidia" + "7" * 5000], "Cores": 50, "Memory": 0}
        snapshot = json.dumps({"PodGPUMapping": {pod: {"c": entry}}}).encode()
    path.write_bytes(snapshot)
    if records:
        store = CheckpointStore(path)
        for r in records:
            store.record(r)
        store.close()
    allocator = make_allocator(tmp_path, FakePods([]))
    try:
        try:
            parsed = allocator.load()
        except AllocationError as exc:
            assert exc.kind == "unavailable" and str(path) in str(exc)
            assert list(path.parent.glob(NAME + ".corrupt-*")), "the unusable snapshot is set aside"
        else:
            if case in ("mapping-null", "pod-entry-a-list", "pod-entry-a-string"):
                assert [a.pod_uid for a in parsed.allocations] == [pod], "the journal's newer entry is kept"
            if case == "segment-a-directory":
                assert parsed.problems and "journal-9" in parsed.problems[0]
    finally:
        allocator.close()


def test_after_an_unusable_snapshot_its_journal_is_never_replayed_over_newer_state(tmp_path: Path) -> None:
    """The snapshot is damaged; the agent rebuilds from the kubelet's records and carries on. Neither the
    old journal, nor new segments numbered like old ones, may bring back what it released since."""
    path = tmp_path / "checkpoint" / NAME

    def alloc(i: int) -> ContainerAllocation:
        return ContainerAllocation(pod_uid=UID % i, container="c", minors=(0,), cores=10, memory=0)

    first = make_allocator(tmp_path, FakePods([]))
    first.load()
    for i in range(1, 5):
        first.adopt([alloc(i)], source="test")
        first.probe_checkpoint()  # a new segment each time: the journal's numbers go up
    first.adopt([alloc(9)], source="test")  # in the journal only; then the agent is killed
    path.write_bytes(b'{"PodGPUMapping": {"bro')
    second = make_allocator(tmp_path, FakePods([]))
    with pytest.raises(AllocationError):
        second.load()
    second.adopt([alloc(i) for i in range(1, 5)], source="kubelet")  # pod 9 has ended meanwhile
    second.compact()
    second.close()
    third = make_allocator(tmp_path, FakePods([]))
    third.load()
    try:
        assert not third.holds((UID % 9, "c")), "a pod released before the restart came back"
        assert all(third.holds((UID % i, "c")) for i in range(1, 5))
    finally:
        third.close()


def test_a_change_staged_behind_a_failed_write_is_refused_even_after_a_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write fails in a new segment; the compactor's snapshot (of the state before it) clears the error;
    a change staged behind the hole before the failure was known must fail, not be answered and lost."""
    path = tmp_path / NAME
    store = CheckpointStore(path)
    store.record(put("old"))
    seq = store.switch()
    first = store.stage(put("A"))
    second = store.stage(put("B"))  # staged before A's write fails
    real = os.pwrite
    calls = []

    def fail_once(fd: int, data: bytes, offset: int) -> int:
        calls.append(offset)
        if len(calls) == 1:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", fail_once)
    with pytest.raises(OSError):
        store.sync(first)
    store.write_snapshot({"PodGPUMapping": {"old": {"c": put("old")["entry"]}}}, seq)
    with pytest.raises(OSError):
        store.sync(second)
    third = store.stage(put("C"))  # a new segment: nothing behind a hole
    store.sync(third)
    store.close()
    loaded = CheckpointStore(path).load()
    assert loaded.problems == []
    assert loaded.document is not None and sorted(loaded.document["PodGPUMapping"]) == ["C", "old"]


def test_a_segment_that_cannot_be_prepared_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path / NAME)
    real = os.write
    monkeypatch.setattr(
        os,
        "write",
        lambda fd, data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")),
    )
    for _ in range(3):
        with pytest.raises(OSError):
            store.record(put("x"))
    monkeypatch.setattr(os, "write", real)
    assert list(tmp_path.glob("*.tmp")) == []
    (tmp_path / (NAME + ".journal-77.tmp")).write_bytes(b"\0" * 10)  # left by a crash mid-preparation
    CheckpointStore(tmp_path / NAME).load()
    assert list(tmp_path.glob("*.tmp")) == []


def test_the_error_text_names_the_errno_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(tmp_path / NAME)
    store.record(put("a"))
    monkeypatch.setattr(
        os, "pwrite", lambda fd, data, offset: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error"))
    )
    with pytest.raises(OSError) as first:
        store.record(put("b"))
    with pytest.raises(OSError) as later:
        store.record(put("c"))
    for exc in (first.value, later.value):
        assert str(exc).count("[Errno 5]") == 1, str(exc)


def test_a_healthy_checkpoint_is_not_rewritten_by_the_periodic_check(tmp_path: Path) -> None:
    from gpumanager.allocation.check import AllocationCheck

    allocator = make_allocator(tmp_path, FakePods([]))
    allocator.load()
    allocator.probe_checkpoint()
    pods = FakePods([])
    check = AllocationCheck(
        allocator,
        pods,
        period=3600,
        annotate=lambda uid: None,
        delete_failed=lambda pod: None,
        collect_dirs=lambda *a, **k: None,
        wait_synced=lambda timeout: True,
    )
    directory = tmp_path / "checkpoint"
    before = sorted(p.name for p in directory.iterdir())
    snapshot = (directory / NAME).stat().st_mtime_ns
    for _ in range(3):
        check.check()
    assert sorted(p.name for p in directory.iterdir()) == before, "a new segment for nothing"
    assert (directory / NAME).stat().st_mtime_ns == snapshot
    assert allocator.checkpoint_error == ""
    (directory / NAME).unlink()
    (directory / NAME / "not-a-file").mkdir(parents=True)  # the snapshot can no longer be written
    check.check()
    assert str(directory / NAME) in allocator.checkpoint_error, "the check still finds an unwritable one"
    allocator.close()
