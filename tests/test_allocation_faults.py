"""Crashes, restarts and broken records: no allocation is lost or doubled, and the agent agrees with the kubelet."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumanager import names
from gpumanager.allocation.journal import read_document
from simnode.cluster import PodRun, SimCluster, gpu_pod
from simnode.kubelet import KubeletSimError

CORE = names.VCORE_RESOURCE


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path) -> Iterator[SimCluster]:
    c = SimCluster(tmp_path, "v100-pcie-x4", agent_flags=["--allocation-check-period=1"])
    c.start()
    yield c
    c.stop()


def ours(c: SimCluster) -> dict[tuple[str, str], list[str]]:
    document = read_document(c.checkpoint_dir / names.OWN_CHECKPOINT)
    data = (document or {}).get("PodGPUMapping") or {}
    return {(uid, cname): entry["Devices"] for uid, per in data.items() for cname, entry in per.items()}


def kubelets(c: SimCluster) -> dict[tuple[str, str], list[str]]:
    """The kubelet's view: the devices its stored Allocate answers name."""
    return {
        (r.pod_uid, r.container_name): r.response.annotations[names.VDEVICE_ANNOTATION].split(",")
        for r in c.kubelet.allocations()
        if r.resource == CORE
    }


def wait_until(predicate: object, timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def restart_agent(c: SimCluster, **env: str) -> None:
    assert c.agent is not None
    if c.agent.proc is not None and c.agent.proc.poll() is None:
        c.agent.stop()
    c.start_agent(env=env)


def fail_pod(c: SimCluster, run: PodRun) -> None:
    """What the kubelet does when admission fails: the pod is Failed for good."""
    c.api.set_pod_phase(run.namespace, run.name, "Failed", reason="UnexpectedAdmissionError")
    c.kubelet.remove_pod(run.uid)


def test_clean_restart_keeps_every_allocation(cluster: SimCluster) -> None:
    runs = [cluster.run_pod(gpu_pod(f"s{i}", [("c", 40, 4)])) for i in range(3)]
    runs.append(cluster.run_pod(gpu_pod("whole", [("c", 100, 0)])))
    before = ours(cluster)
    restart_agent(cluster)
    assert ours(cluster) == before == kubelets(cluster)
    # Nothing is handed out twice after the restart: the one free whole GPU goes, then none is left.
    cluster.run_pod(gpu_pod("another", [("c", 100, 0)]))
    with pytest.raises(KubeletSimError):
        cluster.admit(gpu_pod("toomany", [("c", 200, 0)]))
    devices = [d for devs in ours(cluster).values() for d in devs]
    assert devices.count("/dev/nvidia0") + devices.count("/dev/nvidia1") + devices.count(
        "/dev/nvidia2"
    ) + devices.count("/dev/nvidia3") == len(devices)


@pytest.mark.parametrize("point", ["allocate-before-checkpoint", "allocate-after-checkpoint"])
def test_crash_inside_allocate(cluster: SimCluster, point: str) -> None:
    keep = cluster.run_pod(gpu_pod("keep", [("c", 100, 0)]))
    restart_agent(cluster, GPU_MANAGER_CRASH_AT=point)
    assert cluster.agent is not None
    victim = gpu_pod("victim", [("c", 100, 0)])
    with pytest.raises(KubeletSimError):
        cluster.admit(victim)
    assert cluster.agent.wait(10) == -9
    run = next(r for r in cluster.runs.values() if r.name == "victim")
    fail_pod(cluster, run)
    restart_agent(cluster)
    # The kubelet never got an answer: the victim holds nothing once the agent has caught up.
    wait_until(lambda: ours(cluster) == kubelets(cluster), what="agent and kubelet to agree")
    assert (keep.uid, "c") in ours(cluster)
    for i in range(3):
        cluster.run_pod(gpu_pod(f"after{i}", [("c", 100, 0)]))
    assert sorted(d for devs in ours(cluster).values() for d in devs) == [f"/dev/nvidia{i}" for i in range(4)]


@pytest.mark.parametrize("point", ["prestart-before-files", "prestart-after-files"])
def test_crash_inside_prestart_then_the_kubelet_retries(cluster: SimCluster, point: str) -> None:
    restart_agent(cluster, GPU_MANAGER_CRASH_AT=point)
    run = cluster.admit(gpu_pod("starting", [("c", 30, 4)]))
    with pytest.raises(KubeletSimError):
        cluster.kubelet.pre_start(CORE, pod_uid=run.uid, container_name="c")
    assert cluster.agent is not None and cluster.agent.wait(10) == -9
    restart_agent(cluster)
    cluster.start_containers(run)  # the kubelet starts the container again: PreStart succeeds
    assert ours(cluster) == kubelets(cluster)
    assert (cluster.vm_path / "configs" / run.uid / "c" / "vcuda.config").stat().st_size == 8240
    cluster.wait_annotations(run, {"tencent.com/gpu-assigned": "true"})


@pytest.mark.parametrize("damage", ["corrupt", "missing", "wrong-shape"])
def test_broken_checkpoint_is_rebuilt_from_the_kubelet(cluster: SimCluster, damage: str) -> None:
    runs = [cluster.run_pod(gpu_pod("share", [("c", 30, 4)])), cluster.run_pod(gpu_pod("pair", [("c", 200, 0)]))]
    before = ours(cluster)
    assert cluster.agent is not None
    cluster.agent.stop()
    path = cluster.checkpoint_dir / names.OWN_CHECKPOINT
    if damage == "corrupt":
        path.write_bytes(b'{"PodGPUMapping": {"x"')
    elif damage == "missing":
        path.unlink()
    else:
        path.write_text('["not", "an", "object"]')
    restart_agent(cluster)
    assert ours(cluster) == before
    assert cluster.agent is not None
    assert "rebuilt 2 container allocations from the kubelet" in cluster.agent.log_text()
    if damage != "missing":
        assert list(cluster.checkpoint_dir.glob(f"{names.OWN_CHECKPOINT}.corrupt-*"))
    with pytest.raises(KubeletSimError):
        cluster.admit(gpu_pod("overbook", [("c", 300, 0)]))
    del runs


def test_released_after_restart_when_pod_ended_while_down(cluster: SimCluster) -> None:
    run = cluster.run_pod(gpu_pod("ends", [("c", 100, 0)]))
    assert cluster.agent is not None
    cluster.agent.stop()
    cluster.delete(run)
    restart_agent(cluster)
    wait_until(lambda: (run.uid, "c") not in ours(cluster), what="release of a pod deleted while the agent was down")
    wait_until(lambda: not (cluster.vm_path / run.uid).exists(), what="its directory to go")


def test_kubelet_restart_with_running_pods(cluster: SimCluster) -> None:
    run = cluster.run_pod(gpu_pod("steady", [("c", 50, 4)]))
    before = ours(cluster)
    counts = {r: cluster.kubelet.registration_count(r) for r in (CORE, names.VMEMORY_RESOURCE)}
    cluster.kubelet.restart()
    for resource, count in counts.items():  # both: PreStart goes to each resource's plugin
        cluster.kubelet.wait_for_registration(resource, after=count, timeout=10, with_devices=True)
    cluster.start_containers(run)  # containers restart after a kubelet restart: PreStart again
    assert ours(cluster) == before
