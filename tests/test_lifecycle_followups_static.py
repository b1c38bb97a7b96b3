"""Static pods rebuilt from the kubelet's checkpoint when our own checkpoint is lost: the kubelet keys a
static pod by its own UID (the MD5 of the manifest as 32 hex digits, the config hash its mirror pod
carries), not by the mirror pod's UUID."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from gpumanager import names, safenames
from simnode.cluster import SimCluster, admission_annotations, gpu_pod
from simnode.kubelet import PluginRPCError
from tests.battery_fixtures import agent_allocated, memory_of, spec_a100_pcie_x2

MIRROR = "kubernetes.io/config.mirror"


def test_the_kubelets_static_pod_uid_is_a_safe_pod_uid() -> None:
    uid = hashlib.md5(b"static pod manifest").hexdigest()
    assert safenames.pod_uid(uid) == uid and safenames.is_static_pod_uid(uid)
    for bad in (uid.upper(), uid[:-1], uid + "0", "../" + uid[3:], uid[:31] + "/", uid[:31] + "\n"):
        with pytest.raises(safenames.UnsafeNameError):
            safenames.pod_uid(bad)


def _wait_held(cluster: SimCluster, want: dict[int, tuple[int, int]]) -> None:
    deadline = time.monotonic() + 30
    while agent_allocated(cluster) != want:
        assert time.monotonic() < deadline, f"agent holds {agent_allocated(cluster)}, not {want}"
        time.sleep(0.1)


@pytest.mark.parametrize("pod_resources", [False, True])
def test_a_static_pod_rebuilt_from_the_kubelet_checkpoint_keeps_its_gpu(tmp_path: Path, pod_resources: bool) -> None:
    """With PodResources too, the static pod is held once (PodResources names its mirror pod)."""
    cluster = SimCluster(
        tmp_path / "node", spec_a100_pcie_x2(tmp_path / "spec.json"), pod_resources=pod_resources, status_lag=0.0
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
        cluster.kubelet.allocate(  # the kubelet admits its static pod, under its own UID
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
        want = {m: (100, total) if m == 0 else (0, 0) for m, total in memory_of(cluster).items()}
        _wait_held(cluster, want)
        assert cluster.agent is not None
        cluster.agent.stop()
        for path in cluster.checkpoint_dir.glob(names.OWN_CHECKPOINT + "*"):
            path.unlink()  # our checkpoint is lost: only the kubelet's names the static pod's GPU
        cluster.start_agent()
        # A pod asking for the whole GPU: the static pod still runs on it.
        other = cluster.create(gpu_pod("other", [("main", 100, 0)], annotations=admission_annotations([[0]], 2)))
        with pytest.raises(PluginRPCError, match="predicated GPU 0 is not entirely free"):
            cluster.kubelet.allocate(
                names.VCORE_RESOURCE,
                100,
                pod_uid=other["metadata"]["uid"],
                container_name="main",
                pod_name="other",
                namespace="default",
            )
        _wait_held(cluster, want)
