"""Allocate reads only the pods the cache says changed: its index of waiting pods and of holders to check
must follow every change (a pod starting or ceasing to wait, a holder ending, a change landing while a call
runs, a cache that lists again, a view not yet complete, a restart) as a look at every pod would."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from gpumanager.allocation import allocator as allocator_module
from gpumanager.allocation.allocator import AllocationError, Allocator
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of

RUNNING = {"phase": "Running", "containerStatuses": [{"name": "c", "state": {"running": {}}}]}


def whole(name: str, minute: int = 0) -> dict[str, Any]:
    """A pod asking for one whole GPU (the test node has four)."""
    return make_pod(name, [("c", 100, 0)], created=f"2026-11-21T10:{minute:02d}:00Z")


def new_ids() -> list[str]:
    """100 device IDs no holder has (the allocator does not tie IDs to GPUs)."""
    return core_ids(4, 100)


def full_node(pods: FakePods) -> list[dict[str, Any]]:
    """Pods a..d, one whole GPU each (the node's four once allocated), added to ``pods``."""
    holders = [whole(n, i) for i, n in enumerate("abcd")]
    pods.items.extend(holders)
    return holders


def every_gpu_held_and_e_waiting(tmp_path: Path, pods: FakePods) -> tuple[list[dict[str, Any]], Allocator]:
    """a..d hold the node's four GPUs and run; e waits for one. An Allocate for e has failed (every
    holder changed, was checked and is alive), and the API server does not answer a fresh list."""
    holders = full_node(pods)
    alloc = make_allocator(tmp_path, pods)
    for gpu in range(4):
        alloc.allocate(core_ids(gpu, 100))
    for p in holders:
        p["status"] = dict(RUNNING)
    pods.items.append(whole("e", 9))
    pods.refresh_error = TimeoutError("the API server did not answer")
    with pytest.raises(AllocationError):
        alloc.allocate(new_ids())
    return holders, alloc


def test_allocate_looks_at_every_pod_only_when_the_source_cannot_say_what_changed(tmp_path: Path) -> None:
    pods = FakePods([whole("a", 0), whole("b", 1), whole("c", 2)])
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(0, 100))
    lists = pods.lists
    alloc.allocate(core_ids(1, 100))
    assert pods.lists == lists, "with the changes known, Allocate must not walk every pod"
    pods.lost_track = True  # as the cache after a relist
    alloc.allocate(core_ids(2, 100))
    assert pods.lists > lists
    assert [a.pod_uid for a in alloc.allocations()] == sorted(uid_of(n) for n in "abc")


def test_a_pod_created_between_calls_is_matched(tmp_path: Path) -> None:
    pods = FakePods([whole("a", 0)])
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(0, 100))
    pods.items.append(make_pod("late", [("c", 30, 2)]))
    alloc.allocate(core_ids(1, 30))
    assert alloc.get(uid_of("late"), "c") is not None
    assert pods.refreshes == 0, "found in the cache's changes, not by asking the API server"


@pytest.mark.parametrize(
    "stop_waiting",
    [
        lambda p: p["metadata"]["annotations"].update({names.GPU_ASSIGNED: "true"}),
        lambda p: p["metadata"].update({"deletionTimestamp": "2026-11-21T11:00:00Z"}),
        lambda p: p["status"].update({"phase": "Failed"}),
        lambda p: p["status"].update({"reason": "UnexpectedAdmissionError"}),
    ],
    ids=["assigned", "deleting", "failed", "admission-failed"],
)
def test_a_pod_that_stops_waiting_between_calls_is_not_matched(
    tmp_path: Path, stop_waiting: Callable[[dict[str, Any]], None]
) -> None:
    early, later = make_pod("early", [("c", 30, 2)]), make_pod("later", [("c", 30, 2)], created="2026-11-21T11:00:00Z")
    pods = FakePods([whole("a", 0), early, later])
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(0, 100))  # the index now has "early" first among the pods waiting for 30 cores
    stop_waiting(early)
    alloc.allocate(core_ids(1, 30))
    assert alloc.get(uid_of("early"), "c") is None
    assert alloc.get(uid_of("later"), "c") is not None


def test_a_pod_that_starts_waiting_after_an_update_is_matched(tmp_path: Path) -> None:
    odd = make_pod("odd", [("c", 30, 2)], phase="Unknown")
    pods = FakePods([whole("a", 0), odd])
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(0, 100))
    pods.refresh_error = TimeoutError("the API server did not answer")
    with pytest.raises(AllocationError, match=r"cannot be asked"):
        alloc.allocate(core_ids(1, 30))
    odd["status"]["phase"] = "Pending"
    alloc.allocate(core_ids(1, 30))
    assert alloc.get(uid_of("odd"), "c") is not None


def test_a_pod_whose_first_container_is_allocated_comes_first(tmp_path: Path) -> None:
    older = make_pod("older", [("c", 50, 2)])
    multi = make_pod("multi", [("c0", 60, 2), ("c1", 50, 2)], created="2026-11-21T11:00:00Z")
    alloc = make_allocator(tmp_path, FakePods([older, multi]))
    alloc.allocate(core_ids(0, 60))
    assert alloc.get(uid_of("multi"), "c0") is not None
    alloc.allocate(core_ids(1, 50))
    assert alloc.get(uid_of("multi"), "c1") is not None, "a pod already partly allocated goes before an older one"
    alloc.allocate(core_ids(2, 50))
    assert alloc.get(uid_of("older"), "c") is not None


@pytest.mark.parametrize(
    "end",
    [
        lambda pods, p: p["status"].update({"phase": "Succeeded"}),
        lambda pods, p: pods.items.remove(p),
        lambda pods, p: (
            p["metadata"].update({"deletionTimestamp": "2026-11-21T11:00:00Z"}),
            p["status"].update({"containerStatuses": [{"name": "c", "state": {"terminated": {}}}]}),
        ),
    ],
    ids=["succeeded", "deleted", "deleting-and-stopped"],
)
def test_a_holder_that_ends_between_calls_is_freed_by_the_next_allocate(
    tmp_path: Path, end: Callable[[FakePods, dict[str, Any]], None]
) -> None:
    pods = FakePods()
    holders, alloc = every_gpu_held_and_e_waiting(tmp_path, pods)
    assert len(alloc.allocations()) == 4
    end(pods, holders[2])
    alloc.allocate(new_ids())
    assert alloc.get(uid_of("c"), "c") is None, "the ended holder's GPU is freed"
    assert alloc.get(uid_of("e"), "c").minors == (2,)  # type: ignore[union-attr]
    assert sorted(a.pod_uid for a in alloc.allocations()) == sorted(uid_of(n) for n in "abde")


class RacingPods(FakePods):
    """A pod source whose pods change right after a call read its changes, as a watch event may."""

    def __init__(self) -> None:
        super().__init__()
        self.race: list[Callable[[], object]] = []

    def changes(self, since: int) -> tuple[int, frozenset[str] | None]:
        answer = super().changes(since)
        while self.race:
            self.race.pop()()
        return answer


def test_a_holder_ending_while_an_allocate_reads_the_changes_is_freed_by_the_next_one(tmp_path: Path) -> None:
    pods = RacingPods()
    holders, alloc = every_gpu_held_and_e_waiting(tmp_path, pods)
    pods.race.append(lambda: holders[1]["status"].update({"phase": "Failed"}))
    with contextlib.suppress(AllocationError):
        alloc.allocate(new_ids())  # b ends just after this call read the changes
    if alloc.get(uid_of("e"), "c") is None:
        alloc.allocate(new_ids())  # the kubelet's retry: b's end must not have been lost
    assert alloc.get(uid_of("e"), "c").minors == (1,)  # type: ignore[union-attr]
    assert alloc.get(uid_of("b"), "c") is None


def test_a_holder_gone_while_the_view_is_incomplete_is_freed_once_it_is_complete(tmp_path: Path) -> None:
    pods = FakePods([whole("a", 0), whole("b", 1), whole("c", 2)])
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(0, 100))
    pods.is_synced = False
    pods.items = [p for p in pods.items if p["metadata"]["name"] != "a"]
    alloc.allocate(core_ids(1, 100))
    assert alloc.get(uid_of("a"), "c") is not None, "without a complete view nothing is freed"
    pods.is_synced = True
    alloc.allocate(core_ids(2, 100))
    assert alloc.get(uid_of("a"), "c") is None
    assert sorted(a.pod_uid for a in alloc.allocations()) == sorted(uid_of(n) for n in "bc")


def test_restart_replays_the_journal_exactly_and_frees_holders_that_ended_meanwhile(tmp_path: Path) -> None:
    a, b, c = make_pod("a", [("c", 60, 4)]), make_pod("b", [("c", 30, 4)]), make_pod("c", [("c", 50, 4)])
    first = make_allocator(tmp_path, FakePods([a, b]))
    first.allocate(core_ids(0, 60))
    first.allocate(core_ids(1, 30))
    held = {(x.pod_uid, x.container, x.minors, x.cores, x.memory) for x in first.allocations()}
    # The agent stops without a snapshot (a crash); meanwhile a ends and b is deleted.
    a["status"]["phase"] = "Succeeded"
    pods = FakePods([a, c])
    second = make_allocator(tmp_path, pods)
    loaded = second.load()
    assert {(x.pod_uid, x.container, x.minors, x.cores, x.memory) for x in loaded.allocations} == held
    second.allocate(core_ids(2, 50))
    assert [x.pod_uid for x in second.allocations()] == [uid_of("c")]
    third = make_allocator(tmp_path, FakePods([a, c]))
    assert [(x.pod_uid, x.minors) for x in third.load().allocations] == [
        (uid_of("c"), second.get(uid_of("c"), "c").minors)  # type: ignore[union-attr]
    ]


def test_an_adopted_holder_whose_pod_is_gone_is_freed_by_the_next_allocate(tmp_path: Path) -> None:
    pods = FakePods([whole("a", 0), whole("b", 1)])
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(0, 100))  # the view of the pods is complete and indexed
    gone = replace(alloc.allocations()[0], pod_uid=uid_of("gone"), device_ids=tuple(core_ids(3, 100)), minors=(3,))
    assert alloc.adopt([gone], source="the kubelet's checkpoint") == 1
    alloc.allocate(core_ids(1, 100))
    assert alloc.get(uid_of("gone"), "c") is None, "no change of its pod will come: it is checked when taken"
    assert sorted(a.pod_uid for a in alloc.allocations()) == sorted(uid_of(n) for n in "ab")


def test_a_holder_gone_across_a_relist_is_freed(tmp_path: Path) -> None:
    pods = FakePods([whole("a", 0), whole("b", 1), whole("c", 2)])
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(0, 100))
    alloc.allocate(core_ids(1, 100))  # a is checked (alive) here
    pods.items = [p for p in pods.items if p["metadata"]["name"] != "a"]
    pods.lost_track = True  # the cache listed again: it cannot say which pods changed
    alloc.allocate(core_ids(2, 100))
    assert sorted(a.pod_uid for a in alloc.allocations()) == sorted(uid_of(n) for n in "bc")


def per_pod_agrees(alloc: Allocator, uids: list[str]) -> None:
    """allocations_of (from the per-pod index) says what the whole list says, for every pod."""
    everything = alloc.allocations()
    for uid in uids:
        assert alloc.allocations_of(uid) == [a for a in everything if a.pod_uid == uid], uid


def test_the_allocations_of_a_pod_follow_allocate_swap_take_back_and_release(tmp_path: Path) -> None:
    multi = make_pod("multi", [("c1", 50, 2), ("c0", 60, 2)])
    a = make_pod("a", [("c", 30, 2)], created="2026-11-21T10:00:01Z")
    b = make_pod("b", [("c", 30, 2)], created="2026-11-21T10:00:02Z")
    pods = FakePods([multi, a, b])
    alloc = make_allocator(tmp_path, pods)
    uids = [uid_of(n) for n in ("multi", "a", "b")]
    alloc.allocate(core_ids(0, 60))
    alloc.allocate(core_ids(1, 50))
    alloc.allocate(core_ids(2, 30))  # matched to a (older)
    per_pod_agrees(alloc, uids)
    assert [x.container for x in alloc.allocations_of(uid_of("multi"))] == ["c0", "c1"]
    alloc.pre_start(core_ids(2, 30), (uid_of("b"), "c"))  # the kubelet gave them to b: swapped
    per_pod_agrees(alloc, uids)
    assert alloc.allocations_of(uid_of("a")) == []
    alloc.pre_start(core_ids(1, 50), (uid_of("multi"), "c1"))
    pods.items.append(make_pod("late", [("c", 50, 2)]))
    alloc.allocate(core_ids(1, 50))  # c1 started: its IDs come back for another pod
    per_pod_agrees(alloc, [*uids, uid_of("late")])
    assert [x.container for x in alloc.allocations_of(uid_of("multi"))] == ["c0"]
    alloc.release_pod(uid_of("multi"))
    per_pod_agrees(alloc, [*uids, uid_of("late")])
    assert alloc.allocations_of(uid_of("multi")) == []


def _early_from_a_fresh_list(tmp_path: Path) -> tuple[Allocator, FakePods]:
    """Pod ``early`` (a whole GPU) allocated from a fresh list: the cache has not shown it."""
    pods = FakePods([make_pod("a", [("c", 30, 2)])])
    pods.refresh_fills_cache = False
    pods.hidden = [whole("early", 1)]
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(0, 100))
    return alloc, pods


def test_a_pod_allocated_from_a_fresh_list_is_not_freed_before_the_cache_shows_it(tmp_path: Path) -> None:
    # The kubelet admitted a pod this node's pod watch has not delivered yet: Allocate found it by asking
    # the API server. The next Allocate must not take the cache's silence for the pod's end.
    alloc, pods = _early_from_a_fresh_list(tmp_path)
    assert pods.refreshes == 1 and alloc.get(uid_of("early"), "c") is not None
    alloc.allocate(core_ids(1, 30))  # for a, found in the cache
    assert alloc.get(uid_of("early"), "c") is not None, "freed while it runs: its GPU would be given twice"
    assert alloc.recycle() == []
    pods.lost_track = True  # nor does a relist that does not list it yet
    pods.items.append(make_pod("b", [("c", 30, 2)]))
    alloc.allocate(core_ids(2, 30))
    assert alloc.get(uid_of("early"), "c") is not None
    pods.show_hidden()
    assert alloc.recycle() == []  # the cache shows it now: from here on its end frees it
    pods.items = [p for p in pods.items if p["metadata"]["name"] != "early"]
    pods.items.append(make_pod("c", [("c", 30, 2)]))
    alloc.allocate(core_ids(3, 30))
    assert alloc.get(uid_of("early"), "c") is None


def test_a_pod_allocated_from_a_fresh_list_the_cache_never_shows_is_freed_after_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    alloc, pods = _early_from_a_fresh_list(tmp_path)
    assert alloc.recycle() == []
    monkeypatch.setattr(allocator_module, "FRESH_LIST_GRACE_SECONDS", 0.0)  # long past
    pods.hidden = []  # deleted at the API server before the cache ever showed it
    assert alloc.recycle() == [uid_of("early")]


def test_a_pod_the_cache_never_shows_is_kept_while_the_api_server_lists_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A watch open but silent (or failing) for longer than the grace: the cache's silence is no end
    # while a list of the API server still shows the pod.
    alloc, pods = _early_from_a_fresh_list(tmp_path)
    monkeypatch.setattr(allocator_module, "FRESH_LIST_GRACE_SECONDS", 0.0)
    assert alloc.recycle() == [], "freed while the API server lists it running"
    assert alloc.get(uid_of("early"), "c") is not None
    assert pods.refreshes == 2, "the API server must be asked once the grace has passed"
    pods.refresh_error = TimeoutError("the API server did not answer a pod list within 3 s")
    assert alloc.recycle() == [], "nor freed when the API server cannot be asked"
    pods.refresh_error = None
    pods.gone_at_server.add(uid_of("early"))
    assert alloc.recycle() == [uid_of("early")]


def test_the_queues_of_waiting_pods_choose_as_a_look_at_every_waiting_pod_would(tmp_path: Path) -> None:
    """Allocate takes its candidate from per-size heaps of the waiting pods; through adds, updates, ends,
    allocations, swaps, take-backs and undone allocations, the heaps' choice stays the full scan's."""
    rng = random.Random(7)
    pods = FakePods()
    alloc = make_allocator(tmp_path, pods)
    fail_next_write = [False]
    real_sync = alloc._store.sync

    def sync(ticket: int) -> None:
        if fail_next_write[0]:
            fail_next_write[0] = False
            raise OSError(5, "Input/output error")
        real_sync(ticket)

    alloc._store.sync = sync  # type: ignore[method-assign]
    sizes = (10, 20, 30)
    next_id = iter(range(10**6))
    made = 0

    def fresh_ids(count: int) -> list[str]:
        return [f"{names.VCORE_RESOURCE}-{next(next_id)}" for _ in range(count)]

    def add() -> None:
        nonlocal made
        made += 1
        containers = [("c", rng.choice(sizes), 1)]
        if rng.random() < 0.2:
            containers.append(("d", rng.choice(sizes), 1))
        annotations = {"tencent.com/predicate-time": str(rng.randrange(5))} if rng.random() < 0.5 else {}
        created = f"2026-11-21T10:00:{rng.randrange(60):02d}Z"
        pods.items.append(make_pod(f"p{made}", containers, annotations=annotations, created=created))

    def allocate() -> None:
        with contextlib.suppress(AllocationError):
            alloc.allocate(fresh_ids(rng.choice(sizes)))

    def allocate_failing_write() -> None:
        fail_next_write[0] = True
        with contextlib.suppress(AllocationError):
            alloc.allocate(fresh_ids(rng.choice(sizes)))
        fail_next_write[0] = False

    def update() -> None:
        if pods.items:
            p = rng.choice(pods.items)
            change = rng.randrange(3)
            if change == 0:
                p["metadata"]["annotations"][names.GPU_ASSIGNED] = "true"
            elif change == 1:
                p["status"] = dict(RUNNING)
            else:
                p["metadata"]["labels"] = {"touched": str(rng.random())}

    def end() -> None:
        if pods.items:
            p = rng.choice(pods.items)
            if rng.random() < 0.5:
                pods.items.remove(p)
            else:
                p["status"]["phase"] = "Succeeded"

    def swap() -> None:
        held = alloc.allocations()
        if held:
            mine = rng.choice(held)
            others = [
                (uid, w.requests[0].name)
                for uid, w in alloc._waiting.items()
                if len(w.requests) == 1 and w.requests[0].cores == mine.cores
            ]
            if others:
                with contextlib.suppress(AllocationError):
                    alloc.pre_start(list(mine.device_ids), rng.choice(others))

    def take_back() -> None:
        held = [a for a in alloc.allocations() if a.device_ids]
        if held:
            mine = rng.choice(held)
            with contextlib.suppress(AllocationError):
                alloc.pre_start(list(mine.device_ids), mine.key)  # started: its IDs may come back
            with contextlib.suppress(AllocationError):
                alloc.allocate(list(mine.device_ids))

    steps = [add, add, add, allocate, allocate, allocate_failing_write, update, end, swap, take_back]
    for _ in range(600):
        rng.choice(steps)()
        if rng.random() < 0.1:
            alloc.recycle()
        with alloc._lock:
            alloc._take_pod_changes()
            for cores in sizes:
                full = alloc._best(list(alloc._waiting.values()), cores)
                queued = alloc._match_cached(cores)
                assert (full and (uid_of_pod(full.pod), full.request.name)) == (
                    queued and (uid_of_pod(queued.pod), queued.request.name)
                )


def uid_of_pod(pod: Any) -> str:
    return str(pod["metadata"]["uid"])


def a_b_c_whole_and_d_a_share_running(tmp_path: Path, pods: FakePods) -> Allocator:
    """a..c hold three of the node's four GPUs, d 30 cores of the fourth; all run."""
    holders = [whole(n, i) for i, n in enumerate("abc")]
    holders.append(make_pod("d", [("c", 30, 2)], created="2026-11-21T10:03:00Z"))
    pods.items.extend(holders)
    alloc = make_allocator(tmp_path, pods)
    for gpu in range(3):
        alloc.allocate(core_ids(gpu, 100))
    alloc.allocate(core_ids(3, 30))
    for p in holders:
        p["status"] = dict(RUNNING)
    return alloc


def test_ids_handed_on_to_a_pod_found_by_asking_the_api_server_free_their_holder(tmp_path: Path) -> None:
    # The kubelet stopped d's containers and gave d's device IDs, with more, to e, a pod this node's pod
    # watch has not delivered yet (and whose status still says d runs): Allocate finds e by asking the API
    # server, and the IDs it carries say d no longer holds its share, as they do for a pod the cache shows.
    pods = FakePods()
    alloc = a_b_c_whole_and_d_a_share_running(tmp_path, pods)
    pods.refresh_fills_cache = False
    pods.hidden = [whole("e", 9)]
    alloc.allocate(core_ids(3, 100))
    assert pods.refreshes == 1
    assert alloc.get(uid_of("d"), "c") is None
    assert alloc.get(uid_of("e"), "c") is not None


def test_ids_handed_on_to_a_pod_the_cache_shows_free_their_holder(tmp_path: Path) -> None:
    pods = FakePods()
    alloc = a_b_c_whole_and_d_a_share_running(tmp_path, pods)
    pods.items.append(whole("e", 9))
    alloc.allocate(core_ids(3, 100))
    assert alloc.get(uid_of("d"), "c") is None
    assert alloc.get(uid_of("e"), "c") is not None
