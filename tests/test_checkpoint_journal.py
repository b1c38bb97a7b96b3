"""The checkpoint journal: every change durable at once, the snapshot kept in upstream's shape, damage found."""

from __future__ import annotations

import errno
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpumanager.allocation import journal
from gpumanager.allocation.allocator import AllocationError, Allocator
from gpumanager.allocation.journal import CheckpointStore, read_document
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of
from tests.wakeups import ASLEEP, idle_switches, named_thread, wait_until


def put(pod: str, container: str, cores: int) -> dict[str, object]:
    entry = {"Devices": ["/dev/nvidia0"], "Cores": cores, "Memory": 0}
    return {"op": "put", "pod": pod, "container": container, "entry": entry}


def test_changes_are_replayed_over_a_stale_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "gpumanager_internal_checkpoint"
    store = CheckpointStore(path)
    store.write_snapshot({"PodGPUMapping": {}}, store.switch())
    store.record(put("a", "c", 30))
    store.record({"batch": [put("b", "c", 40), put("a", "c", 50)]})
    store.record({"op": "del", "pod": "b", "container": "c"})
    store.close()
    assert json.loads(path.read_text())["PodGPUMapping"] == {}, "the snapshot is written later"
    loaded = CheckpointStore(path).load()
    assert loaded.problems == [] and loaded.replayed == 3
    assert loaded.document == {"PodGPUMapping": {"a": {"c": put("a", "c", 50)["entry"]}}}


def test_a_record_cut_short_at_the_end_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "cp"
    store = CheckpointStore(path)
    store.write_snapshot({"PodGPUMapping": {}}, store.switch())
    store.record(put("a", "c", 30))
    store.record(put("b", "c", 40))
    store.close()
    segment = next(tmp_path.glob("cp.journal-*"))
    data = bytearray(segment.read_bytes())
    end = data.index(b"\0")
    data[end - 10 : end] = b"\0" * 10  # the last write reached the disk only in part
    segment.write_bytes(bytes(data))
    loaded = CheckpointStore(path).load()
    assert loaded.problems == []
    assert loaded.document == {"PodGPUMapping": {"a": {"c": put("a", "c", 30)["entry"]}}}


def test_damage_inside_the_journal_is_reported_and_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "cp"
    store = CheckpointStore(path)
    store.write_snapshot({"PodGPUMapping": {}}, store.switch())
    store.record(put("a", "c", 30))
    store.record(put("b", "c", 40))
    store.close()
    segment = next(tmp_path.glob("cp.journal-*"))
    data = bytearray(segment.read_bytes())
    data[25] ^= 0xFF  # a flipped byte inside the first record
    segment.write_bytes(bytes(data))
    loaded = CheckpointStore(path).load()
    assert len(loaded.problems) == 1 and "damaged record at offset 0" in loaded.problems[0]
    assert str(segment) in loaded.problems[0]
    assert list(tmp_path.glob("cp.journal-*.corrupt-*")), "a copy kept for the operator"
    # The segment itself stays until the start's snapshot holds what was read from it.
    assert segment.exists()
    store = CheckpointStore(path)
    store.load()
    store.write_snapshot(loaded.document or {}, store.switch())
    assert not segment.exists()


def test_compaction_writes_upstreams_snapshot_and_drops_old_segments(tmp_path: Path) -> None:
    pods = FakePods([make_pod("a", [("c", 50, 4)])])
    alloc = make_allocator(tmp_path, pods)
    alloc.probe_checkpoint()
    alloc.allocate(core_ids(0, 50))
    path = tmp_path / "checkpoint" / "gpumanager_internal_checkpoint"
    assert json.loads(path.read_text())["PodGPUMapping"] == {}
    assert uid_of("a") in (read_document(path) or {})["PodGPUMapping"]
    before = {p.name for p in path.parent.glob("gpumanager_internal_checkpoint.journal-*")}
    alloc.compact()
    assert json.loads(path.read_text())["PodGPUMapping"][uid_of("a")]["c"]["Cores"] == 50
    after = {p.name for p in path.parent.glob("gpumanager_internal_checkpoint.journal-*")}
    assert len(after) == 1 and not before & after, "the segment the snapshot holds is gone; a fresh one is open"


def test_an_agent_that_died_before_compaction_recovers_from_the_journal(tmp_path: Path) -> None:
    pods = FakePods([make_pod("a", [("c", 50, 4)]), make_pod("b", [("c", 100, 0)], created="2026-11-21T11:00:00Z")])
    first = make_allocator(tmp_path, pods)
    first.probe_checkpoint()
    first.allocate(core_ids(0, 50))
    first.allocate(core_ids(1, 100))
    first.release_pod(uid_of("a"))
    # No compaction, no close: the process is gone.
    second = make_allocator(tmp_path, pods)
    loaded = second.load()
    assert [(a.pod_uid, a.cores) for a in loaded.allocations] == [(uid_of("b"), 100)]
    assert not loaded.journal_damaged


def test_segments_fill_up_and_roll_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:

    monkeypatch.setattr(journal, "SEGMENT_BYTES", 4096)
    path = tmp_path / "cp"
    store = CheckpointStore(path)
    store.write_snapshot({"PodGPUMapping": {}}, store.switch())
    for i in range(60):
        store.record(put(f"p{i}", "c", i))
    store.close()
    assert len(list(tmp_path.glob("cp.journal-*"))) > 1
    document = CheckpointStore(path).load().document or {}
    assert sorted(document["PodGPUMapping"]) == sorted(f"p{i}" for i in range(60))


def test_a_segment_moved_aside_is_not_read_again_at_the_next_start(tmp_path: Path) -> None:
    path = tmp_path / "cp"
    store = CheckpointStore(path)
    store.write_snapshot({"PodGPUMapping": {}}, store.switch())
    store.record(put("a", "c", 30))
    store.record(put("b", "c", 40))
    store.close()
    segment = next(tmp_path.glob("cp.journal-*"))
    data = bytearray(segment.read_bytes())
    data[25] ^= 0xFF
    segment.write_bytes(bytes(data))
    first = CheckpointStore(path)
    found = first.load()
    assert found.problems
    first.write_snapshot(found.document or {}, first.switch())  # as a start does after damage
    (aside,) = tmp_path.glob("cp.journal-*.corrupt-*")
    kept = aside.read_bytes()
    # The next start sees no damage (the operator has the file), replays nothing from it, and numbers
    # its own segments after the live ones, not after the time in the name of the one moved aside.
    again = CheckpointStore(path)
    loaded = again.load()
    assert (loaded.problems, loaded.replayed) == ([], 0)
    assert loaded.document == {"PodGPUMapping": {"b": {"c": {"Cores": 40, "Devices": ["/dev/nvidia0"], "Memory": 0}}}}
    assert again.switch() == 3  # after segment 2, the one the first start opened
    assert list(tmp_path.glob("cp.journal-*.corrupt-*")) == [aside] and aside.read_bytes() == kept


class GatedWrites:
    """Journal writes held at a gate and counted (records per write); failing with ``error`` when set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gate = threading.Event()
        self.writes: list[int] = []
        self.error: OSError | None = None
        self.done: list[object] = []  # what the held calls produced (answers, refusals)
        real = journal._Segment.write_at

        def write_at(segment: journal._Segment, offset: int, data: bytes) -> None:
            self.writes.append(data.count(b"\n"))
            assert self.gate.wait(30), "the gate never opened"
            if self.error is not None:
                raise self.error
            real(segment, offset, data)

        monkeypatch.setattr(journal._Segment, "write_at", write_at)

    def hold(self, alloc: Allocator, calls: int, call: Callable[[int], None]) -> list[object]:
        """``calls`` concurrent ``call(i)`` (allocations), the first flush held at the gate until every
        call has decided and staged its record (the state shows them all) and the lock was free for
        them; returns what ``call`` had appended to ``done`` by then, then opens the gate."""
        threads = [threading.Thread(target=call, args=(i,)) for i in range(calls)]
        for t in threads:
            t.start()
        until(lambda: bool(self.writes) and len(alloc.allocations()) == calls, "allocations queued behind the disk")
        before = list(self.done)
        self.gate.set()
        for t in threads:
            t.join(30)
        return before


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def test_staged_changes_are_written_together_by_the_first_to_sync(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "gpumanager_internal_checkpoint")
    tickets = [store.stage(put(f"p{i}", "c", 10)) for i in range(10)]
    assert not store.durable(tickets[0])
    threads = [threading.Thread(target=store.sync, args=(t,)) for t in tickets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert store.durable_records == 10 and all(store.durable(t) for t in tickets)
    store.close()
    mapping = read_document(store.path)["PodGPUMapping"]  # type: ignore[index]
    assert sorted(mapping) == [f"p{i}" for i in range(10)]


def gated_allocator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pods: int
) -> tuple[FakePods, Allocator, GatedWrites]:
    """An allocator whose checkpoint exists, ``pods`` pending pods of one 10-core share each, and its
    journal writes held at a gate."""
    pending = FakePods([make_pod(f"p{i}", [("c", 10, 1)]) for i in range(pods)])
    alloc = make_allocator(tmp_path, pending)
    alloc.probe_checkpoint()
    return pending, alloc, GatedWrites(monkeypatch)


def test_concurrent_allocations_share_a_flush_and_none_is_answered_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pods, alloc, gated = gated_allocator(tmp_path, monkeypatch, 8)
    # The first flush is held at the disk; the lock is free meanwhile, so every other call decides and
    # stages its record (the state already shows it) -- but nobody has an answer yet.
    before_flush = gated.hold(alloc, 8, lambda i: gated.done.append(alloc.allocate(core_ids(0, 10, start=10 * i))))
    assert before_flush == []
    assert len(gated.done) == 8
    # Two flushes for eight changes: the first caller's, then one for everyone who staged meanwhile.
    assert len(gated.writes) == 2 and sum(gated.writes) == 8, gated.writes
    again = make_allocator(tmp_path, pods)
    assert len(again.load().allocations) == 8


def test_a_failed_flush_refuses_every_allocation_in_it_and_leaves_no_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pods, alloc, gated = gated_allocator(tmp_path, monkeypatch, 3)
    gated.error = OSError(errno.ENOSPC, "No space left on device")
    timed: list[tuple[str, float]] = []
    alloc.observe_checkpoint_writes(lambda kind, seconds: timed.append((kind, seconds)))

    def one(i: int) -> None:
        try:
            alloc.allocate(core_ids(0, 10, start=10 * i))
        except AllocationError as exc:
            gated.done.append(exc)

    gated.hold(alloc, 3, one)
    refused = [e for e in gated.done if isinstance(e, AllocationError)]
    assert len(refused) == 3
    assert all(e.kind == "unavailable" and "No space left on device" in str(e) for e in refused), refused
    assert alloc.allocations() == []
    assert [cores for _, cores, _, _, _ in alloc.tree_snapshot()] == [100] * 4
    assert alloc.checkpoint_write_failures >= 1
    assert [kind for kind, _ in timed if kind == "journal"] == [], "a write that failed is not timed"
    gated.error = None
    alloc.allocate(core_ids(1, 10))
    assert [a.pod_uid for a in make_allocator(tmp_path, pods).load().allocations] == [uid_of("p0")]


def test_a_reader_during_a_compaction_gets_every_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compaction between reading the snapshot and reading a segment (the snapshot replaced, the
    segment removed) must not make a reader fail or miss the changes folded into the new snapshot."""
    from gpumanager.allocation import journal

    path = tmp_path / "gpumanager_internal_checkpoint"
    store = CheckpointStore(path)
    store.write_snapshot({"PodGPUMapping": {}}, store.switch())
    store.record(put("a", "c", 30))
    store.record(put("b", "c", 40))
    expected = {"PodGPUMapping": {"a": {"c": put("a", "c", 30)["entry"]}, "b": {"c": put("b", "c", 40)["entry"]}}}
    real = journal._segment_bytes
    compacted: list[Path] = []

    def compact_first(segment: Path) -> bytes:
        if not compacted:  # the agent compacts right now: new snapshot, then the segment goes
            compacted.append(segment)
            store.write_snapshot(expected, store.switch())
            for p in tmp_path.glob(path.name + ".journal-*"):
                if p != store._segment.path:  # type: ignore[union-attr]
                    p.unlink()
        return real(segment)

    monkeypatch.setattr(journal, "_segment_bytes", compact_first)
    assert journal.read_document(path) == expected
    assert compacted
    store.close()


def test_the_compactor_sleeps_while_the_snapshot_is_current_and_wakes_at_a_change(tmp_path: Path) -> None:
    pods = FakePods([make_pod("a", [("c", 50, 4)])])
    alloc = make_allocator(tmp_path, pods)
    alloc.probe_checkpoint()
    alloc.start_compactor(period=0.05)
    path = tmp_path / "checkpoint" / "gpumanager_internal_checkpoint"
    try:
        wait_until(lambda: alloc._store.dirty_since is None, "the snapshot is current")
        assert idle_switches(named_thread("checkpoint")) <= ASLEEP
        alloc.allocate(core_ids(0, 50))  # the change wakes it: the snapshot follows a moment later
        wait_until(lambda: uid_of("a") in json.loads(path.read_text())["PodGPUMapping"], "the snapshot")
    finally:
        alloc.close()


def test_a_journal_older_than_a_snapshot_another_program_rewrote_is_not_replayed(tmp_path: Path) -> None:
    # This agent died with changes in its journal; upstream's gpu-manager (a downgrade) read the
    # snapshot, released pod a and rewrote the snapshot in its own shape; this agent is back.
    path = tmp_path / "cp"
    store = CheckpointStore(path)
    store.write_snapshot({"PodGPUMapping": {}}, store.switch())
    assert json.loads(path.read_text())[journal.JOURNAL_KEY] >= 0
    store.record(put("a", "c", 30))
    store.record(put("b", "c", 40))
    store.close()
    path.write_text(json.dumps({"PodGPUMapping": {"b": {"c": put("b", "c", 40)["entry"]}}}))
    loaded = CheckpointStore(path).load()
    assert loaded.document == {"PodGPUMapping": {"b": {"c": put("b", "c", 40)["entry"]}}}, "pod a came back"
    assert len(loaded.problems) == 1 and "rewritten by another program" in loaded.problems[0]
    assert list(tmp_path.glob("cp.journal-*.corrupt-*")), "the journal is set aside for a look"


def test_an_empty_journal_beside_a_snapshot_of_another_program_is_no_problem(tmp_path: Path) -> None:
    # This agent stopped cleanly (its journal holds nothing the snapshot lacks); another program wrote since.
    path = tmp_path / "cp"
    store = CheckpointStore(path)
    store.write_snapshot({"PodGPUMapping": {}}, store.switch())
    store.record(put("a", "c", 30))
    store.write_snapshot({"PodGPUMapping": {"a": {"c": put("a", "c", 30)["entry"]}}}, store.switch())
    store.close()
    path.write_text(json.dumps({"PodGPUMapping": {}}))
    loaded = CheckpointStore(path).load()
    assert loaded.problems == [] and loaded.document == {"PodGPUMapping": {}}


def test_a_segment_the_snapshot_holds_already_is_not_replayed(tmp_path: Path) -> None:
    path = tmp_path / "cp"
    store = CheckpointStore(path)
    store.write_snapshot({"PodGPUMapping": {}}, store.switch())
    store.record(put("a", "c", 30))
    old = sorted(tmp_path.glob("cp.journal-*"))
    kept = old[0].read_bytes()
    store.record({"op": "del", "pod": "a", "container": "c"})
    store.write_snapshot({"PodGPUMapping": {}}, store.switch())
    store.close()
    old[0].write_bytes(kept)  # its removal failed: left behind, holding only the put
    loaded = CheckpointStore(path).load()
    assert loaded.document == {"PodGPUMapping": {}}, "a change the snapshot holds (and undid) came back"


def test_a_snapshot_the_compactor_cannot_write_is_said_once_and_written_as_soon_as_it_can_be(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk: the compactor's snapshot fails. Said once (not at every try), new allocations are
    refused naming why, and once the disk has room the compactor itself writes the whole state: the
    refusal ends without waiting for a kubelet call or the periodic check."""
    pods = FakePods([make_pod("a", [("c", 50, 4)]), make_pod("b", [("c", 50, 4)])])
    alloc = make_allocator(tmp_path, pods)
    alloc.probe_checkpoint()
    full = threading.Event()
    full.set()
    real_write, real_create = journal.CheckpointStore.write_snapshot, journal._Segment.create

    def write_snapshot(self: CheckpointStore, document: object, seq: int) -> None:
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, document, seq)  # type: ignore[arg-type]

    def create(path: Path, seq: int, size: int | None = None) -> object:
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_create(path, seq, size)

    monkeypatch.setattr(journal.CheckpointStore, "write_snapshot", write_snapshot)
    monkeypatch.setattr(journal._Segment, "create", staticmethod(create))
    alloc.allocate(core_ids(0, 50))  # journaled; the compactor's snapshot then fails
    alloc.start_compactor(period=0.02)
    try:
        wait_until(lambda: alloc.checkpoint_error != "", "the compactor's failure")
        time.sleep(1.0)  # fifty periods of a full disk
        errors = [r for r in caplog.records if r.levelname == "ERROR" and "checkpoint" in r.getMessage()]
        assert 1 <= len(errors) <= 2, [r.getMessage() for r in errors]
        assert "No space left" in errors[0].getMessage() and "refused" in errors[0].getMessage()
        with pytest.raises(AllocationError, match="No space left"):
            alloc.allocate(core_ids(1, 50))
        full.clear()
        wait_until(lambda: alloc.checkpoint_error == "", "the compactor writing the checkpoint again", timeout=30)
        alloc.allocate(core_ids(1, 50))
    finally:
        alloc.close()
