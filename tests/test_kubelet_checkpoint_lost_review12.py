"""The kubelet loses ``kubelet_internal_checkpoint`` (the device-plugin directory removed and made again, or
the file damaged) and restarts, while pods with GPU shares run.

What the kubelet does then (pkg/kubelet/cm/devicemanager/manager.go): its device manager starts with no
record of any container's devices; a running container runs on (kubelet 1.27 on: no allocation for a
container found running while the sources are not ready). When such a container starts again,
GetDeviceRunContainerOptions calls ``callPreStartContainerIfNeeded`` first, which for a plugin with
``PreStartRequired`` (ours, both resources) fails with "no devices found allocated in local cache for pod
..., container ..., resource ..." before the re-allocation further down is reached: no Allocate, no
PreStartContainer reaches the plugin, and the start fails (CreateContainerConfigError) at every try.

Meanwhile the kubelet counts every device ID free: a new pod may be handed exactly the IDs a running
container holds (the agent's GetPreferredAllocation names the lowest free IDs of the GPU it would use).
Those IDs coming back do not mean that container ended: its GPU share must stay charged.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumanager import names
from gpumanager.allocation.allocator import AllocationError, Allocator
from simnode.cluster import SimCluster, admission_annotations, gpu_pod
from simnode.kubelet import KubeletSimError
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of


def _usage(cluster: SimCluster) -> dict[tuple[str, str], tuple[tuple[int, ...], float]]:
    """(pod uid, container) -> (GPU indexes, GPUs' worth of cores) as the agent's /usage says."""
    assert cluster.agent is not None
    url = f"http://127.0.0.1:{cluster.agent.query_port}/usage"
    with urllib.request.urlopen(url, timeout=10) as answer:
        usage = json.loads(answer.read().decode()).get("usage", {})
    out = {}
    for uid, pod in usage.items():
        for container, spec in pod["spec"].items():
            cards = tuple(sorted(int(d["card_idx"]) for d in pod["stat"][container]["dev"]))
            out[(uid, container)] = (cards, float(spec["gpu"]))
    return out


def _lose_checkpoint_and_restart_kubelet(cluster: SimCluster) -> None:
    """The operator removes the kubelet's checkpoint and the kubelet restarts; the agent registers again."""
    cluster.kubelet.checkpoint_path.unlink()
    created = cluster.restart_kubelet()
    for resource in (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE):
        cluster.kubelet.wait_for_registration(resource, since=created, timeout=30, with_devices=True)


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path) -> Iterator[SimCluster]:
    sim = SimCluster(tmp_path, "h100-nvlink-x8", seed=12, status_lag=0, fill="sorted")
    sim.start()
    try:
        yield sim
    finally:
        sim.stop()


def test_a_restarted_container_fails_before_any_plugin_call_and_its_share_stays_held(cluster: SimCluster) -> None:
    run = cluster.run_pod(gpu_pod("a", [("main", 50, 16)], annotations=admission_annotations([[0]], 1)))
    before = _usage(cluster)
    assert before[(run.uid, "main")] == ((0,), 0.5)
    allocations = len(cluster.kubelet.allocations())
    pre_starts = len(cluster.kubelet.pre_start_calls)

    _lose_checkpoint_and_restart_kubelet(cluster)
    assert cluster.kubelet.allocations(run.uid) == []  # the restarted kubelet knows no devices of the pod

    with pytest.raises(KubeletSimError, match="no devices found allocated in local cache for pod"):
        cluster.restart_container(run, "main")
    # Neither an Allocate nor a PreStartContainer reached the agent; it holds the share as before.
    assert len(cluster.kubelet.pre_start_calls) == pre_starts
    assert len(cluster.kubelet.allocations()) <= allocations
    assert _usage(cluster) == before
    # The pod runs on with its container waiting, which the agent names once, with what to do.
    status = cluster.pod(run)["status"]
    assert status["phase"] == "Running"
    waiting = status["containerStatuses"][0]["state"]["waiting"]
    assert waiting["reason"] == "CreateContainerConfigError"
    assert waiting["message"] == (
        f"no devices found allocated in local cache for pod {run.uid}, container main, resource "
        + waiting["message"].rsplit("resource ", 1)[1]
    )
    assert cluster.agent is not None
    deadline = time.monotonic() + 10
    while not (told := [line for line in cluster.agent.log_text().splitlines() if "cannot start again" in line]):
        assert time.monotonic() < deadline, cluster.agent.log_text()[-3000:]
        time.sleep(0.05)
    assert " ERROR " in told[0] and "pod default/a container main" in told[0]
    assert "its GPUs [0] stay held for it" in told[0] and "delete the pod" in told[0]
    with pytest.raises(KubeletSimError):  # the kubelet's next try fails the same way, told once
        cluster.restart_container(run, "main")
    time.sleep(0.5)
    assert len([line for line in cluster.agent.log_text().splitlines() if "cannot start again" in line]) == 1


def test_a_new_pod_handed_the_ids_of_a_running_container_does_not_take_its_gpu_share(cluster: SimCluster) -> None:
    running = cluster.run_pod(gpu_pod("a", [("main", 50, 16)], annotations=admission_annotations([[0]], 1)))
    held = {
        r.container_name: set(r.device_ids)
        for r in cluster.kubelet.allocations(running.uid)
        if r.resource == names.VCORE_RESOURCE
    }
    _lose_checkpoint_and_restart_kubelet(cluster)

    new = cluster.run_pod(gpu_pod("b", [("main", 50, 16)], annotations=admission_annotations([[0]], 2)))
    given = {
        r.container_name: set(r.device_ids)
        for r in cluster.kubelet.allocations(new.uid)
        if r.resource == names.VCORE_RESOURCE
    }
    assert given == held  # the kubelet handed the running container's IDs on (what makes this case)

    usage = _usage(cluster)
    assert usage.get((running.uid, "main")) == ((0,), 0.5), usage  # still charged: its container runs
    assert usage[(new.uid, "main")] == ((0,), 0.5)
    assert cluster.agent is not None
    warned = [line for line in cluster.agent.log_text().splitlines() if "keeps its GPUs [0]" in line]
    assert len(warned) == 1 and "pod default/a " in warned[0] and "kubelet_internal_checkpoint" in warned[0]
    # A third share on GPU 0 no longer fits there: refused, never placed over the running one.
    with pytest.raises(KubeletSimError, match="predicated GPU 0 cannot hold 50 cores"):
        cluster.admit(gpu_pod("c", [("main", 50, 16)], annotations=admission_annotations([[0]], 3)))
    per_gpu: dict[int, float] = {}
    for cards, gpus in _usage(cluster).values():
        for card in cards:
            per_gpu[card] = per_gpu.get(card, 0.0) + gpus / len(cards)
    assert all(share <= 1.0001 for share in per_gpu.values()), per_gpu


# -- the allocator's rule, without the node: the kubelet's records and the API server decide -----------------


def _running_and_next(tmp_path: Path, records: bool) -> tuple[Allocator, FakePods, list[str], list[tuple[str, str]]]:
    """Pod ``run`` (50 cores on GPU 0) started and running, pod ``next`` asking for 50; the kubelet's records
    hold devices of ``run``'s container or not; returns what they were asked about."""
    run = make_pod("run", [("c", 50, 8)])
    pods = FakePods([run])
    alloc = make_allocator(tmp_path, pods)
    asked: list[tuple[str, str]] = []

    def lookup(key: tuple[str, str]) -> bool:
        asked.append(key)
        return records

    alloc.set_kubelet_records(lookup)
    ids = core_ids(0, 50)
    alloc.allocate(ids)
    alloc.pre_start(ids, (uid_of("run"), "c"))
    run["status"] = {
        "phase": "Running",
        "containerStatuses": [{"name": "c", "containerID": "containerd://0f1e", "state": {"running": {}}}],
    }
    pods.items.append(make_pod("next", [("c", 50, 8)], created="2026-11-21T11:00:00Z"))
    return alloc, pods, ids, asked


def test_the_ids_of_a_running_container_the_kubelet_has_no_record_of_leave_it_its_share(tmp_path: Path) -> None:
    alloc, pods, ids, asked = _running_and_next(tmp_path, records=False)
    refreshes = pods.refreshes
    answer = alloc.allocate(ids)
    assert answer.mounts[1].host_path.endswith(uid_of("next"))
    assert asked == [(uid_of("run"), "c")] and pods.refreshes == refreshes + 1
    kept, given = alloc.get(uid_of("run"), "c"), alloc.get(uid_of("next"), "c")
    assert kept is not None and given is not None
    assert kept.minors == (0,) and kept.cores == 50
    assert alloc.tree_snapshot()[0][1] + sum(a.cores for a in alloc.allocations() if 0 in a.minors) == 100
    # Both records are durable; the new container starts with the IDs, the running one keeps its share.
    assert alloc.pre_start(ids, (uid_of("next"), "c")).pod_uid == uid_of("next")
    restarted = make_allocator(tmp_path, pods)
    restarted.load()
    assert restarted.get(uid_of("run"), "c") is not None and restarted.get(uid_of("next"), "c") is not None


def test_a_full_gpu_is_never_given_the_room_of_a_running_container_the_kubelet_has_no_record_of(
    tmp_path: Path,
) -> None:
    """The IDs taken back when no GPU has room (take_back_handed_on) spare that container too."""
    run = make_pod("run", [("c", 100, 8)])
    pods = FakePods([run])
    alloc = make_allocator(tmp_path, pods)
    alloc.set_kubelet_records(lambda key: False)
    gpus = len(alloc.tree_snapshot())
    held = [core_ids(g, 100) for g in range(gpus)]
    ids = held[0]
    alloc.allocate(ids)
    alloc.pre_start(ids, (uid_of("run"), "c"))
    run["status"] = {"phase": "Running", "containerStatuses": [{"name": "c", "state": {"running": {}}}]}
    for g in range(1, gpus):
        other = make_pod(f"o{g}", [("c", 100, 8)], created=f"2026-11-21T10:0{g}:00Z")
        pods.items.append(other)
        alloc.allocate(held[g])
    pods.items.append(make_pod("next", [("c", 100, 8)], created="2026-11-21T11:00:00Z"))
    with pytest.raises(AllocationError):
        alloc.allocate(ids)
    assert alloc.get(uid_of("run"), "c") is not None and alloc.get(uid_of("next"), "c") is None


def test_the_ids_of_a_running_container_the_kubelet_still_records_go_to_the_new_pod(tmp_path: Path) -> None:
    """Its records hold that container: the IDs came back because its pod ended (the status not yet told)."""
    alloc, pods, ids, asked = _running_and_next(tmp_path, records=True)
    refreshes = pods.refreshes
    alloc.allocate(ids)
    assert asked == [(uid_of("run"), "c")] and pods.refreshes == refreshes  # the API server not asked
    assert alloc.get(uid_of("run"), "c") is None and alloc.get(uid_of("next"), "c") is not None


def test_the_ids_of_a_running_container_of_a_pod_being_deleted_at_the_api_server_go_to_the_new_pod(
    tmp_path: Path,
) -> None:
    alloc, pods, ids, _ = _running_and_next(tmp_path, records=False)
    pods.gone_at_server.add(uid_of("run"))
    alloc.allocate(ids)
    assert alloc.get(uid_of("run"), "c") is None and alloc.get(uid_of("next"), "c") is not None


def test_ids_overlapping_a_running_container_the_kubelet_has_no_record_of_never_take_its_room(
    tmp_path: Path,
) -> None:
    """No GPU has room, and the request's IDs share some with a running container the kubelet lost the
    record of (not all of them): it is not taken back for them (take_back_handed_on), the request is refused."""
    run = make_pod("run", [("c", 100, 8)])
    pods = FakePods([run])
    alloc = make_allocator(tmp_path, pods)
    alloc.set_kubelet_records(lambda key: False)
    gpus = len(alloc.tree_snapshot())
    alloc.allocate(core_ids(0, 100))
    alloc.pre_start(core_ids(0, 100), (uid_of("run"), "c"))
    run["status"] = {"phase": "Running", "containerStatuses": [{"name": "c", "state": {"running": {}}}]}
    for g in range(1, gpus):
        pods.items.append(make_pod(f"o{g}", [("c", 100, 8)], created=f"2026-11-21T10:0{g}:00Z"))
        alloc.allocate(core_ids(g, 100))
    pods.items.append(make_pod("next", [("c", 50, 8)], created="2026-11-21T11:00:00Z"))
    with pytest.raises(AllocationError):
        alloc.allocate(core_ids(0, 50))
    assert alloc.get(uid_of("run"), "c") is not None and alloc.get(uid_of("next"), "c") is None


def test_an_agent_restarted_after_the_kubelet_lost_its_checkpoint_keeps_every_share(cluster: SimCluster) -> None:
    """The kubelet's records and PodResources no longer name the running containers: they free nothing."""
    one = cluster.run_pod(gpu_pod("a", [("main", 50, 16)], annotations=admission_annotations([[0]], 1)))
    cluster.run_pod(gpu_pod("b", [("main", 100, 16)]))
    before = _usage(cluster)
    _lose_checkpoint_and_restart_kubelet(cluster)
    assert cluster.agent is not None
    cluster.agent.stop()
    cluster.start_agent()
    assert _usage(cluster) == before
    new = cluster.run_pod(gpu_pod("c", [("main", 50, 16)], annotations=admission_annotations([[0]], 2)))
    usage = _usage(cluster)
    assert usage[(one.uid, "main")] == ((0,), 0.5) and usage[(new.uid, "main")] == ((0,), 0.5)
