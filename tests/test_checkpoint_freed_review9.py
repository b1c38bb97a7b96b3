"""Allocations freed before their container started, kept in the checkpoint by their IDs: the ``del`` record's
``freed`` and the snapshot's ``FreedUnstarted``, keys older readers ignore."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from gpumanager.allocation import journal, records
from gpumanager.allocation.allocator import Allocator
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of


def _crash(alloc: Allocator) -> None:
    """The process ends without its stop: no snapshot written at stop (only the open files closed)."""
    alloc._closing.set()
    alloc._store.close()


def _identical(*pod_names: str) -> FakePods:
    return FakePods(
        [make_pod(n, [("main", 50, 4)], created=f"2026-11-21T10:00:0{i}Z") for i, n in enumerate(pod_names)]
    )


def _document(tmp_path: Path) -> dict[str, Any]:
    return journal.read_document(tmp_path / "checkpoint" / names.OWN_CHECKPOINT) or {}


@pytest.mark.parametrize("stop", ["clean", "crash"])
def test_a_guess_freed_before_a_restart_is_taken_over_after_it(tmp_path: Path, stop: str) -> None:
    """b's IDs were matched to a (first in line); a is deleted; the agent restarts (its stop writes the
    snapshot, or a crash leaves the journal); b starts with those IDs and takes a's allocation over."""
    a, b = uid_of("a"), uid_of("b")
    pods = _identical("a", "b")
    before = make_allocator(tmp_path, pods)
    ids = core_ids(0, 50)
    before.allocate(ids)  # the kubelet admits b; matched to a
    guessed = before.get(a, "main")
    assert guessed is not None
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != a]
    before.release_pod(a)
    if stop == "clean":
        before.close()
    else:
        _crash(before)
    assert list(_document(tmp_path).get(journal.FREED_KEY) or {}) == [",".join(sorted(ids))]
    after = make_allocator(tmp_path, pods)
    try:
        after.load()
        started = after.pre_start(ids, (b, "main"))
        assert started.key == (b, "main")
        assert (started.minors, started.answered) == (guessed.minors, (a, "main"))
        assert journal.FREED_KEY not in _document(tmp_path), "taken over: no longer remembered"
    finally:
        after.close()


def test_ids_given_out_again_forget_the_freed_allocation_across_a_restart(tmp_path: Path) -> None:
    a, b, d = uid_of("a"), uid_of("b"), uid_of("d")
    pods = _identical("a", "b")
    before = make_allocator(tmp_path, pods)
    ids = core_ids(0, 50)
    before.allocate(ids)
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != a]
    before.release_pod(a)
    pods.items.append(make_pod("d", [("main", 50, 4)], created="2026-11-21T10:00:05Z"))
    before.allocate(ids)  # the kubelet gives the freed IDs to a new Allocate: b's (b is first in line now)
    _crash(before)
    assert journal.FREED_KEY not in _document(tmp_path)
    after = make_allocator(tmp_path, pods)
    try:
        after.load()
        assert after.get(b, "main") is not None or after.get(d, "main") is not None
        assert after._freed_guesses == {}
    finally:
        after.close()


def test_older_readers_read_the_same_allocations(tmp_path: Path) -> None:
    """The ``del`` record with ``freed`` is a plain ``del`` to a reader that does not know the key, and the
    snapshot's ``FreedUnstarted`` is a key upstream's reader and older versions of this agent ignore."""
    a, c = uid_of("a"), uid_of("c")
    pods = _identical("a", "b", "c")
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(0, 50))
    alloc.allocate(core_ids(1, 50))
    alloc.pre_start(core_ids(1, 50), (c, "main"))
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != a]
    alloc.release_pod(a)
    _crash(alloc)
    segments = sorted((tmp_path / "checkpoint").glob(f"{names.OWN_CHECKPOINT}.journal-*"))
    changes = [
        json.loads(line.split(b" ", 2)[2])
        for seg in segments
        for line in seg.read_bytes().rstrip(b"\0").splitlines()
        if line.strip(b"\0")
    ]
    dels = [ch for ch in changes if ch.get("op") == "del" and "freed" in ch]
    assert len(dels) == 1 and journal.change_problem(dels[0]) == ""
    document = _document(tmp_path)
    plain = {k: v for k, v in document.items() if k != journal.FREED_KEY}
    assert records.from_json(document).allocations == records.from_json(plain).allocations
    assert [x.key for x in records.from_json(plain).allocations] == [(c, "main")]
    # What an older reader makes of the del: the entry is gone, nothing else changes.
    older: dict[str, Any] = {"PodGPUMapping": {a: {"main": {}}, c: document["PodGPUMapping"][c]}}
    journal.apply(older, {k: v for k, v in dels[0].items() if k != "freed"})
    assert list(older["PodGPUMapping"]) == [c]


def test_a_malformed_freed_entry_is_skipped_with_its_name(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    b = uid_of("b")
    ids = core_ids(0, 50)
    key = ",".join(sorted(ids))
    snapshot = {
        "PodGPUMapping": {},
        journal.FREED_KEY: {
            key: {
                uid_of("a"): {"main": {"Devices": ["/dev/nvidia0"], "Cores": 50, "Memory": 1 << 30, "DeviceIDs": ids}}
            },
            "x,y": {uid_of("z"): {"main": {"Devices": ["/dev/nvidia0"], "Cores": "fifty", "Memory": 1}}},
        },
    }
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / names.OWN_CHECKPOINT).write_text(json.dumps(snapshot))
    alloc = make_allocator(tmp_path, _identical("b"))
    try:
        alloc.load()
        assert list(alloc._freed_guesses) == [frozenset(ids)]
        assert "FreedUnstarted 'x,y'" in caplog.text
        assert alloc.pre_start(ids, (b, "main")).key == (b, "main")
    finally:
        alloc.close()


@pytest.mark.parametrize("stop", ["clean", "crash"])
def test_some_of_a_freed_allocations_ids_given_out_again_forget_it_across_a_restart(tmp_path: Path, stop: str) -> None:
    """An Allocate of some of a freed allocation's IDs shows the kubelet freed them: no container starts with
    them all, and after a restart the allocation is not remembered either."""
    a = uid_of("a")
    pods = _identical("a", "b")
    before = make_allocator(tmp_path, pods)
    ids = core_ids(0, 50)
    before.allocate(ids)
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != a]
    before.release_pod(a)
    before.allocate(ids[:25] + core_ids(1, 25))  # b's, with half of a's freed IDs
    assert before._freed_guesses == {}
    if stop == "clean":
        before.close()
    else:
        _crash(before)
    after = make_allocator(tmp_path, pods)
    try:
        after.load()
        assert after._freed_guesses == {}
    finally:
        after.close()
