"""The kubelet admits a pod as soon as its own watch shows it; ours may lag. GetPreferredAllocation then
finds the pod in a list asked of the API server, and the Allocate and PreStartContainer that follow use that
list while the pod cache knows nothing newer: one list per admission, not three or four. A list made before
the admission began serves none of its calls: it may show as waiting a pod that failed its admission, was
deleted, or was replaced by another of its name since."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from gpumanager.allocation.pods import Pod
from simnode.apiserver_faults import RequestRecord
from simnode.cluster import SimCluster, gpu_pod
from simnode.kubelet import KubeletSimError
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of
from tests.test_kubelet_checkpoint_lost_review12 import _usage


def _pod_lists(requests: list[RequestRecord]) -> list[RequestRecord]:
    return [
        r
        for r in requests
        if r.method == "GET" and r.path == "/api/v1/pods" and r.query.get("watch") not in ("true", "1")
    ]


def _usage_of(c: SimCluster, count: int) -> dict[tuple[str, str], tuple[tuple[int, ...], float]]:
    """/usage once it shows ``count`` containers (the watch caught up), or as it is after 20 s."""
    deadline = time.monotonic() + 20
    while len(usage := _usage(c)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return usage


def test_the_calls_of_one_admission_behind_a_lagging_watch_list_the_pods_once(tmp_path: Path, sim_built: Path) -> None:
    with SimCluster(tmp_path, "v100-pcie-x4", status_lag=0) as c:
        c.api.hold_watches(True)  # the agent's pod cache does not see the pods below
        runs = []
        try:
            for i in range(3):
                c.api.clear_requests()
                runs.append(c.run_pod(gpu_pod(f"late{i}", [("main", 30, 4)])))
                lists = _pod_lists(c.api.requests)
                assert len(lists) == 1, [(r.path, dict(r.query)) for r in lists]
        finally:
            c.api.hold_watches(False)
        usage = _usage_of(c, len(runs))
        for run in runs:  # each pod's own allocation
            cards, gpus = usage[(run.uid, "main")]
            assert len(cards) == 1 and gpus == 0.3, usage


@pytest.mark.parametrize("gone", ["deleted", "failed", "replaced by its namesake"])
def test_a_pod_listed_before_the_admission_began_and_gone_since_is_not_given_its_gpus(
    tmp_path: Path, sim_built: Path, gone: str
) -> None:
    """``first`` is bound and listed (for another pod's admission), then leaves (deleted, or failed), or is
    replaced by a pod of its name, while the watch lags; the pod admitted next, asking as much, gets the
    GPUs, never the departed pod."""
    with SimCluster(tmp_path, "v100-pcie-x4", status_lag=0) as c:
        c.api.hold_watches(True)
        try:
            first = c.create(gpu_pod("web-0", [("main", 30, 4)]))  # bound, not admitted yet
            other = c.run_pod(gpu_pod("other", [("main", 50, 4)]))  # its admission lists web-0 too
            if gone == "failed":

                def failed(pod: dict[str, Any]) -> None:
                    pod.setdefault("status", {}).update(phase="Failed", reason="UnexpectedAdmissionError")

                c.api.update_pod("default", "web-0", failed)
            else:
                c.api.delete_pod("default", "web-0")
            name = "web-0" if gone == "replaced by its namesake" else "next"
            new = c.run_pod(gpu_pod(name, [("main", 30, 4)]))  # admitted within the list's 2 s
            assert new.uid != first["metadata"]["uid"]
        finally:
            c.api.hold_watches(False)
        usage = _usage_of(c, 2)
        assert (new.uid, "main") in usage, usage
        assert (first["metadata"]["uid"], "main") not in usage, usage
        assert set(usage) == {(other.uid, "main"), (new.uid, "main")}, usage


def test_a_pod_refused_its_gpus_does_not_stand_for_the_next_pod_asking_as_much(tmp_path: Path, sim_built: Path) -> None:
    """``big``'s Allocate is refused (no GPU has its memory) and it fails; ``small``, asking as many cores and
    admitted within 2 s, is matched on a list made for its own admission, not on the one ``big`` was found in."""
    with SimCluster(tmp_path, "v100-pcie-x4", status_lag=0) as c:
        c.api.hold_watches(True)
        try:
            with pytest.raises(KubeletSimError):
                c.run_pod(gpu_pod("big", [("main", 30, 200)]))
            small = c.run_pod(gpu_pod("small", [("main", 30, 4)]))
        finally:
            c.api.hold_watches(False)
        usage = _usage_of(c, 1)
        assert set(usage) == {(small.uid, "main")}, usage


class _LaggingPods(FakePods):
    """A cache that shows no pod (``items``) while the API server lists ``hidden``; recent() as the pod
    cache's: the last list, when sent since the time asked, young enough, and no change taken in since."""

    def __init__(self) -> None:
        super().__init__()
        self.refresh_fills_cache = False
        self.last: tuple[float, list[Pod]] | None = None

    def refresh(self) -> list[Pod]:
        sent = time.monotonic()
        items = super().refresh()
        self.last = (sent, items)
        return items

    def recent(self, within: float, since: float) -> list[Pod] | None:
        if self.last is None or self.last[0] < since or time.monotonic() - self.last[0] >= within:
            return None
        return self.last[1]


@pytest.mark.parametrize("orphan", [30, 50])
def test_a_preferred_allocation_whose_allocate_never_came_serves_no_other_admission(
    tmp_path: Path, orphan: int
) -> None:
    """A GetPreferredAllocation whose Allocate never came (refused before the allocator, the kubelet restarted
    meanwhile) leaves nothing an Allocate without one of its own (Topology Manager's aligned IDs, an init
    container's reused IDs) takes for its admission's start: ``next`` is matched on a list made for it, not on
    the one made for ``other``'s admission, which still shows ``web-0``, deleted since."""
    pods = _LaggingPods()
    allocator = make_allocator(tmp_path, pods)
    allocator.preview(orphan)  # its Allocate never comes
    web0 = make_pod("web-0", [("main", 30, 4)], created="2026-11-21T10:00:00Z")
    other = make_pod("other", [("main", 50, 4)], created="2026-11-21T10:00:01Z")
    pods.hidden += [web0, other]
    allocator.preview(50)
    allocator.allocate(core_ids(0, 50))  # other's admission, from the list its preview made
    pods.hidden.remove(web0)  # deleted at the API server; the cache's watch lags
    pods.hidden.append(make_pod("next", [("main", 30, 4)], created="2026-11-21T10:00:02Z"))
    listed = pods.refreshes
    allocator.allocate(core_ids(1, 30))  # no GetPreferredAllocation of its own
    assert pods.refreshes == listed + 1
    held = {(a.pod_uid, a.container) for a in allocator.allocations()}
    assert held == {(uid_of("other"), "main"), (uid_of("next"), "main")}, held
