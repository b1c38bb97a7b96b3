"""vcuda-memory without vcuda-core next to a pending share of the same memory size: the Allocate call carries
only memory IDs and cannot be told apart from the share's, so it is answered; the container's start, whose
IDs the kubelet's records name, is refused by name."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpumanager import names
from simnode.cluster import SimCluster, gpu_pod
from simnode.kubelet import KubeletSimError
from tests.battery_fixtures import answered, gpu, write_spec

MEMORY = names.VMEMORY_RESOURCE


def _cluster(tmp_path: Path) -> SimCluster:
    return SimCluster(
        tmp_path / "node", write_spec(tmp_path / "one.json", [gpu(0, memory_mib=16384)], lambda i, j: "PHB")
    )


def test_memory_only_admitted_beside_a_pending_share_of_its_size_is_refused_at_its_start(tmp_path: Path) -> None:
    with _cluster(tmp_path) as cluster:
        share = cluster.create(gpu_pod("share", [("main", 50, 8)]))
        alone = cluster.create(gpu_pod("memory-only", [("main", 0, 8)]))
        time.sleep(1.0)  # the agent's pod cache sees both
        run = cluster.admit(alone, create=False)  # answered: it may have been the share's call
        with pytest.raises(KubeletSimError) as refused:
            cluster.start_containers(run)
        message = str(refused.value)
        assert "default/memory-only" in message and "main" in message, message
        assert f"8 {MEMORY}" in message and names.VCORE_RESOURCE in message, message
        assert names.PRESTART_FAILED in message, message
        # The share is admitted and starts as before.
        ok = cluster.admit(share, create=False)
        cluster.start_containers(ok)
        assert answered(ok)["main"][0] == (0,)


def test_a_share_starts_without_asking_the_kubelet_when_no_memory_only_container_is_known(tmp_path: Path) -> None:
    """The memory PreStartContainer of a container with cores asks the kubelet nothing when the pod cache
    shows no container asking memory without cores (it is called for every container with memory)."""
    with _cluster(tmp_path) as cluster:
        created = cluster.create(gpu_pod("share", [("main", 50, 8)]))
        time.sleep(1.0)  # the agent's pod cache shows it (behind a lagging watch its start is looked at)
        run = cluster.admit(created, create=False)
        before = len(cluster.kubelet.pod_resources_calls)
        cluster.kubelet.pre_start(MEMORY, pod_uid=run.uid, container_name="main")
        assert len(cluster.kubelet.pod_resources_calls) == before
        cluster.start_containers(run)
