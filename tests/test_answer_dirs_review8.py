"""Which pod directory each container's answer names, after PreStartContainer repairs a guess among
identical waiting pods: the record of the container that starts names the directory its answer mounts."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest

from gpumanager import names
from gpumanager.allocation.allocator import Allocator
from gpumanager.allocation.response import ContainerResponse
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of


def _answered_by(response: ContainerResponse) -> tuple[str, str]:
    """The (pod UID, container) directory an answer mounts: its /etc/vcuda mount and VCUDA_CONFIG_PATH."""
    mount = next(m.host_path for m in response.mounts if m.container_path == names.VCUDA_MOUNTPOINT)
    config = PurePosixPath(response.envs[names.VCUDA_CONFIG_ENV])
    return (PurePosixPath(mount).name, config.parent.name)


def _with_init(name: str, second: int) -> dict[str, object]:
    """A pod with an init container and an app container asking for the same share."""
    pod = make_pod(name, [("app", 50, 4)], created=f"2026-11-21T10:00:0{second}Z")
    spec = pod["spec"]
    assert isinstance(spec, dict)
    limits = {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "4"}
    spec["initContainers"] = [{"name": "setup", "image": "cuda", "resources": {"limits": limits}}]
    return pod


def _answers_are_distinct(alloc: Allocator) -> None:
    held = alloc.allocations()
    answered = [a.answered for a in held]
    assert len(set(answered)) == len(answered), f"answers shared: {[(a.key, a.answered) for a in held]}"


@pytest.mark.parametrize("named_first", ["setup", "app"])
def test_a_pod_whose_init_container_handed_its_ids_on_takes_over_both_answers_by_name(
    tmp_path: Path, named_first: str
) -> None:
    """The kubelet admits q (its init container's IDs handed on to its app container) while p, identical
    and first in line, waits: both Allocates are matched to p's containers. PreStartContainer names only
    the IDs, which both of q's containers hold, so the kubelet's records name either of them; each of q's
    containers then holds the record of the answer it was given (p's setup answer for q's setup, p's app
    answer for q's app), and p keeps none of the IDs q holds."""
    p, q = uid_of("p"), uid_of("q")
    alloc = make_allocator(tmp_path, FakePods([_with_init("p", 0), _with_init("q", 1)]))
    ids = core_ids(0, 50)
    given = {"setup": _answered_by(alloc.allocate(ids)), "app": _answered_by(alloc.allocate(ids))}
    assert given == {"setup": (p, "setup"), "app": (p, "app")}, "both matched to p, the first in line"
    other = "app" if named_first == "setup" else "setup"
    for name in (named_first, other):
        started = alloc.pre_start(ids, (q, name))
        assert started.pod_uid == q
        for container in ("setup", "app"):
            record = alloc.get(q, container)
            if record is not None:
                assert record.answered == given[container], f"q/{container} mounts {given[container]}"
    assert all(a.pod_uid == q for a in alloc.allocations()), [a.key for a in alloc.allocations()]
    # p is admitted next: its answers name directories no container of q mounts.
    later = core_ids(1, 50)
    p_given = [_answered_by(alloc.allocate(later)), _answered_by(alloc.allocate(later))]
    assert not set(p_given) & set(given.values())
    for name in ("setup", "app"):
        alloc.pre_start(later, (p, name))
    _answers_are_distinct(alloc)


def test_a_pod_whose_ids_were_matched_to_a_deleted_identical_pod_still_starts_with_its_answer(tmp_path: Path) -> None:
    """c took a's first answer; b's Allocate was matched to a (still first in line) and answered with c's
    directory; a is deleted before b starts. The kubelet starts b with those IDs: b takes over the
    allocation the guess made for a (its GPUs and the directory its answer mounts) instead of being
    refused at every try of its start."""
    a, b, c = uid_of("a"), uid_of("b"), uid_of("c")
    pods = FakePods([make_pod(n, [("main", 50, 4)], created=f"2026-11-21T10:00:0{i}Z") for i, n in enumerate("abc")])
    alloc = make_allocator(tmp_path, pods)
    first, second = core_ids(0, 50), core_ids(1, 50)
    alloc.allocate(first)
    alloc.pre_start(first, (c, "main"))
    b_answer = alloc.allocate(second)  # the kubelet admits b; matched to a
    guessed = alloc.get(a, "main")
    assert guessed is not None and _answered_by(b_answer) == guessed.answered == (c, "main")
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != a]
    alloc.release_pod(a)
    started = alloc.pre_start(second, (b, "main"))
    assert started.key == (b, "main")
    assert started.answered == _answered_by(b_answer)
    assert started.minors == guessed.minors
    _answers_are_distinct(alloc)
    restarted = make_allocator(tmp_path, pods)
    restarted.load()
    again = restarted.get(b, "main")
    assert again is not None and again.answered == (c, "main") and again.started


def test_a_deleted_pods_guess_is_not_taken_over_once_its_ids_are_allocated_again(tmp_path: Path) -> None:
    """The guess was right after all: the kubelet freed a's IDs with a and gives them to a new Allocate,
    which is answered anew; a later start naming them finds that answer's record."""
    a, b = uid_of("a"), uid_of("b")
    pods = FakePods([make_pod(n, [("main", 50, 4)], created=f"2026-11-21T10:00:0{i}Z") for i, n in enumerate("ab")])
    alloc = make_allocator(tmp_path, pods)
    ids = core_ids(0, 50)
    alloc.allocate(ids)
    alloc.allocate(core_ids(1, 50))  # b
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != a]
    alloc.release_pod(a)
    pods.items.append(make_pod("d", [("main", 50, 4)], created="2026-11-21T10:00:05Z"))
    answer = alloc.allocate(ids)  # d gets a's freed IDs
    assert _answered_by(answer) == (uid_of("d"), "main")
    started = alloc.pre_start(ids, (uid_of("d"), "main"))
    assert started.key == (uid_of("d"), "main") and started.answered == (uid_of("d"), "main")
    assert alloc.get(b, "main") is not None
    _answers_are_distinct(alloc)


def test_a_deleted_pods_guess_is_taken_over_after_an_agent_restart_too(tmp_path: Path) -> None:
    """The agent restarts between b's Allocate (matched to a) and a's deletion: b still starts."""
    a, b = uid_of("a"), uid_of("b")
    pods = FakePods([make_pod(n, [("main", 50, 4)], created=f"2026-11-21T10:00:0{i}Z") for i, n in enumerate("ab")])
    before = make_allocator(tmp_path, pods)
    ids = core_ids(0, 50)
    b_answer = before.allocate(ids)  # the kubelet admits b; matched to a
    before.close()
    after = make_allocator(tmp_path, pods)
    after.load()
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != a]
    after.release_pod(a)
    started = after.pre_start(ids, (b, "main"))
    assert started.key == (b, "main") and started.answered == _answered_by(b_answer) == (a, "main")
    _answers_are_distinct(after)


@pytest.mark.parametrize("named_first", ["setup", "app"])
def test_a_deleted_pods_init_and_app_guesses_are_taken_over_each_by_its_name(tmp_path: Path, named_first: str) -> None:
    """q's init container's IDs, handed on to its app container, were both matched to p's containers;
    p is deleted before q starts: each of q's containers takes over the record of the answer it got."""
    p, q = uid_of("p"), uid_of("q")
    pods = FakePods([_with_init("p", 0), _with_init("q", 1)])
    alloc = make_allocator(tmp_path, pods)
    ids = core_ids(0, 50)
    given = {"setup": _answered_by(alloc.allocate(ids)), "app": _answered_by(alloc.allocate(ids))}
    pods.items = [pod for pod in pods.items if pod["metadata"]["uid"] != p]
    alloc.release_pod(p)
    other = "app" if named_first == "setup" else "setup"
    for name in (named_first, other):
        assert alloc.pre_start(ids, (q, name)).pod_uid == q
    for container in ("setup", "app"):
        record = alloc.get(q, container)
        assert record is not None and record.answered == given[container], (container, record)
    _answers_are_distinct(alloc)
