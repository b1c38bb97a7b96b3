"""Battery: pods deleted as a real API server deletes them, while the kubelet's status lags.

A real API server deletes a pod bound to a node gracefully: it only gets a
``deletionTimestamp`` until the kubelet has stopped its containers and removed it. The kubelet's
status update naming the containers lags their start, so a pod deleted right after its
containers started shows no container status at all while they still run. Its GPUs must stay
held until its containers are known to have stopped (or the pod is gone); otherwise the next pod
lands on a GPU that is still busy.
"""

from __future__ import annotations

import time
from pathlib import Path

from kubernetes.client import CoreV1Api

from gpumanager import names
from simnode.cluster import SimCluster, admission_annotations, gpu_pod
from tests.battery_fixtures import (
    assert_no_overcommit,
    memory_of,
    spec_a100_pcie_x2,
    spec_one_gpu,
    wait_agent_matches,
)


def test_pod_deleted_before_its_status_arrives_keeps_its_gpu(tmp_path: Path) -> None:
    cluster = SimCluster(tmp_path / "node", spec_a100_pcie_x2(tmp_path / "spec.json"), status_lag=30.0)
    with cluster:
        first = cluster.run_pod(gpu_pod("first", [("main", 60, 40)], annotations=admission_annotations([[0]], 1)))
        # DELETE through the API, as a user does: graceful; the kubelet stops the containers and frees
        # their device IDs, but its status update saying so is 30 s away.
        CoreV1Api(cluster.api.client()).delete_namespaced_pod(first.name, first.namespace)
        assert cluster.pod(first).get("metadata", {}).get("deletionTimestamp")
        deadline = time.monotonic() + 10
        while cluster.kubelet.allocations(first.uid):  # the kubelet frees the device IDs
            assert time.monotonic() < deadline, "the kubelet did not stop the deleted pod"
            time.sleep(0.05)
        second = cluster.run_pod(gpu_pod("second", [("main", 60, 40)]))
        assert_no_overcommit([first, second], memory_of(cluster))
        wait_agent_matches(cluster, [first, second])
        # The kubelet's last status and DELETE arrive: then, and only then, the agent frees the GPU.
        cluster.api.finish_deletion(first.namespace, first.name, first.uid)
        wait_agent_matches(cluster, [second])


def test_annotations_for_a_pod_never_land_on_its_namesake(tmp_path: Path) -> None:
    """A StatefulSet pod is deleted and created again under the same name while the agent's annotation
    patch for the old one is still being retried: the new pod must not get the old one's GPUs."""
    cluster = SimCluster(tmp_path / "node", spec_a100_pcie_x2(tmp_path / "spec.json"))
    with cluster:
        cluster.api.fail_next("PATCH", r"/pods/web-0$", 500, count=3)  # the patch is retried with backoff
        old = cluster.run_pod(gpu_pod("web-0", [("main", 30, 4)], annotations=admission_annotations([[1]], 1)))
        cluster.delete(old, wait=True)  # the StatefulSet makes the new pod once the old one is gone
        new = cluster.create(gpu_pod("web-0", [("main", 30, 4)]))
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:  # until the agent's fourth try has been answered
            if len([r for r in cluster.api.requests if r.method == "PATCH" and r.path.endswith("/web-0")]) > 3:
                break
            time.sleep(0.2)
        time.sleep(0.5)
        annotations = cluster.pod(cluster.runs[new["metadata"]["uid"]])["metadata"].get("annotations") or {}
        assert annotations.get(names.GPU_ASSIGNED) != "true", annotations
        run = cluster.runs[new["metadata"]["uid"]]
        cluster.admit(run.manifest, create=False)
        cluster.start_containers(run)
        wait_agent_matches(cluster, [run])


def test_ids_of_a_deleted_pod_in_a_larger_request_free_its_gpu(tmp_path: Path) -> None:
    """The kubelet stops a deleted pod's containers and hands some of their device IDs to a pod asking
    for more (here: every ID of the one GPU) before the pod's status says they stopped: the IDs show
    the kubelet no longer counts them as held, so the agent frees the old pod's share for the new pod."""
    cluster = SimCluster(tmp_path / "node", spec_one_gpu(tmp_path / "spec.json"), status_lag=30.0)
    with cluster:
        first = cluster.run_pod(gpu_pod("first", [("main", 30, 4)]))
        cluster.delete(first)  # its containers stop now; its status says so 30 s later
        whole = cluster.run_pod(gpu_pod("whole", [("main", 100, 0)]))
        assert set(first.core["main"].device_ids) <= set(whole.core["main"].device_ids)
        assert_no_overcommit([whole], memory_of(cluster))
        wait_agent_matches(cluster, [whole])


def test_the_kubelet_finishes_a_deleted_pod_after_its_status_lag(tmp_path: Path) -> None:
    """What the node does with a graceful deletion: the containers stop at once (cgroups gone, device IDs
    free), then the last status (terminated, Succeeded) and the DELETE with grace 0 follow the lag."""
    cluster = SimCluster(tmp_path / "node", spec_a100_pcie_x2(tmp_path / "spec.json"), status_lag=1.0)
    with cluster:
        run = cluster.run_pod(gpu_pod("p", [("main", 30, 4)]))
        cluster.wait_status(run)
        events = cluster.api.pod_events()
        cluster.delete(run)
        assert not cluster.kubelet.allocations(run.uid)
        assert not (cluster.cgroup_root / "kubepods" / f"pod{run.uid}").exists()
        assert cluster.pod(run)["metadata"]["deletionTimestamp"]  # still there meanwhile
        seen = []
        while not seen or seen[-1][0] != "DELETED":
            kind, pod = events.get(timeout=15)
            if pod["metadata"]["uid"] == run.uid:
                states = [next(iter(cs["state"])) for cs in pod["status"].get("containerStatuses") or []]
                seen.append((kind, pod["status"]["phase"], states))
        cluster.api.close_pod_events(events)
        assert seen == [
            ("MODIFIED", "Running", ["running"]),  # the deletionTimestamp
            ("MODIFIED", "Succeeded", ["terminated"]),
            ("DELETED", "Succeeded", ["terminated"]),
        ]
        wait_agent_matches(cluster, [])
