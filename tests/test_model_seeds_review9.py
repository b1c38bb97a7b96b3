"""Deterministic cases of the kubelet model (tests/test_allocation_model_review9.py): identical pods whose
Allocates the agent matched to one another (the kubelet's Allocate names no pod, and it admits pods in its
own order), repaired at PreStartContainer, where the kubelet names the pod holding the IDs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from gpumanager import names
from gpumanager.allocation.allocator import Allocator
from gpumanager.allocation.response import ContainerResponse
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, uid_of


def _pod(name: str, second: int, *, init: bool, cores: int = 40, blocks: int = 2) -> dict[str, Any]:
    """A pod asking for ``cores`` and ``blocks`` in its container main (and as much in an init container
    setup, whose IDs the kubelet hands on to main)."""
    limits = {names.VCORE_RESOURCE: str(cores), names.VMEMORY_RESOURCE: str(blocks)}

    def spec(cname: str) -> dict[str, Any]:
        return {"name": cname, "image": "cuda", "resources": {"limits": limits, "requests": limits}}

    body: dict[str, Any] = {"nodeName": "node-1", "containers": [spec("main")]}
    if init:
        body["initContainers"] = [spec("setup")]
    return {
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": uid_of(name),
            "annotations": {},
            "creationTimestamp": f"2026-11-21T10:00:{second:02d}Z",
        },
        "spec": body,
        "status": {"phase": "Pending"},
    }


def _mounted(response: ContainerResponse) -> tuple[str, str]:
    """The (pod directory, container directory) an Allocate answer mounts and names its vcuda.config in."""
    mount = next(m.host_path for m in response.mounts if m.container_path == names.VCUDA_MOUNTPOINT)
    config = PurePosixPath(response.envs[names.VCUDA_CONFIG_ENV])
    return PurePosixPath(mount).name, config.parent.name


def _start(alloc: Allocator, ids: Sequence[str], owner: tuple[str, str]) -> set[tuple[str, str]]:
    """PreStartContainer: the directories whose vcuda.config the agent writes (every record holding the IDs)."""
    started = alloc.pre_start(ids, (uid_of(owner[0]), owner[1]))
    return {r.answered for r in [started, *alloc.holding_same_ids(started)]}


def test_a_pod_handed_the_ids_of_a_pod_whose_init_container_hands_its_own_on_keeps_both_answers(
    tmp_path: Path,
) -> None:
    """a and b each have an init container handing its IDs on, c asks for as much; the kubelet admits c,
    b, a: c's IDs are matched to a's init container, b's to a's main, a's to b's two containers (each its
    own answer). When b's init container starts with its IDs, both of b's records of a's IDs become a's:
    a's main, started after b is deleted, finds its vcuda.config where its answer mounts."""
    pods = FakePods([_pod("a", 1, init=True), _pod("b", 2, init=True), _pod("c", 3, init=False)])
    alloc = make_allocator(tmp_path, pods)
    try:
        ids_c, ids_b, ids_a = core_ids(0, 40), core_ids(1, 40), core_ids(2, 40)
        answer_c = _mounted(alloc.allocate(ids_c))
        answer_b = _mounted(alloc.allocate(ids_b))
        assert _mounted(alloc.allocate(ids_b)) == answer_b  # b's main: its init container's IDs, handed on
        answer_a_setup = _mounted(alloc.allocate(ids_a))
        answer_a_main = _mounted(alloc.allocate(ids_a))
        assert answer_a_setup != answer_a_main

        assert answer_b in _start(alloc, ids_b, ("b", "setup"))
        assert answer_c in _start(alloc, ids_c, ("c", "main"))
        assert answer_a_setup in _start(alloc, ids_a, ("a", "main"))  # the kubelet names either holder
        alloc.release_pod(uid_of("b"))
        assert answer_a_main in _start(alloc, ids_a, ("a", "main"))
    finally:
        alloc.close()


def test_a_pod_whose_guessed_record_is_taken_back_waits_again_and_keeps_the_ids_it_was_given(
    tmp_path: Path,
) -> None:
    """a, b, c, d ask for as much. b's IDs are matched to a, and b is deleted; a's IDs are matched to c,
    c's to d. a starts with its IDs: the swap leaves c the record of b's IDs, a guess. A pod e is given
    some of b's IDs (the kubelet freed them), which takes that record back: c has none, and waits again.
    d's own Allocate is matched to c, not taken for an answer the kubelet lost (which would replace the
    record holding c's IDs); c and d then start, each with the IDs the kubelet gave it."""
    shape = {"w1": (10, 128), "w2": (60, 2), "w3": (60, 2), "e": (50, 2)}  # w1: a GPU's memory
    order = ["w1", "w2", "w3", "a", "b", "c", "d", "e"]
    pods = FakePods(
        [
            _pod(n, i, init=False, cores=shape.get(n, (40, 2))[0], blocks=shape.get(n, (40, 2))[1])
            for i, n in enumerate(order)
        ]
    )
    alloc = make_allocator(tmp_path, pods)
    try:
        ids_b, ids_a, ids_c, ids_d = core_ids(2, 40), core_ids(2, 40, 40), core_ids(3, 40), core_ids(3, 40, 40)
        alloc.allocate(core_ids(0, 10))
        alloc.allocate(ids_b)
        pods.items = [p for p in pods.items if p["metadata"]["name"] != "b"]
        alloc.release_pod(uid_of("b"))
        answer_a = _mounted(alloc.allocate(ids_a))
        answer_c = _mounted(alloc.allocate(ids_c))
        alloc.allocate(core_ids(0, 60, 10))
        alloc.allocate(core_ids(1, 60, 40))
        assert answer_a in _start(alloc, ids_a, ("a", "main"))
        # e: no GPU has room for it until b's IDs (some given to it) are taken back.
        alloc.allocate(core_ids(2, 30) + core_ids(2, 20, 80))
        answer_d = _mounted(alloc.allocate(ids_d))

        assert answer_c in _start(alloc, ids_c, ("c", "main"))
        assert answer_d in _start(alloc, ids_d, ("d", "main"))
        assert {a.pod_uid for a in alloc.allocations() if a.started} == {uid_of("a"), uid_of("c"), uid_of("d")}
    finally:
        alloc.close()


def test_an_answer_freed_with_the_pod_it_was_matched_to_goes_to_the_container_of_its_name(tmp_path: Path) -> None:
    """x asks for as much as b's and c's init and app containers. b's IDs are matched to x, c's to b's
    two containers (each its own answer). b's init container starts: it takes x's record, x takes the
    record of c's IDs answered to c's init container; b's other record of c's IDs, answered to c's app
    container, is freed when b is deleted. c's init container takes x's record; c's app container then
    takes the freed one, whose directory it mounts, not its init container's."""
    pods = FakePods(
        [_pod("x", 1, init=False, cores=20, blocks=8)]
        + [_pod(n, i, init=True, cores=20, blocks=8) for i, n in ((2, "b"), (3, "c"))]
    )
    alloc = make_allocator(tmp_path, pods)
    try:
        ids_b, ids_c = core_ids(0, 20), core_ids(1, 20)
        answer_b = _mounted(alloc.allocate(ids_b))
        assert _mounted(alloc.allocate(ids_b)) == answer_b  # b's app container: its init container's IDs
        answer_c_setup = _mounted(alloc.allocate(ids_c))
        answer_c_main = _mounted(alloc.allocate(ids_c))
        assert answer_c_setup != answer_c_main

        assert answer_b in _start(alloc, ids_b, ("b", "setup"))
        pods.items = [p for p in pods.items if p["metadata"]["name"] != "b"]
        alloc.release_pod(uid_of("b"))
        assert answer_c_setup in _start(alloc, ids_c, ("c", "setup"))
        assert answer_c_main in _start(alloc, ids_c, ("c", "main"))
    finally:
        alloc.close()


def test_an_allocate_no_container_waits_for_is_no_lost_answer_of_a_pod_that_has_started(tmp_path: Path) -> None:
    """x's init container starts (the kubelet names x's app container, which holds the same IDs). z's IDs
    are matched to y, and z is deleted; y's own Allocate then finds no container waiting. It is taken for
    an answer the kubelet lost: y's, whose record holds IDs the kubelet freed, not x's init container's,
    whose pod the kubelet admitted whole before starting it: x's init container keeps its directory to
    itself."""
    pods = FakePods(
        [_pod("x", 1, init=True, cores=10, blocks=1)]
        + [_pod(n, i, init=False, cores=10, blocks=1) for i, n in ((2, "y"), (3, "z"))]
    )
    alloc = make_allocator(tmp_path, pods)
    try:
        ids_x, ids_y, ids_z = core_ids(0, 10), core_ids(1, 10), core_ids(2, 10)
        answer_x_setup = _mounted(alloc.allocate(ids_x))
        assert _mounted(alloc.allocate(ids_x)) != answer_x_setup
        assert answer_x_setup in _start(alloc, ids_x, ("x", "main"))  # its init container starts
        alloc.allocate(ids_z)
        pods.items = [p for p in pods.items if p["metadata"]["name"] != "z"]
        alloc.release_pod(uid_of("z"))
        answer_y = _mounted(alloc.allocate(ids_y))

        assert answer_y != answer_x_setup
        assert answer_y in _start(alloc, ids_y, ("y", "main"))
        assert answer_x_setup in {a.answered for a in alloc.allocations_of(uid_of("x"))}
    finally:
        alloc.close()


def test_the_records_of_a_pods_ids_split_between_two_pods_all_go_to_it_at_its_start(tmp_path: Path) -> None:
    """x asks for as much as b's and c's init and app containers. b's IDs are matched to x, c's to b's
    two containers (each its own answer). b's init container starts: it takes x's record, and x, with
    one container, takes one of b's records of c's IDs, the other staying with b. When c starts, both
    records of its IDs become its own, whichever pod held them: each of its containers finds its
    vcuda.config where its answer mounts, also once b is deleted."""
    pods = FakePods(
        [_pod("x", 1, init=False, cores=20, blocks=8)]
        + [_pod(n, i, init=True, cores=20, blocks=8) for i, n in ((2, "b"), (3, "c"))]
    )
    alloc = make_allocator(tmp_path, pods)
    try:
        ids_b, ids_c = core_ids(0, 20), core_ids(1, 20)
        answer_b = _mounted(alloc.allocate(ids_b))
        assert _mounted(alloc.allocate(ids_b)) == answer_b  # b's app container: its init container's IDs
        answer_c_setup = _mounted(alloc.allocate(ids_c))
        answer_c_main = _mounted(alloc.allocate(ids_c))

        assert answer_b in _start(alloc, ids_b, ("b", "setup"))
        assert {answer_c_setup, answer_c_main} <= _start(alloc, ids_c, ("c", "setup"))
        pods.items = [p for p in pods.items if p["metadata"]["name"] != "b"]
        alloc.release_pod(uid_of("b"))
        assert {answer_c_setup, answer_c_main} <= _start(alloc, ids_c, ("c", "main"))
    finally:
        alloc.close()
