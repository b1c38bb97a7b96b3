"""Pods asking for tencent.com/vcuda-memory without tencent.com/vcuda-core, or a share of cores without
memory: refused with a message naming the pod and the value, and nothing held for them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gpumanager import names
from simnode.cluster import SimCluster, gpu_pod
from simnode.kubelet import KubeletSimError
from tests.battery_fixtures import agent_allocated, answered, gpu, write_spec


def _cluster(tmp_path: Path) -> SimCluster:
    return SimCluster(
        tmp_path / "node", write_spec(tmp_path / "one.json", [gpu(0, memory_mib=16384)], lambda i, j: "PHB")
    )


def _checkpointed_pods(cluster: SimCluster) -> str:
    assert cluster.agent is not None
    path = cluster.agent.workdir / "checkpoint" / "gpumanager_internal_checkpoint"
    return path.read_text() if path.exists() else ""


@pytest.mark.parametrize("cores", [None, "0"], ids=["no-cores", "zero-cores"])
def test_memory_without_cores_is_refused_by_name(tmp_path: Path, cores: str | None) -> None:
    """A container asking for 8 blocks of memory and no cores would get no GPU at all (upstream answers its
    vcuda-memory Allocate with nothing and the container starts without one, its memory counted as used by
    the kubelet): the agent refuses it, naming the pod, the container and the value."""
    manifest = gpu_pod("memory-only", [("main", 0, 8)])
    if cores is not None:  # "tencent.com/vcuda-core: 0" written out: the kubelet allocates none of it
        for key in ("limits", "requests"):
            manifest["spec"]["containers"][0]["resources"][key][names.VCORE_RESOURCE] = cores
    with _cluster(tmp_path) as cluster:
        with pytest.raises(KubeletSimError) as refused:
            cluster.run_pod(manifest)
        message = str(refused.value)
        assert "default/memory-only" in message and "main" in message, message
        assert f"8 {names.VMEMORY_RESOURCE}" in message and names.VCORE_RESOURCE in message, message
        assert all(v == (0, 0) for v in agent_allocated(cluster).values())
        assert "memory-only" not in _checkpointed_pods(cluster)
        # The node serves the next pod as before.
        ok = cluster.run_pod(gpu_pod("share", [("main", 50, 8)]))
        assert answered(ok)["main"][0] == (0,)


def test_a_share_of_cores_without_memory_is_refused_by_name(tmp_path: Path) -> None:
    with _cluster(tmp_path) as cluster:
        with pytest.raises(KubeletSimError) as refused:
            cluster.run_pod(gpu_pod("cores-only", [("main", 50, 0)]))
        message = str(refused.value)
        assert "default/cores-only" in message and "main" in message, message
        assert f"{names.VMEMORY_RESOURCE} > 0" in message and "50" in message, message
        assert all(v == (0, 0) for v in agent_allocated(cluster).values())
        assert "cores-only" not in _checkpointed_pods(cluster)


def test_a_whole_gpu_without_memory_is_served(tmp_path: Path) -> None:
    """100 cores without memory is a whole GPU (upstream's rule): its memory is the GPU's."""
    with _cluster(tmp_path) as cluster:
        run = cluster.run_pod(gpu_pod("whole", [("main", 100, 0)]))
        assert answered(run)["main"][0] == (0,)
        assert json.loads(_checkpointed_pods(cluster) or "{}") != {}


def test_memory_only_beside_a_gpu_container_of_the_same_pod_is_refused(tmp_path: Path) -> None:
    """A pod whose second container asks memory alone: refused, its first container's share not leaked."""
    with _cluster(tmp_path) as cluster:
        with pytest.raises(KubeletSimError) as refused:
            cluster.run_pod(gpu_pod("mixed", [("gpu", 50, 8), ("side", 0, 4)]))
        message = str(refused.value)
        assert "default/mixed" in message and "side" in message, message
        deadline = time.monotonic() + 30
        while any(v != (0, 0) for v in agent_allocated(cluster).values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(v == (0, 0) for v in agent_allocated(cluster).values()), agent_allocated(cluster)


def test_the_extender_does_not_place_memory_without_cores() -> None:
    """The scheduler extender refuses such a pod on every node as unresolvable (it would be placed only to
    fail its admission on the node), naming the container and the value; a pod asking for both passes."""
    from gpumanager.extender.api import parse_args
    from gpumanager.extender.decisions import Decider
    from gpumanager.extender.state import ClusterState

    def pod(limits: dict[str, str]) -> dict[str, object]:
        return {
            "metadata": {"name": "p", "namespace": "d", "uid": "u1"},
            "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]},
        }

    decider = Decider(ClusterState(), "binpack")
    body = json.dumps({"Pod": pod({names.VMEMORY_RESOURCE: "8"}), "NodeNames": ["a", "b"]}).encode()
    result, _ = decider.filter(parse_args(body))
    reasons = result["FailedAndUnresolvableNodes"]
    assert set(reasons) == {"a", "b"}
    assert "container 'c'" in reasons["a"] and f"8 {names.VMEMORY_RESOURCE} without" in reasons["a"], reasons
    zero = json.dumps({"Pod": pod({names.VMEMORY_RESOURCE: "8", names.VCORE_RESOURCE: "0"}), "NodeNames": ["a"]})
    result, _ = decider.filter(parse_args(zero.encode()))
    assert "a" in result["FailedAndUnresolvableNodes"]


@pytest.mark.parametrize("cores", [None, "0"], ids=["no-cores", "zero-cores"])
def test_memory_without_cores_is_refused_behind_a_lagging_watch(tmp_path: Path, cores: str | None) -> None:
    """The kubelet admits a pod as soon as its own watch shows it; ours may not show it yet, through the
    Allocate and the start both. The container asking for memory alone is still refused, by name (at its
    start: the Allocate, which carries only IDs, cannot tell whose it is without a list of the pods)."""
    manifest = gpu_pod("memory-only", [("main", 0, 8)])
    if cores is not None:
        for key in ("limits", "requests"):
            manifest["spec"]["containers"][0]["resources"][key][names.VCORE_RESOURCE] = cores
    with _cluster(tmp_path) as cluster:
        cluster.api.hold_watches(True)  # the agent's pod cache does not see the pod
        try:
            with pytest.raises(KubeletSimError) as refused:
                cluster.run_pod(manifest)
            message = str(refused.value)
            assert "default/memory-only" in message and "main" in message, message
            assert f"8 {names.VMEMORY_RESOURCE}" in message and names.VCORE_RESOURCE in message, message
            # A share asking as much memory, behind the same lagging watch, starts.
            ok = cluster.run_pod(gpu_pod("share", [("main", 50, 8)]))
            assert answered(ok)["main"][0] == (0,)
        finally:
            cluster.api.hold_watches(False)
        assert "memory-only" not in _checkpointed_pods(cluster)
