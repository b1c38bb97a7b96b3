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


def _check_b(c: SimCluster, run_a: PodRun, run_b: PodRun) -> None:
    """b holds what its answer named, nothing else holds it, nothing of a is back."""
    answer = run_b.core["main"].response
    mapping = _mapping(c)
    assert run_a.uid not in mapping, f"a's allocation came back: {mapping}"
    assert run_b.uid in mapping and "main" in mapping[run_b.uid], mapping
    entry = mapping[run_b.uid]["main"]
    assert entry["Devices"] == answer.annotations[names.VDEVICE_ANNOTATION].split(",")
    assert (entry["Cores"], entry["Memory"]) == (50, 4 * names.MEMORY_BLOCK_BYTES)
    assert sorted(entry["DeviceIDs"]) == sorted(run_b.core["main"].device_ids)
    assert tuple(entry.get("AnsweredAs") or (run_b.uid, "main")) == _answered_dir(run_b)
    assert entry.get("Started") is True
    devices = [d for per in mapping.values() for e in per.values() for d in e["Devices"]]
    # The vcuda.config b reads (the directory its answer mounts) names b, with its budget.
    pod_dir, container_dir = _answered_dir(run_b)
    config = files.unpack((c.vm_path / pod_dir / container_dir / "vcuda.config").read_bytes())
    assert (config.pod_uid, config.container_name) == (run_b.uid, "main")
    assert devices.count(entry["Devices"][0]) == 1, mapping


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
