"""Guesses among identical pods (the kubelet's Allocate carries only device IDs, and it admits pods in its
own order) never have two containers run on a GPU beyond its capacity: reduced from the random kubelet
of tests/test_allocation_model_review9.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpumanager import names
from gpumanager.allocation.allocator import Allocator
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
