"""The room of an allocation freed before its container started, when a request has no other: the kubelet's
holder of its IDs is asked (the pod it gave them to takes the allocation over, its room kept); when no
container holds them, or nobody can tell, the room is given as before."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from gpumanager.allocation.allocator import AllocationError, Allocator
from gpumanager.allocation.model import FreedRoomWithheld
from gpumanager.allocation.records import ContainerAllocation
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of

A, B, C = uid_of("a"), uid_of("b"), uid_of("c")
# Distinct sets, none held by another container (the allocator takes IDs seen again as handed on).
B_IDS = core_ids(0, 40, 60)  # the kubelet admits b first: matched to a, first in line
A_IDS = core_ids(4, 40)  # then a: matched to b, no room left
C_IDS = core_ids(5, 40)


def holding(alloc: Allocator, device_ids: Sequence[str]) -> ContainerAllocation | None:
    """The allocation made for ``device_ids`` (matched to b or c, both waiting with the same request)."""
    return next((a for a in alloc.allocations() if frozenset(a.device_ids) == frozenset(device_ids)), None)


class Lookup:
    """The kubelet's holder of device IDs as the test says; counts the questions."""

    def __init__(self, answer: Callable[[], tuple[str, str] | None]) -> None:
        self.answer = answer
        self.asked: list[frozenset[str]] = []

    def __call__(self, device_ids: Sequence[str]) -> tuple[str, str] | None:
        self.asked.append(frozenset(device_ids))
        return self.answer()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Allocator, FakePods]]:
    """Four GPUs, three held whole and one with 60 cores; a and b (40 cores) wait, b's IDs were matched to
    a (on the one GPU with room), a's Allocate failed, a is deleted (its allocation freed before it
    started) and c (40 cores) waits."""
    pods = FakePods(
        [
            make_pod("a", [("main", 40, 4)], created="2026-11-21T10:00:01Z"),
            make_pod("b", [("main", 40, 4)], created="2026-11-21T10:00:02Z"),
        ]
        + [make_pod(f"whole{i}", [("main", 100, 0)], created=f"2026-11-21T09:00:0{i}Z") for i in range(3)]
        + [make_pod("part", [("main", 60, 4)], created="2026-11-21T09:00:05Z")]
    )
    alloc = make_allocator(tmp_path, pods)
    try:
        for i in range(3):
            alloc.allocate(core_ids(i + 1, 100))
        alloc.allocate(core_ids(0, 60))
        first = alloc.allocate(B_IDS)
        assert first.annotations  # matched to a
        assert alloc.get(A, "main") is not None
        with pytest.raises(AllocationError):
            alloc.allocate(A_IDS)  # matched to b: no GPU has room
        pods.items = [p for p in pods.items if p["metadata"]["uid"] != A]
        alloc.release_pod(A)
        pods.items.append(make_pod("c", [("main", 40, 4)], created="2026-11-21T10:00:03Z"))
        yield alloc, pods
    finally:
        alloc.close()


def test_the_pod_the_kubelet_gave_the_ids_to_takes_the_room_and_the_request_is_refused(
    node: tuple[Allocator, FakePods],
) -> None:
    alloc, _ = node
    lookup = Lookup(lambda: (B, "main"))
    alloc.set_holder_lookup(lookup)
    freed = alloc._freed_guesses[frozenset(B_IDS)][0]
    with pytest.raises(AllocationError) as refused:
        alloc.allocate(C_IDS)
    assert refused.value.kind == "exhausted"
    assert lookup.asked == [frozenset(B_IDS)]
    taken = alloc.get(B, "main")
    assert taken is not None and taken.minors == freed.minors and taken.answered == (A, "main")
    assert alloc.get(C, "main") is None
    assert alloc.charged_beyond_capacity() == {}
    assert alloc.pre_start(B_IDS, (B, "main")).key == (B, "main")


def test_no_container_holding_the_ids_frees_the_room(node: tuple[Allocator, FakePods]) -> None:
    alloc, _ = node
    lookup = Lookup(lambda: None)
    alloc.set_holder_lookup(lookup)
    freed = alloc._freed_guesses[frozenset(B_IDS)][0]
    alloc.allocate(C_IDS)
    given = holding(alloc, C_IDS)
    assert given is not None and given.minors == freed.minors
    assert lookup.asked == [frozenset(B_IDS)]
    assert alloc._freed_guesses == {}


def test_a_lookup_that_fails_leaves_the_room_given_as_before(node: tuple[Allocator, FakePods]) -> None:
    alloc, _ = node

    def broken() -> tuple[str, str] | None:
        raise RuntimeError("socket gone")

    alloc.set_holder_lookup(Lookup(broken))
    alloc.allocate(C_IDS)
    assert holding(alloc, C_IDS) is not None


def test_without_a_lookup_the_room_is_given_as_before(node: tuple[Allocator, FakePods]) -> None:
    alloc, _ = node
    alloc.allocate(C_IDS)
    assert holding(alloc, C_IDS) is not None


def test_the_freed_pod_still_holding_the_ids_keeps_its_room_held(node: tuple[Allocator, FakePods]) -> None:
    """The kubelet still lists the deleted pod as their holder: the room stays held, the refusal says why."""
    alloc, _ = node
    lookup = Lookup(lambda: (A, "main"))
    alloc.set_holder_lookup(lookup)
    with pytest.raises(FreedRoomWithheld) as refused:
        alloc.allocate(C_IDS)
    assert refused.value.kind == "exhausted"
    assert f"pod {A} container main" in str(refused.value) and "freed before" in str(refused.value)
    assert frozenset(B_IDS) in alloc._freed_guesses
    assert alloc.get(C, "main") is None
    assert alloc.get(B, "main") is None


def test_other_room_is_used_without_asking(tmp_path: Path) -> None:
    """The common path: the freed allocation's room is left while other room fits; nothing is asked."""
    pods = FakePods(
        [
            make_pod("a", [("main", 40, 4)], created="2026-11-21T10:00:01Z"),
            make_pod("b", [("main", 40, 4)], created="2026-11-21T10:00:02Z"),
        ]
    )
    alloc = make_allocator(tmp_path, pods)
    lookup = Lookup(lambda: None)
    alloc.set_holder_lookup(lookup)
    try:
        alloc.allocate(B_IDS)
        freed = alloc.get(A, "main")
        assert freed is not None
        pods.items = [p for p in pods.items if p["metadata"]["uid"] != A]
        alloc.release_pod(A)
        pods.items.append(make_pod("c", [("main", 40, 4)], created="2026-11-21T10:00:03Z"))
        alloc.allocate(C_IDS)
        given = holding(alloc, C_IDS)
        assert given is not None
        assert lookup.asked == []
    finally:
        alloc.close()
