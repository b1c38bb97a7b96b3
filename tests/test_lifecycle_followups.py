"""Allocation lifecycle: forced deletions, the extender's count of init containers, static pods rebuilt
from the kubelet's checkpoint, and the markers of rebuilt records."""

from __future__ import annotations

import time
from pathlib import Path

from simnode.cluster import PodRun, SimCluster, gpu_pod
from tests.battery_fixtures import agent_allocated, held, memory_of, spec_one_gpu, wait_agent_matches


def _wait_log(cluster: SimCluster, *marks: str, timeout: float = 30.0) -> str:
    """The first of ``marks`` the agent logs (waited for)."""
    assert cluster.agent is not None
    deadline = time.monotonic() + timeout
    while True:
        text = cluster.agent.log_text()
        for mark in marks:
            if mark in text:
                return mark
        assert time.monotonic() < deadline, f"the agent logged none of {marks}:\n{text[-3000:]}"
        time.sleep(0.05)


def _released(run: PodRun) -> str:
    return f"released pod {run.uid}"


def test_forced_deletion_keeps_the_gpu_until_the_containers_stop(tmp_path: Path) -> None:
    """A pod deleted with grace 0 leaves the API server at once; the kubelet stops its containers only
    then (slowly here): its GPU stays held until its cgroup is gone."""
    cluster = SimCluster(tmp_path / "node", spec_one_gpu(tmp_path / "spec.json"), status_lag=0.0)
    with cluster:
        first = cluster.run_pod(gpu_pod("first", [("main", 100, 0)]))
        cluster.wait_status(first)
        wait_agent_matches(cluster, [first])
        cluster.slow_stop(first)
        cluster.api.request_deletion(first.namespace, first.name, grace_seconds=0)
        mark = _wait_log(cluster, _released(first), f"pod {first.namespace}/{first.name} was removed while")
        assert mark != _released(first), "the GPU was freed while the pod's containers still ran"
        assert agent_allocated(cluster) == held([first], memory_of(cluster))
        cluster.finish_stop(first)  # the containers stop: their cgroup goes
        _wait_log(cluster, _released(first))
        wait_agent_matches(cluster, [])


def test_graceful_deletion_frees_at_once_even_with_the_cgroup_left(tmp_path: Path) -> None:
    """The graceful path: the kubelet removes the pod after writing its containers' terminated statuses;
    the GPU is freed then, whether or not the pod's cgroup is still there."""
    cluster = SimCluster(tmp_path / "node", spec_one_gpu(tmp_path / "spec.json"), status_lag=0.0)
    with cluster:
        first = cluster.run_pod(gpu_pod("first", [("main", 100, 0)]))
        cluster.wait_status(first)
        wait_agent_matches(cluster, [first])
        cluster.slow_stop(first)  # its cgroup stays
        cluster.delete(first, wait=True)
        assert _wait_log(cluster, _released(first), "was removed while") == _released(first)
        wait_agent_matches(cluster, [])
