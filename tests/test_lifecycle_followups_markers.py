"""Records rebuilt from the kubelet's records (our checkpoint lost) get the Init and Mirror markers the
pod objects tell: init containers are not summed with the others, and a static pod outlives the
deletion of its mirror pod."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from gpumanager import names
from simnode.cluster import SimCluster, admission_annotations, gpu_pod
from simnode.kubelet import PluginRPCError
from tests.battery_fixtures import agent_allocated, memory_of, spec_a100_pcie_x2, spec_one_gpu, wait_agent_matches
from tests.test_battery_pods import _with_init

MIRROR = "kubernetes.io/config.mirror"


def _lose_our_checkpoint(cluster: SimCluster) -> None:
    assert cluster.agent is not None
    cluster.agent.stop()
    for path in cluster.checkpoint_dir.glob(names.OWN_CHECKPOINT + "*"):
        path.unlink()
    cluster.start_agent()


def _wait_log(cluster: SimCluster, mark: str, timeout: float = 30.0) -> None:
    assert cluster.agent is not None
    deadline = time.monotonic() + timeout
    while mark not in cluster.agent.log_text():
        assert time.monotonic() < deadline, f"the agent did not log {mark!r}"
        time.sleep(0.05)


def test_init_container_rebuilt_from_the_kubelet_checkpoint_is_not_summed(tmp_path: Path) -> None:
    """Init 60 cores / 8 blocks, app 40 cores / 4 blocks on one GPU: the pod holds 60 / 8 there (the
    kubelet's count); rebuilt from kubelet_internal_checkpoint alone, still 60 / 8, not 100 / 12."""
    cluster = SimCluster(tmp_path / "node", spec_one_gpu(tmp_path / "spec.json"), pod_resources=False, status_lag=0.0)
    with cluster:
        run = cluster.run_pod(_with_init("with-init", (60, 8), [("main", 40, 4)]))
        wait_agent_matches(cluster, [run])
        _lose_our_checkpoint(cluster)
        wait_agent_matches(cluster, [run])


def test_static_pod_rebuilt_from_pod_resources_outlives_its_mirror_pod(tmp_path: Path) -> None:
    """A static pod rebuilt from PodResources (no kubelet checkpoint): the deletion of its mirror pod stops
    no container, so its GPU stays held; a pod predicated onto that GPU is refused there."""
    cluster = SimCluster(
        tmp_path / "node", spec_a100_pcie_x2(tmp_path / "spec.json"), kubelet_checkpoint=False, status_lag=0.0
    )
    with cluster:
        static_uid = hashlib.md5(b"kube-system/etcd manifest").hexdigest()
        hashes = admission_annotations([[0]], 1) | {
            MIRROR: static_uid,
            "kubernetes.io/config.hash": static_uid,
            "kubernetes.io/config.source": "file",
        }
        created = cluster.create(gpu_pod("etcd-node", [("main", 100, 0)], namespace="kube-system", annotations=hashes))
        run = cluster.runs[created["metadata"]["uid"]]
        cluster.kubelet.allocate(
            names.VCORE_RESOURCE,
            100,
            pod_uid=static_uid,
            container_name="main",
            pod_name=run.name,
            namespace=run.namespace,
        )
        cluster.kubelet.pre_start(names.VCORE_RESOURCE, pod_uid=static_uid, container_name="main")
        running = [{"name": "main", "containerID": "containerd://e7cd", "state": {"running": {}}}]
        cluster.api.set_pod_phase(run.namespace, run.name, "Running", containerStatuses=running)
        want = {m: (100, total) if m == min(memory_of(cluster)) else (0, 0) for m, total in memory_of(cluster).items()}
        deadline = time.monotonic() + 30
        while agent_allocated(cluster) != want:
            assert time.monotonic() < deadline, agent_allocated(cluster)
            time.sleep(0.1)
        _lose_our_checkpoint(cluster)
        _wait_log(cluster, "rebuilt 1 container allocations from PodResources")
        cluster.api.delete_pod(run.namespace, run.name)  # kubectl delete of the mirror pod
        _wait_log(cluster, f"mirror pod {run.namespace}/{run.name} of a static pod was deleted")
        other = cluster.create(gpu_pod("other", [("main", 100, 0)], annotations=admission_annotations([[0]], 2)))
        with pytest.raises(PluginRPCError) as refused:
            cluster.kubelet.allocate(
                names.VCORE_RESOURCE,
                100,
                pod_uid=other["metadata"]["uid"],
                container_name="main",
                pod_name="other",
                namespace="default",
            )
        assert "predicated GPU 0 is not entirely free" in str(refused.value), refused.value
        assert agent_allocated(cluster) == want
