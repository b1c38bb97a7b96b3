"""Identical pods the kubelet admits in another order than the agent's queue, one of them deleted before
it starts: the other still starts, with the GPUs and the directory of the answer it was given."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from gpumanager import names
from gpumanager.allocation.response import ContainerResponse
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of


def _answered_by(response: ContainerResponse) -> tuple[str, str]:
    """The (pod UID, container) directory an answer mounts: its /etc/vcuda mount and VCUDA_CONFIG_PATH."""
    mount = next(m.host_path for m in response.mounts if m.container_path == names.VCUDA_MOUNTPOINT)
    config = PurePosixPath(response.envs[names.VCUDA_CONFIG_ENV])
    return (PurePosixPath(mount).name, config.parent.name)


def _identical(*names_: str) -> FakePods:
    return FakePods([make_pod(n, [("main", 50, 4)], created=f"2026-11-21T10:00:0{i}Z") for i, n in enumerate(names_)])


def test_the_pod_admitted_second_starts_after_the_one_admitted_first_is_deleted(tmp_path: Path) -> None:
    """a is first in line, but the kubelet admits b first (X, matched to a) and then a (Y, matched to b).
    b is deleted before it starts (a Deployment scaled down takes a pod not yet ready): the kubelet frees
    X. a's start with Y was refused at every try ('no allocation'), since a's record held X, and X's
    GPUs stayed held by that record though the kubelet gives X out again."""
    a, b = uid_of("a"), uid_of("b")
    pods = _identical("a", "b")
    alloc = make_allocator(tmp_path, pods)
    x, y = core_ids(0, 50), core_ids(1, 50)
    b_answer = _answered_by(alloc.allocate(x))  # the kubelet admits b: matched to a, first in line
    a_answer = _answered_by(alloc.allocate(y))  # then a: matched to b
    x_gpus = alloc.get(a, "main")
    assert x_gpus is not None
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != b]
    alloc.release_pod(b)
    started = alloc.pre_start(y, (a, "main"))
    assert started.key == (a, "main")
    assert started.answered == a_answer, "a mounts the directory of the answer it got for Y"
    assert [r.key for r in alloc.allocations()] == [(a, "main")]
    assert frozenset(started.device_ids) == frozenset(y)
    held = {m for r in alloc.allocations() for m in r.minors}
    assert held == set(started.minors)
    assert b_answer != a_answer
    # X comes back in a new pod's Allocate: answered with a directory nobody else uses.
    pods.items.append(make_pod("c", [("main", 50, 4)], created="2026-11-21T10:00:05Z"))
    c_answer = _answered_by(alloc.allocate(x))
    assert c_answer != started.answered
    assert alloc.pre_start(x, (uid_of("c"), "main")).key == (uid_of("c"), "main")
    answered = [r.answered for r in alloc.allocations()]
    assert len(set(answered)) == len(answered)


def test_a_chain_of_identical_pods_admitted_out_of_order_survives_a_deletion(tmp_path: Path) -> None:
    """Three identical pods admitted in the order c, a, b (queue a, b, c): X matched to a, Y to b, Z to c.
    a is deleted before it starts. The kubelet then starts b (with Z) and c (with X): each starts, with the
    directory of its own answer."""
    a, b, c = uid_of("a"), uid_of("b"), uid_of("c")
    pods = _identical("a", "b", "c")
    alloc = make_allocator(tmp_path, pods)
    x, y, z = core_ids(0, 50), core_ids(1, 50), core_ids(2, 50)
    given = {"c": _answered_by(alloc.allocate(x)), "a": _answered_by(alloc.allocate(y))}
    given["b"] = _answered_by(alloc.allocate(z))
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != a]
    alloc.release_pod(a)  # the kubelet frees Y
    for name, uid, ids in (("b", b, z), ("c", c, x)):
        started = alloc.pre_start(ids, (uid, "main"))
        assert started.key == (uid, "main")
        assert started.answered == given[name]
        assert frozenset(started.device_ids) == frozenset(ids)
    assert sorted(r.key for r in alloc.allocations()) == sorted([(b, "main"), (c, "main")])


def test_the_record_that_gave_way_is_remembered_across_a_restart(tmp_path: Path) -> None:
    """As above, and the agent restarts after a started: a holds its own IDs and the record of b's IDs that
    gave way does not come back as a's (or anyone's) allocation."""
    a, b = uid_of("a"), uid_of("b")
    pods = _identical("a", "b")
    alloc = make_allocator(tmp_path, pods)
    x, y = core_ids(0, 50), core_ids(1, 50)
    alloc.allocate(x)
    alloc.allocate(y)
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != b]
    alloc.release_pod(b)
    alloc.pre_start(y, (a, "main"))
    restarted = make_allocator(tmp_path, pods)
    restarted.load()
    record = restarted.get(a, "main")
    assert record is not None and record.started and frozenset(record.device_ids) == frozenset(y)
    assert [r.key for r in restarted.allocations()] == [(a, "main")]


def _cores_by_gpu(alloc: object) -> dict[int, int]:
    held: dict[int, int] = {}
    for record in alloc.allocations():  # type: ignore[attr-defined]
        for minor in record.minors:
            held[minor] = held.get(minor, 0) + min(record.cores, 100)
    return held


def test_the_room_of_a_freed_guess_is_not_given_to_another_pod_while_room_is_left_elsewhere(tmp_path: Path) -> None:
    """b is admitted while a, identical, is first in line: b's IDs X are matched to a, a share on GPU g. a is
    deleted before b starts; the kubelet still counts X as b's, but g's room was free to the next Allocate:
    d (40 cores) was placed there (beside a GPU with 70 cores free) and b's start then took over a's allocation on g,
    over-committing it. The room of a freed allocation is left for the pod that may take it over while
    other room fits."""
    pods = FakePods(
        [make_pod(n, [("main", 100, 0)], created=f"2026-11-21T09:00:0{i}Z") for i, n in enumerate(("w1", "w2"))]
        + [make_pod("e", [("main", 50, 4)], created="2026-11-21T09:00:05Z")]
        + [make_pod(n, [("main", 50, 4)], created=f"2026-11-21T10:00:0{i}Z") for i, n in enumerate("ab")]
    )
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(0, 100))
    alloc.allocate(core_ids(1, 100))
    alloc.allocate(core_ids(2, 50))  # e
    x = core_ids(2, 50, start=50)
    alloc.allocate(x)  # the kubelet admits b: matched to a
    pods.items.append(make_pod("f", [("main", 30, 4)], created="2026-11-21T10:00:05Z"))
    alloc.allocate(core_ids(3, 30))
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != uid_of("a")]
    alloc.release_pod(uid_of("a"))
    pods.items.append(make_pod("d", [("main", 40, 4)], created="2026-11-21T10:00:06Z"))
    alloc.allocate(core_ids(3, 40, start=30))  # the kubelet has 70 IDs free: 40 for d
    started = alloc.pre_start(x, (uid_of("b"), "main"))
    assert started.key == (uid_of("b"), "main")
    over = {minor: cores for minor, cores in _cores_by_gpu(alloc).items() if cores > 100}
    assert not over, f"GPUs charged beyond 100 cores: {over}"
