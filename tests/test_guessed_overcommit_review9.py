"""Guesses among identical pods (the kubelet's Allocate carries only device IDs, and it admits pods in its
own order) never have two containers run on a GPU beyond its capacity: reduced from the random kubelet
of tests/test_allocation_model_review9.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from gpumanager.allocation.allocator import AllocationError, Allocator
from gpumanager.allocation.records import ContainerAllocation
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of


def _with_init(name: str, cores: int, blocks: int, created: str) -> dict[str, Any]:
    """A pod whose init container asks for what its app container asks for (the kubelet hands its IDs on)."""
    pod = make_pod(name, [("main", cores, blocks)], created=created)
    limits = {names.VCORE_RESOURCE: str(cores)}
    if blocks:
        limits[names.VMEMORY_RESOURCE] = str(blocks)
    pod["spec"]["initContainers"] = [{"name": "setup", "image": "cuda", "resources": {"limits": limits}}]
    return pod


def _filler(name: str, cores: int, second: int) -> dict[str, Any]:
    return make_pod(name, [("main", cores, 0 if cores >= 100 else 4)], created=f"2026-11-21T09:00:{second:02d}Z")


def _running_beyond(started: list[ContainerAllocation]) -> dict[int, int]:
    """GPU minor -> cores of the containers started there, where beyond 100."""
    held: dict[int, int] = {}
    for record in started:
        for minor in record.minors:
            held[minor] = held.get(minor, 0) + min(record.cores, names.HUNDRED_CORES)
    return {minor: cores for minor, cores in held.items() if cores > names.HUNDRED_CORES}


def _start(alloc: Allocator, ids: list[str], owner: tuple[str, str], started: list[ContainerAllocation]) -> None:
    record = alloc.pre_start(ids, owner)
    started[:] = [r for r in started if r.key != record.key] + [record]


def test_a_pod_whose_init_container_started_waits_for_no_other_allocate(tmp_path: Path) -> None:
    """q (setup 30 + main 30, the kubelet handing setup's IDs Z on to main) waits behind p (main 30). The
    kubelet admits q first: both of its Allocates (Z, Z) are matched to p, first in line; q's setup starts
    with Z and takes that allocation over. p's Allocate (W) was then matched to q's main, which the
    kubelet had given Z at q's admission, and placed in the room q's setup holds for it: p ran beside q
    on GPU 0 (70 + 30 + 30 cores) though GPU 3 had room. A pod whose container has started waits for no
    Allocate: W is p's, placed where it has room."""
    pods = FakePods(
        [
            *(_filler(f"f{g}", cores, g) for g, cores in enumerate((70, 100, 100, 70))),
            make_pod("p", [("main", 30, 4)], created="2026-11-21T10:00:00Z"),
            _with_init("q", 30, 4, "2026-11-21T10:00:01Z"),
        ]
    )
    alloc = make_allocator(tmp_path, pods)
    started: list[ContainerAllocation] = []
    for gpu, cores, name in ((0, 70, "f0"), (1, 100, "f1"), (2, 100, "f2"), (3, 70, "f3")):
        alloc.allocate(core_ids(gpu, cores))
        _start(alloc, core_ids(gpu, cores), (uid_of(name), "main"), started)
    z, w = core_ids(0, 30, start=70), core_ids(3, 30, start=70)
    alloc.allocate(z)  # q's setup
    alloc.allocate(z)  # q's main, handed setup's IDs
    _start(alloc, z, (uid_of("q"), "setup"), started)
    alloc.allocate(w)  # p
    _start(alloc, w, (uid_of("p"), "main"), started)
    assert not _running_beyond(started)
    _start(alloc, z, (uid_of("q"), "main"), started)  # setup ended
    started = [r for r in started if r.key != (uid_of("q"), "setup")]
    assert not _running_beyond(started), {r.key: r.minors for r in started}


def test_an_app_container_given_none_of_its_init_containers_ids_is_not_placed_in_their_room(tmp_path: Path) -> None:
    """q (setup and main, a whole GPU each, setup's IDs handed on) waits before p (a whole GPU); GPUs 2
    and 3 are free. The kubelet admits p first: X is matched to q's setup (first in line), GPU 2. Then q:
    its setup's IDs Y were matched to q's main and placed in the room of q's setup, GPU 2 again. p
    started with X and q with Y, both on GPU 2, GPU 3 idle. The kubelet hands an init container's IDs
    on: a later container given none of them does not follow that allocation, whose room is not its."""
    pods = FakePods(
        [
            _filler("f0", 100, 0),
            _filler("f1", 100, 1),
            _with_init("q", 100, 0, "2026-11-21T10:00:00Z"),
            make_pod("p", [("main", 100, 0)], created="2026-11-21T10:00:01Z"),
        ]
    )
    alloc = make_allocator(tmp_path, pods)
    started: list[ContainerAllocation] = []
    for gpu, name in ((0, "f0"), (1, "f1")):
        alloc.allocate(core_ids(gpu, 100))
        _start(alloc, core_ids(gpu, 100), (uid_of(name), "main"), started)
    x, y = core_ids(2, 100), core_ids(3, 100)
    alloc.allocate(x)  # p
    alloc.allocate(y)  # q's setup
    alloc.allocate(y)  # q's main, handed setup's IDs
    _start(alloc, y, (uid_of("q"), "setup"), started)
    _start(alloc, x, (uid_of("p"), "main"), started)
    assert not _running_beyond(started), {r.key: r.minors for r in started}


def test_an_init_allocation_whose_ids_its_pod_did_not_hand_on_is_charged_beside_the_others(tmp_path: Path) -> None:
    """q (setup 40 and main 40, setup's IDs handed on) waits before p (40). The kubelet admits p first (X,
    matched to q's setup, GPU 3), then q: its Y, matched to q's main, went to GPU 3 too, and GPU 3 was
    charged 40 cores (the larger of an init container and the container it hands its IDs to), not 80.
    r (30) was then placed on GPU 3 (the others have 10 cores left): p, q and r ran there with 110
    cores. An init allocation whose IDs its pod's others do not hold is charged beside them, as the
    kubelet counts both sets of IDs."""
    pods = FakePods(
        [
            *(_filler(f"f{g}", 90, g) for g in (1, 2, 3)),
            _with_init("q", 40, 2, "2026-11-21T10:00:00Z"),
            make_pod("p", [("main", 40, 2)], created="2026-11-21T10:00:01Z"),
            make_pod("r", [("main", 30, 4)], created="2026-11-21T10:00:02Z"),
        ]
    )
    alloc = make_allocator(tmp_path, pods)
    started: list[ContainerAllocation] = []
    for gpu, name in ((0, "f1"), (1, "f2"), (2, "f3")):
        alloc.allocate(core_ids(gpu, 90))
        _start(alloc, core_ids(gpu, 90), (uid_of(name), "main"), started)
    x, y = core_ids(3, 40), core_ids(3, 40, start=40)
    z = core_ids(3, 20, start=80) + core_ids(0, 10, start=90)  # the kubelet's free IDs
    alloc.allocate(x)  # p
    alloc.allocate(y)  # q's setup
    alloc.allocate(y)  # q's main
    try:
        alloc.allocate(z)  # r: no room left (a refused Allocate fails r's admission)
    except AllocationError as exc:
        assert exc.kind == "exhausted"
    else:
        _start(alloc, z, (uid_of("r"), "main"), started)
    _start(alloc, x, (uid_of("p"), "main"), started)
    _start(alloc, y, (uid_of("q"), "setup"), started)
    started = [r for r in started if r.key != (uid_of("q"), "setup")]
    _start(alloc, y, (uid_of("q"), "main"), started)
    assert not _running_beyond(started), {r.key: (r.minors, r.cores) for r in started}


def test_a_start_that_would_crowd_its_gpu_waits_for_room_there(tmp_path: Path) -> None:
    """b is admitted while a, identical, is first in line: b's IDs X are matched to a, a share on GPU 2
    beside e. a is deleted before b starts; the kubelet still counts X as b's, and has 40 IDs free (10
    cores left on GPU 0, 30 on GPU 3): X's room is the only room left for d (40), whose Allocate is
    answered there. The kubelet's Allocate names no pod, so that
    cannot be told apart from a's IDs freed with it. Whichever of d and b starts second would run
    beyond GPU 2's 100 cores: its start is refused (the kubelet tries it again, the message naming the
    pod, the container and the GPU) until room frees there."""
    pods = FakePods(
        [_filler("w0", 90, 0), _filler("w1", 100, 1), _filler("e", 50, 2), _filler("f", 70, 3)]
        + [make_pod(n, [("main", 50, 4)], created=f"2026-11-21T10:00:0{i}Z") for i, n in enumerate("ab")]
    )
    alloc = make_allocator(tmp_path, pods)
    started: list[ContainerAllocation] = []
    for gpu, cores, name in ((0, 90, "w0"), (1, 100, "w1"), (2, 50, "e"), (3, 70, "f")):
        alloc.allocate(core_ids(gpu, cores))
        _start(alloc, core_ids(gpu, cores), (uid_of(name), "main"), started)
    on = {r.key[0]: r.minors for r in started}
    x = core_ids(2, 50, start=50)
    alloc.allocate(x)  # the kubelet admits b: matched to a, first in line
    guessed = alloc.get(uid_of("a"), "main")
    assert guessed is not None and guessed.minors == on[uid_of("e")]
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != uid_of("a")]
    alloc.release_pod(uid_of("a"))
    pods.items.append(make_pod("d", [("main", 40, 4)], created="2026-11-21T10:00:06Z"))
    d_ids = core_ids(0, 10, start=90) + core_ids(3, 30, start=70)  # the kubelet's 40 free IDs
    alloc.allocate(d_ids)
    d = alloc.get(uid_of("d"), "main")
    assert d is not None and d.minors == guessed.minors, "the only room left for d"
    _start(alloc, d_ids, (uid_of("d"), "main"), started)
    with pytest.raises(AllocationError) as refused:
        alloc.pre_start(x, (uid_of("b"), "main"))
    assert refused.value.kind == "unavailable"
    message = str(refused.value)
    assert uid_of("b") in message and "container main" in message and f"GPU {guessed.minors[0]}" in message
    assert names.PRESTART_FAILED not in message  # not a failure the kubelet marks the pod failed for
    assert not _running_beyond(started)
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != uid_of("d")]
    alloc.release_pod(uid_of("d"))
    started = [r for r in started if r.pod_uid != uid_of("d")]
    _start(alloc, x, (uid_of("b"), "main"), started)  # the kubelet's next try
    assert not _running_beyond(started)
    assert [r.key for r in alloc.allocations() if r.pod_uid == uid_of("b")] == [(uid_of("b"), "main")]
