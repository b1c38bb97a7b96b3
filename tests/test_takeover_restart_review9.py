"""A take-over of a deleted identical pod's allocation across agent restarts and crashes.

The kubelet's Allocate carries only device IDs: with identical pods a and b waiting, a first in line, the
kubelet admits b and its IDs are matched to a. When a is deleted before b starts, b's PreStartContainer takes
over the allocation made for a (its GPUs and the directory its answer named). An agent restart, or a crash,
between any two of those steps must leave b with the GPUs, the budget and the directory its answer named, hand
no GPU to two pods and bring nothing of a back."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from gpumanager import names
from gpumanager.allocation.journal import read_document
from gpumanager.vmanager import files
from simnode.cluster import PodRun, SimCluster, gpu_pod
from simnode.kubelet import KubeletSimError

CORE = names.VCORE_RESOURCE


@pytest.fixture(params=[True, False], ids=["kubelet-checkpoint", "no-kubelet-checkpoint"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path, sim_built: Path) -> Iterator[SimCluster]:
    c = SimCluster(
        tmp_path, "v100-pcie-x4", agent_flags=["--allocation-check-period=1"], kubelet_checkpoint=request.param
    )
    c.start()
    yield c
    c.stop()


def _mapping(c: SimCluster) -> dict[str, Any]:
    document = read_document(c.checkpoint_dir / names.OWN_CHECKPOINT) or {}
    return dict(document.get("PodGPUMapping") or {})


def _wait_until(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _answered_dir(run: PodRun) -> tuple[str, str]:
    """The (pod UID, container) directory b's answer mounts: its /etc/vcuda mount and VCUDA_CONFIG_PATH."""
    response = run.core["main"].response
    mount = next(m.host_path for m in response.mounts if m.container_path == names.VCUDA_MOUNTPOINT)
    config = PurePosixPath(response.envs[names.VCUDA_CONFIG_ENV])
    return (PurePosixPath(mount).name, config.parent.name)


def _restart(c: SimCluster, how: str, env: dict[str, str] | None = None) -> None:
    agent = c.agent
    assert agent is not None
    if how == "kill":
        agent.signal(signal.SIGKILL)
        agent.wait(20)
    elif agent.proc is not None and agent.proc.poll() is None:
        assert agent.stop() == 0
    c.start_agent(env=env)


def _admit_b_matched_to_a(c: SimCluster) -> tuple[PodRun, PodRun]:
    """a and b wait with the same request, a first in line; the kubelet admits b: its IDs are matched to a."""
    a = c.create(gpu_pod("a", [("main", 50, 4)]))
    b = c.create(gpu_pod("b", [("main", 50, 4)]))  # same creation second or later: a is first ("a" < "b")
    time.sleep(1.0)  # the agent's pod cache sees both
    run_b = c.admit(b, create=False)
    run_a = c.runs[a["metadata"]["uid"]]
    assert _answered_dir(run_b)[0] == run_a.uid, "b's IDs matched to a, first in line"
    assert run_a.uid in _mapping(c)
    return run_a, run_b


def _delete_a(c: SimCluster, run_a: PodRun) -> None:
    c.delete(run_a, wait=True)
    _wait_until(lambda: run_a.uid not in _mapping(c), "a's allocation to be freed")


def _check_b(c: SimCluster, run_a: PodRun, run_b: PodRun, *, rebuilt: bool = False) -> None:
    """b holds what its answer named, nothing else holds it, nothing of a is back. ``rebuilt``: from the
    kubelet's PodResources alone, which does not say that b has started."""
    answer = run_b.core["main"].response
    mapping = _mapping(c)
    assert run_a.uid not in mapping, f"a's allocation came back: {mapping}"
    assert run_b.uid in mapping and "main" in mapping[run_b.uid], mapping
    entry = mapping[run_b.uid]["main"]
    assert entry["Devices"] == answer.annotations[names.VDEVICE_ANNOTATION].split(",")
    assert (entry["Cores"], entry["Memory"]) == (50, 4 * names.MEMORY_BLOCK_BYTES)
    assert sorted(entry["DeviceIDs"]) == sorted(run_b.core["main"].device_ids)
    assert tuple(entry.get("AnsweredAs") or (run_b.uid, "main")) == _answered_dir(run_b)
    assert entry.get("Started") is (None if rebuilt else True)
    # No other record holds b's IDs or b's directory, and the GPU is charged for what its holders ask.
    others = [
        (uid, name, e) for uid, per in mapping.items() for name, e in per.items() if (uid, name) != (run_b.uid, "main")
    ]
    assert not [o for o in others if set(o[2].get("DeviceIDs") or ()) & set(entry["DeviceIDs"])], mapping
    assert not [o for o in others if tuple(o[2].get("AnsweredAs") or (o[0], o[1])) == _answered_dir(run_b)], mapping
    on_gpu = [e for _, _, e in others if e["Devices"] == entry["Devices"]]
    assert sum(e["Cores"] for e in on_gpu) + entry["Cores"] <= 100, mapping
    # The vcuda.config b reads (the directory its answer mounts) names b, with its budget.
    pod_dir, container_dir = _answered_dir(run_b)
    config = files.unpack((c.vm_path / "configs" / pod_dir / container_dir / "vcuda.config").read_bytes())
    assert (config.pod_uid, config.container_name) == (run_b.uid, "main")


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_restart_between_the_deletion_and_the_start_still_starts_b_with_its_answer(
    cluster: SimCluster, how: str
) -> None:
    run_a, run_b = _admit_b_matched_to_a(cluster)
    _delete_a(cluster, run_a)
    _restart(cluster, how)
    cluster.start_containers(run_b)
    _check_b(cluster, run_a, run_b)
    _restart(cluster, how)
    _check_b(cluster, run_a, run_b)


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_restart_after_the_take_over_keeps_b_as_it_started(cluster: SimCluster, how: str) -> None:
    run_a, run_b = _admit_b_matched_to_a(cluster)
    _delete_a(cluster, run_a)
    cluster.start_containers(run_b)
    _check_b(cluster, run_a, run_b)
    _restart(cluster, how)
    _check_b(cluster, run_a, run_b)


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_restart_before_the_deletion_then_b_starts(cluster: SimCluster, how: str) -> None:
    run_a, run_b = _admit_b_matched_to_a(cluster)
    _restart(cluster, how)
    _delete_a(cluster, run_a)
    cluster.start_containers(run_b)
    _check_b(cluster, run_a, run_b)
    _restart(cluster, how)
    _check_b(cluster, run_a, run_b)


def test_a_deleted_while_the_agent_is_down(cluster: SimCluster) -> None:
    run_a, run_b = _admit_b_matched_to_a(cluster)
    assert cluster.agent is not None
    cluster.agent.signal(signal.SIGKILL)
    cluster.agent.wait(20)
    cluster.delete(run_a, wait=True)
    cluster.start_agent()
    _wait_until(lambda: run_a.uid not in _mapping(cluster), "a's allocation to be freed")
    cluster.start_containers(run_b)
    _check_b(cluster, run_a, run_b)


@pytest.mark.parametrize("point", ["prestart-before-files", "prestart-after-files"])
def test_a_crash_inside_the_start_that_takes_over(cluster: SimCluster, point: str) -> None:
    """The agent dies by SIGKILL inside b's PreStartContainer that takes a's allocation over; the kubelet
    tries the start again once the agent is back."""
    run_a, run_b = _admit_b_matched_to_a(cluster)
    _delete_a(cluster, run_a)
    _restart(cluster, "stop", env={"GPU_MANAGER_CRASH_AT": point})
    with pytest.raises(KubeletSimError):
        cluster.kubelet.pre_start(CORE, pod_uid=run_b.uid, container_name="main")
    assert cluster.agent is not None and cluster.agent.wait(20) == -9
    cluster.start_agent()
    cluster.start_containers(run_b)
    _check_b(cluster, run_a, run_b)


def test_both_checkpoints_lost_after_the_take_over(cluster: SimCluster) -> None:
    """Our checkpoint and the kubelet's are both lost after b took a's allocation over: PodResources has only
    b's IDs, and the vcuda.config written for b in a's directory says which directory b mounts."""
    run_a, run_b = _admit_b_matched_to_a(cluster)
    _delete_a(cluster, run_a)
    cluster.start_containers(run_b)
    cluster.wait_annotations(run_b, {names.GPU_ASSIGNED: "true"})  # b's real GPU, as PodResources' rebuild reads
    assert cluster.agent is not None and cluster.agent.stop() == 0
    for path in cluster.checkpoint_dir.glob(f"{names.OWN_CHECKPOINT}*"):
        path.unlink()
    cluster.kubelet.checkpoint_path.unlink(missing_ok=True)
    cluster.start_agent()
    _wait_until(lambda: run_b.uid in _mapping(cluster), "b's allocation to be rebuilt")
    time.sleep(2.0)  # a pass of the pod lifecycle, which removes the directories of pods that are gone
    _check_b(cluster, run_a, run_b, rebuilt=True)


@pytest.mark.parametrize("where", ["live-pod", "own", "foreign-owner"])
def test_a_vcuda_config_in_a_directory_not_free_does_not_move_a_rebuilt_container(tmp_path: Path, where: str) -> None:
    """A rebuild from PodResources alone answers a container with the directory holding its vcuda.config only
    when that directory belongs to no one: a file naming b in the directory of a pod that still exists (a
    container there can write its own directory) leaves b with its own."""
    import os

    from gpumanager.deviceplugin.devices import DeviceLayout
    from gpumanager.kube.podresources import ContainerDevices
    from gpumanager.recovery import Recovery
    from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of, v100x4

    b, c = uid_of("b"), uid_of("c")
    pods = [make_pod("b", [("main", 50, 4)], phase="Running"), make_pod("c", [("main", 50, 4)], phase="Running")]
    gone = uid_of("gone")
    holder = c if where == "live-pod" else gone
    vm = tmp_path / "vm"
    config = vm / holder / "main" / names.VCUDA_CONFIG_FILE
    config.parent.mkdir(parents=True)
    config.write_bytes(files.pack(files.VcudaConfig(pod_uid=b, container_name="main", gpu_memory=1, utilization=50)))
    if where == "own":  # b's file in its own directory: nothing to move
        config.rename(vm / holder / "main" / "other")
        (vm / b / "main").mkdir(parents=True)
        (vm / holder / "main" / "other").rename(vm / b / "main" / names.VCUDA_CONFIG_FILE)
    alloc = make_allocator(tmp_path, FakePods(pods))
    gpus, _ = v100x4()
    try:
        if where == "foreign-owner" and os.geteuid() == 0:
            os.chown(config, 12345, 12345)
        elif where == "foreign-owner":
            pytest.skip("a file of another user can be made by root only")
        rec = Recovery(
            alloc, kubelet_checkpoint_path=tmp_path / "none", layout=DeviceLayout(gpus), gpus=gpus, vm_path=vm
        )
        rec.from_disk()
        listed = ContainerDevices("default", "b", "main", CORE, tuple(core_ids(1, 50)))
        rec.from_pod_resources(
            _answering([listed]),
            lambda ns, name: next((p for p in pods if p["metadata"]["name"] == name), None),
        )
        record = alloc.get(b, "main")
        assert record is not None and record.answered == (b, "main"), record
    finally:
        alloc.close()


def test_a_vcuda_config_in_a_gone_pods_directory_answers_a_rebuilt_container_with_it(tmp_path: Path) -> None:
    from gpumanager.deviceplugin.devices import DeviceLayout
    from gpumanager.kube.podresources import ContainerDevices
    from gpumanager.recovery import Recovery
    from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of, v100x4

    b, gone = uid_of("b"), uid_of("gone")
    pods = [make_pod("b", [("main", 50, 4)], phase="Running")]
    vm = tmp_path / "vm"
    config = vm / gone / "main" / names.VCUDA_CONFIG_FILE
    config.parent.mkdir(parents=True)
    config.write_bytes(files.pack(files.VcudaConfig(pod_uid=b, container_name="main", gpu_memory=1, utilization=50)))
    alloc = make_allocator(tmp_path, FakePods(pods))
    gpus, _ = v100x4()
    try:
        rec = Recovery(
            alloc, kubelet_checkpoint_path=tmp_path / "none", layout=DeviceLayout(gpus), gpus=gpus, vm_path=vm
        )
        rec.from_disk()
        listed = ContainerDevices("default", "b", "main", CORE, tuple(core_ids(1, 50)))
        rec.from_pod_resources(_answering([listed]), lambda ns, name: pods[0] if name == "b" else None)
        record = alloc.get(b, "main")
        assert record is not None and record.answered == (gone, "main"), record
    finally:
        alloc.close()


class _FixedPodResources:
    """A PodResources client whose kubelet answers with ``entries``."""

    def __init__(self, entries: list[Any]) -> None:
        self.entries = entries

    def list_all(self) -> list[Any]:
        return list(self.entries)


def _answering(entries: list[Any]) -> Any:
    """A PodResources client (duck-typed) answering ``entries``."""
    return _FixedPodResources(entries)


def test_a_restart_before_the_start_does_not_charge_the_gpu_twice(tmp_path: Path, sim_built: Path) -> None:
    """One GPU; b's IDs were matched to a (first in line), and the agent restarts before b starts. The
    kubelet's records say b holds those IDs: b takes over the allocation made for a instead of being rebuilt
    beside it (the GPU charged for both, 100 cores for one share), and c's share still fits."""
    from tests.battery_fixtures import gpu, write_spec

    spec = write_spec(tmp_path / "one.json", [gpu(0, memory_mib=16384)], lambda i, j: "PHB")
    with SimCluster(tmp_path / "node", spec) as c:
        run_a, run_b = _admit_b_matched_to_a(c)
        _restart(c, "kill")
        mapping = _mapping(c)
        assert list(mapping) == [run_b.uid], mapping
        c.run_pod(gpu_pod("c", [("main", 50, 4)]))  # refused before: GPU 0 charged 100 cores
        c.start_containers(run_b)
        _check_b(c, run_a, run_b)
