"""A pod that ends by itself (a Job) while its status update has not reached the API server yet: the kubelet
stops counting it at once and hands its device IDs to the next pod, whose Allocate names exactly the IDs of
the ended container. On a GPU without other room that container's share must go to the new pod.

The same signals (a started container, its pod running at the API server, the kubelet's checkpoint without
its devices) also come from a kubelet restarted without its ``kubelet_internal_checkpoint``, where the
container runs on and keeps its share (tests/test_kubelet_checkpoint_lost_review12.py). What tells them
apart: the kubelet loses its records only across its restart, so only a container that started before the
kubelet's last restart and that its checkpoint, read after that restart, no longer lists was forgotten.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumanager import names
from gpumanager.kube.kubelet_checkpoint import KubeletRecords
from simnode.cluster import PodRun, SimCluster, admission_annotations, gpu_pod
from tests.test_kubelet_checkpoint_lost_review12 import _usage

LAG = 6.0


def _restart_kubelet(cluster: SimCluster) -> None:
    """The kubelet restarts with its checkpoint intact; the agent registers again."""
    created = cluster.restart_kubelet()
    for resource in (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE):
        cluster.kubelet.wait_for_registration(resource, since=created, timeout=30, with_devices=True)


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path) -> Iterator[SimCluster]:
    sim = SimCluster(tmp_path, "v100-pcie-x4", seed=12, status_lag=LAG, fill="sorted")
    sim.start()
    try:
        yield sim
    finally:
        sim.stop()


def _share(cluster: SimCluster, name: str, cores: int, gpu: int, at: int) -> PodRun:
    return cluster.run_pod(gpu_pod(name, [("main", cores, 16)], annotations=admission_annotations([[gpu]], at)))


def _core_ids(cluster: SimCluster, run: PodRun) -> dict[str, set[str]]:
    return {
        r.container_name: set(r.device_ids)
        for r in cluster.kubelet.allocations(run.uid)
        if r.resource == names.VCORE_RESOURCE
    }


@pytest.mark.parametrize("restart", ["none", "before the job", "while the job runs"])
@pytest.mark.parametrize("departed", ["kept until the next admission", "dropped at once"])
def test_the_ids_of_a_job_that_ended_go_to_the_next_pod_when_no_gpu_has_other_room(
    cluster: SimCluster, restart: str, departed: str
) -> None:
    """GPU 0 holds the job's share and another; GPU 1 half a GPU; GPUs 2 and 3 a whole pod each. The job ends,
    another pod fills GPU 1 (the kubelet's checkpoint is written then, without the job), and the next pod,
    predicated on GPU 0, is handed the only free IDs: the job's. Its status still says Running."""
    if departed == "dropped at once":
        cluster.kubelet.keep_departed_in_checkpoint = False
    if restart == "before the job":
        _restart_kubelet(cluster)
    runs = [
        _share(cluster, "filler", 50, 0, 1),
        _share(cluster, "half", 50, 1, 2),
        _share(cluster, "whole2", 100, 2, 3),
        _share(cluster, "whole3", 100, 3, 4),
    ]
    job = _share(cluster, "job", 50, 0, 5)
    for run in [*runs, job]:  # every status in the API server (LAG after each start)
        cluster.wait_status(run)
    held = _core_ids(cluster, job)
    if restart == "while the job runs":
        _restart_kubelet(cluster)
        assert cluster.kubelet.allocations(job.uid)  # the checkpoint kept its records

    # Its status (Succeeded) reaches the API server 120 s later: long after the checks below, however loaded
    # the machine (with LAG, the two admissions below took longer than that once).
    cluster.end_pod(job, status_lag=120)
    cluster.run_pod(gpu_pod("other", [("main", 50, 16)], annotations=admission_annotations([[1]], 6)))
    assert not any(e.pod_uid == job.uid for e in cluster.kubelet.checkpoint_entries())

    new = cluster.run_pod(gpu_pod("next", [("main", 50, 16)], annotations=admission_annotations([[0]], 7)))
    given = _core_ids(cluster, new)
    assert given == held  # the kubelet handed the ended container's IDs on (what makes this case)
    assert cluster.pod(job)["status"]["phase"] == "Running"  # the API server has not heard of its end yet

    usage = _usage(cluster)
    assert usage[(new.uid, "main")] == ((0,), 0.5), usage
    assert (job.uid, "main") not in usage, usage
    per_gpu: dict[int, float] = {}
    for cards, gpus in usage.values():
        for card in cards:
            per_gpu[card] = per_gpu.get(card, 0.0) + gpus / len(cards)
    assert all(share <= 1.0001 for share in per_gpu.values()), per_gpu
    assert cluster.agent is not None
    assert "keeps its GPUs" not in cluster.agent.log_text()


# -- which containers the kubelet forgot: read once per kubelet restart and at the agent's start -------------


def _write(path: Path, entries: list[tuple[str, str]]) -> None:
    data = {
        "Data": {
            "PodDeviceEntries": [
                {
                    "PodUID": uid,
                    "ContainerName": c,
                    "ResourceName": names.VCORE_RESOURCE,
                    "DeviceIDs": {"0": ["0-0"]},
                    "AllocResp": "",
                }
                for uid, c in entries
            ],
            "RegisteredDevices": {},
        },
        "Checksum": 0,
    }
    path.write_text(json.dumps(data))


def test_only_a_container_started_before_the_restart_and_not_listed_after_it_is_forgotten(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    _write(path, [("a", "c"), ("b", "c")])
    records = KubeletRecords(path, names.VCORE_RESOURCE)
    assert records.holds(("a", "c")) and records.holds(("x", "c"))  # nothing known forgotten before a restart
    records.note_restart([("a", "c"), ("b", "c")])
    assert records.holds(("a", "c")) and records.holds(("b", "c"))
    # After the restart "b" ends and the kubelet drops it from its checkpoint; "n" starts after the restart.
    _write(path, [("a", "c"), ("n", "c")])
    assert records.holds(("b", "c")) and records.holds(("n", "c"))  # not read again per question
    # The next restart without the file: every container started before it is forgotten.
    path.unlink()
    records.note_restart([("a", "c"), ("n", "c")])
    assert not records.holds(("a", "c")) and not records.holds(("n", "c"))
    assert records.holds(("later", "c"))


def test_a_damaged_checkpoint_read_after_a_restart_lists_nothing(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    path.write_text("{not json")
    records = KubeletRecords(path, names.VCORE_RESOURCE)
    records.note_restart([("a", "c")])
    assert not records.holds(("a", "c"))


def test_the_agent_start_uses_the_entries_recovery_read(tmp_path: Path) -> None:
    records = KubeletRecords(tmp_path / "absent", names.VCORE_RESOURCE)
    records.note_restart([("a", "c"), ("b", "c")], listed={("a", "c")})
    assert records.holds(("a", "c")) and not records.holds(("b", "c"))
