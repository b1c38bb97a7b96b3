"""Allocations freed before their container started, kept in the checkpoint (``FreedUnstarted`` and the ``del``
record's ``freed``): what a restart brings back is what the running agent remembered."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from gpumanager.allocation import allocator as allocator_module
from gpumanager.allocation import journal
from gpumanager.allocation.allocator import Allocator
from gpumanager.allocation.records import ContainerAllocation
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of


def _crash(alloc: Allocator) -> None:
    """The process ends without its stop: no snapshot written at stop (only the open files closed)."""
    alloc._closing.set()
    alloc._store.close()


def _document(tmp_path: Path) -> dict[str, Any]:
    return journal.read_document(tmp_path / "checkpoint" / names.OWN_CHECKPOINT) or {}


def _freed_entry(ids: list[str], minor: int, cores: int, memory: int) -> dict[str, object]:
    return {"Devices": [f"/dev/nvidia{minor}"], "Cores": cores, "Memory": memory, "DeviceIDs": ids}


def test_some_ids_given_out_again_forget_a_freed_allocation_with_many_remembered(tmp_path: Path) -> None:
    """With many freed allocations remembered (more than a replay scanned for shared IDs), an Allocate of some
    of one's IDs forgets it in memory; after a crash that left the Allocate, the start and the release of its
    container in the journal, the replay forgets it too (its GPU's room is not held for it again)."""
    ids = core_ids(0, 50)
    freed = {",".join(sorted(ids)): {uid_of("a"): {"main": _freed_entry(ids, 0, 50, 1 << 30)}}}
    for i in range(80):
        one = core_ids(3, 1, start=i)
        freed[",".join(one)] = {uid_of(f"x{i}"): {"main": _freed_entry(one, 3, 1, 1 << 20)}}
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / names.OWN_CHECKPOINT).write_text(
        json.dumps({"PodGPUMapping": {}, journal.FREED_KEY: freed})
    )
    d = uid_of("d")
    pods = FakePods([make_pod("d", [("main", 10, 4)], created="2026-11-21T10:00:05Z")])
    before = make_allocator(tmp_path, pods)
    before.load()
    assert frozenset(ids) in before._freed_guesses
    some = core_ids(0, 10)
    before.allocate(some)
    before.pre_start(some, (d, "main"))
    assert frozenset(ids) not in before._freed_guesses, "the kubelet freed them: forgotten in memory"
    remembered = set(before._freed_guesses)
    pods.items = []
    before.release_pod(d)
    _crash(before)
    after = make_allocator(tmp_path, pods)
    try:
        after.load()
        assert frozenset(ids) not in after._freed_guesses
        assert set(after._freed_guesses) == remembered
    finally:
        after.close()


def test_a_flood_of_malformed_freed_entries_is_read_only_as_far_as_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A damaged snapshot's ``FreedUnstarted`` of thousands of malformed entries: only as many as the agent
    keeps (the newest) are read, each skipped by name; the older ones are one line, not one each."""
    kept = allocator_module._FREED_GUESSES_KEPT
    freed = {
        f"id-{i}": {uid_of(f"x{i}"): {"main": {"Devices": ["/dev/nvidia3"], "Cores": "x", "Memory": 1}}}
        for i in range(kept + 2000)
    }
    ids = core_ids(0, 50)
    freed[",".join(sorted(ids))] = {uid_of("a"): {"main": _freed_entry(ids, 0, 50, 1 << 30)}}
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / names.OWN_CHECKPOINT).write_text(
        json.dumps({"PodGPUMapping": {}, journal.FREED_KEY: freed})
    )
    alloc = make_allocator(tmp_path, FakePods([]))
    try:
        with caplog.at_level(logging.WARNING):
            alloc.load()
        lines = [r.getMessage() for r in caplog.records if journal.FREED_KEY in r.getMessage()]
        assert len(lines) <= kept + 1
        assert any("'id-2001'" in line and "Cores 'x'" in line for line in lines), "the newest named"
        assert not any("'id-2000'" in line or "'id-0'" in line for line in lines)
        assert any("2001" in line and "older" in line for line in lines), "the rest counted"
        assert list(alloc._freed_guesses) == [frozenset(ids)]
    finally:
        alloc.close()


def test_a_container_the_kubelets_records_give_some_of_a_freed_allocations_ids_forgets_it(tmp_path: Path) -> None:
    """The checkpoint remembers an allocation freed before its container started; the kubelet's records (our
    journal lost the put) show a container holding some of its IDs: the kubelet freed them, no container
    starts with them all, and the allocation's GPU room is no longer held for it, now or after a restart."""
    ids = core_ids(0, 50)
    freed = {",".join(sorted(ids)): {uid_of("a"): {"main": _freed_entry(ids, 0, 50, 1 << 30)}}}
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / names.OWN_CHECKPOINT).write_text(
        json.dumps({"PodGPUMapping": {}, journal.FREED_KEY: freed})
    )
    x = uid_of("x")
    pods = FakePods([make_pod("x", [("main", 10, 4)], phase="Running")])
    alloc = make_allocator(tmp_path, pods)
    try:
        alloc.load()
        assert frozenset(ids) in alloc._freed_guesses
        held = ContainerAllocation(
            pod_uid=x, container="main", minors=(0,), cores=10, memory=1 << 30, device_ids=tuple(core_ids(0, 10))
        )
        assert alloc.adopt([held], source="kubelet checkpoint", kubelet_holds=True) == 1
        assert alloc._freed_guesses == {}
    finally:
        alloc.close()
    assert journal.FREED_KEY not in _document(tmp_path)


def test_a_freed_entry_skipped_at_load_is_logged_with_its_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A remembered freed allocation naming a GPU this node does not have, or some of whose IDs an allocation
    holds, is skipped and logged, naming its IDs, its pod and container and why (not dropped in silence)."""
    gone_gpu, given = core_ids(2, 50), core_ids(0, 50)
    freed = {
        ",".join(sorted(gone_gpu)): {uid_of("g"): {"main": _freed_entry(gone_gpu, 9, 50, 1 << 30)}},
        ",".join(sorted(given)): {uid_of("a"): {"main": _freed_entry(given, 0, 50, 1 << 30)}},
    }
    holder = {"main": {**_freed_entry(core_ids(0, 10), 0, 10, 1 << 30), "Started": True}}
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / names.OWN_CHECKPOINT).write_text(
        json.dumps({"PodGPUMapping": {uid_of("x"): holder}, journal.FREED_KEY: freed})
    )
    alloc = make_allocator(tmp_path, FakePods([]))
    try:
        with caplog.at_level(logging.INFO):
            alloc.load()
        assert alloc._freed_guesses == {}
        text = caplog.text
        assert f"pod {uid_of('g')} container main" in text and "GPU" in text and "9" in text
        assert f"pod {uid_of('a')} container main" in text and "an allocation holds some of its IDs" in text
    finally:
        alloc.close()
