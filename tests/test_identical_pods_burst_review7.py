"""Identical pods admitted and started at once: each container mounts a pod directory of its own."""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumanager import names
from gpumanager.allocation.allocator import Allocator
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.allocation.response import ContainerResponse
from gpumanager.api import vcuda_pb2 as pb
from gpumanager.vmanager import files
from gpumanager.vmanager.manager import VirtualManager
from simnode.cluster import PodRun, SimCluster, gpu_pod
from simnode.mounts import host_path
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path) -> Iterator[SimCluster]:
    c = SimCluster(tmp_path, "h100-nvlink-x8", agent_flags=["--allocation-check-period=30"])
    c.start()
    yield c
    c.stop()


def test_identical_pods_started_together_each_mount_their_own_directory(cluster: SimCluster) -> None:
    manifests = [cluster.create(gpu_pod(f"same-{i}", [("main", 3, 2)])) for i in range(10)]
    time.sleep(1.0)  # the agent's pod cache sees them
    go = threading.Event()
    runs: list[PodRun] = []
    lock = threading.Lock()

    def one(manifest: dict[str, object]) -> None:
        go.wait()
        run = cluster.admit(manifest, create=False)
        cluster.kubelet.pre_start(names.VCORE_RESOURCE, pod_uid=run.uid, container_name="main")
        with lock:
            runs.append(run)

    threads = [threading.Thread(target=one, args=(m,)) for m in manifests]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(60)
    assert len(runs) == 10
    mounted = collections.Counter(
        m.host_path
        for run in runs
        for m in run.core["main"].response.mounts
        if m.container_path == names.VCUDA_MOUNTPOINT
    )
    shared = {path: n for path, n in mounted.items() if n > 1}
    assert not shared, f"pod directories mounted by more than one container: {shared}"
    # The vcuda.config each container reads (its mount, VCUDA_CONFIG_PATH below it) was written for it.
    for run in runs:
        response = run.core["main"].response
        config = files.unpack(host_path(response.mounts, response.envs[names.VCUDA_CONFIG_ENV]).read_bytes())
        assert (config.pod_uid, config.container_name) == (run.uid, "main")


# -- the allocator alone: which directory each answer names ---------------------------------------------------------


def _vcuda_mount(response: ContainerResponse) -> str:
    return next(m.host_path for m in response.mounts if m.container_path == names.VCUDA_MOUNTPOINT)


def _answers_are_distinct(alloc: Allocator) -> None:
    held = alloc.allocations()
    answered = [a.answered for a in held]
    assert len(set(answered)) == len(answered), f"answers shared: {[(a.key, a.answered) for a in held]}"


def _identical(*pod_names: str, container: str = "main") -> FakePods:
    return FakePods(
        [make_pod(n, [(container, 50, 4)], created=f"2026-11-21T10:00:0{i}Z") for i, n in enumerate(pod_names)]
    )


def test_a_pod_whose_answer_another_pod_took_over_is_answered_with_that_pods_directory(tmp_path: Path) -> None:
    alloc = make_allocator(tmp_path, _identical("a", "b"))
    first, second = core_ids(0, 50), core_ids(1, 50)
    first_answer = alloc.allocate(first)  # matched to a, the first in line: a guess
    assert _vcuda_mount(first_answer) == f"/etc/gpu-manager/vm/{uid_of('a')}"
    alloc.pre_start(first, (uid_of("b"), "main"))  # the kubelet gave them to b, which has no allocation yet
    taken = alloc.get(uid_of("b"), "main")
    assert taken is not None and taken.answered == (uid_of("a"), "main"), "b mounts what the answer named"
    second_answer = alloc.allocate(second)  # a is still first in line
    assert _vcuda_mount(second_answer) != _vcuda_mount(first_answer)
    assert _vcuda_mount(second_answer) == f"/etc/gpu-manager/vm/{uid_of('b')}", "b's own directory, unused"
    assert second_answer.envs[names.VCUDA_CONFIG_ENV] == f"{names.VCUDA_MOUNTPOINT}/main/{names.VCUDA_CONFIG_FILE}"
    started = alloc.pre_start(second, (uid_of("a"), "main"))
    assert started.key == (uid_of("a"), "main") and started.answered == (uid_of("b"), "main")
    _answers_are_distinct(alloc)


def test_a_chain_of_take_overs_still_answers_each_container_with_a_directory_of_its_own(tmp_path: Path) -> None:
    alloc = make_allocator(tmp_path, _identical("a", "b", "c", "d"))
    mounts = []
    # The kubelet starts d, c, b, then a, while every Allocate matches the first pod in line.
    for gpu, owner in enumerate(["d", "c", "b", "a"]):
        ids = core_ids(gpu, 50)
        mounts.append(_vcuda_mount(alloc.allocate(ids)))
        assert alloc.pre_start(ids, (uid_of(owner), "main")).pod_uid == uid_of(owner)
        _answers_are_distinct(alloc)
    assert len(set(mounts)) == 4, mounts
    assert sorted(mounts) == sorted(_vcuda_mount(alloc.response_of(*a.key)) for a in alloc.allocations())  # type: ignore[arg-type]


def test_the_other_directory_survives_a_restart_before_and_after_the_next_allocate(tmp_path: Path) -> None:
    pods = _identical("a", "b")
    first, second = core_ids(0, 50), core_ids(1, 50)
    before = make_allocator(tmp_path, pods)
    first_answer = before.allocate(first)
    before.pre_start(first, (uid_of("b"), "main"))
    before.close()
    # Restarted after b took a's answer over, before a's Allocate: the checkpoint tells whose directory b mounts.
    middle = make_allocator(tmp_path, pods)
    middle.load()
    second_answer = middle.allocate(second)
    assert _vcuda_mount(second_answer) != _vcuda_mount(first_answer)
    middle.close()
    # Restarted once more before a starts: a's record still names the directory its answer mounted.
    after = make_allocator(tmp_path, pods)
    after.load()
    a_rec = after.get(uid_of("a"), "main")
    assert a_rec is not None and a_rec.answered == (uid_of("b"), "main")
    assert _vcuda_mount(after.response_of(uid_of("a"), "main")) == _vcuda_mount(second_answer)  # type: ignore[arg-type]
    assert after.pre_start(second, (uid_of("a"), "main")).answered == (uid_of("b"), "main")
    _answers_are_distinct(after)


def test_the_other_directorys_config_path_names_its_container(tmp_path: Path) -> None:
    """Identical requests in containers of other names: the answer's VCUDA_CONFIG_PATH names the
    container directory the agent writes, the one of the answer's directory."""
    pods = FakePods(
        [
            make_pod("a", [("x", 50, 4)], created="2026-11-21T10:00:00Z"),
            make_pod("b", [("y", 50, 4)], created="2026-11-21T10:00:01Z"),
        ]
    )
    alloc = make_allocator(tmp_path, pods)
    first, second = core_ids(0, 50), core_ids(1, 50)
    alloc.allocate(first)  # a's x
    alloc.pre_start(first, (uid_of("b"), "y"))
    second_answer = alloc.allocate(second)  # a's x again
    a_rec = alloc.get(uid_of("a"), "x")
    assert a_rec is not None and a_rec.answered == (uid_of("b"), "y")
    assert _vcuda_mount(second_answer) == f"/etc/gpu-manager/vm/{uid_of('b')}"
    assert second_answer.envs[names.VCUDA_CONFIG_ENV] == f"{names.VCUDA_MOUNTPOINT}/y/{names.VCUDA_CONFIG_FILE}"


# -- the pod sockets: each container registers where its answer's directory is --------------------------------------


def _pod(uid: str, container: str, cid: str) -> dict[str, object]:
    return {
        "metadata": {"uid": uid, "name": f"p-{uid[:4]}", "namespace": "default"},
        "spec": {"containers": [{"name": container}]},
        "status": {
            "phase": "Running",
            "qosClass": "Guaranteed",
            "containerStatuses": [{"name": container, "containerID": f"containerd://{cid}"}],
        },
    }


def test_a_container_answered_with_the_taker_s_directory_registers_on_that_directory_s_socket(
    tmp_path: Path,
) -> None:
    """b took a's first answer (it mounts a's directory); a was answered with b's: each registers on the
    socket of the directory it mounts and its files are written there, in the answer's container directory."""
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    short = Path(tempfile.mkdtemp(prefix="vmi", dir="/tmp"))  # a vcuda.sock path must fit a unix address
    pods = {a: _pod(a, "x", "a" * 64), b: _pod(b, "y", "b" * 64)}
    allocs = {
        (b, "y"): ContainerAllocation(b, "y", (0,), 50, 1 << 30, answered_as=(a, "x"), started=True),
        (a, "x"): ContainerAllocation(a, "x", (1,), 50, 1 << 30, answered_as=(b, "y"), started=True),
    }
    for uid, cid in ((a, "a" * 64), (b, "b" * 64)):  # cgroupfs container cgroups holding a process (ours)
        leaf = tmp_path / "cg" / "kubepods" / f"pod{uid}" / cid
        leaf.mkdir(parents=True)
        (leaf / "cgroup.procs").write_text(f"{os.getpid()}\n")
    vm = VirtualManager(
        vm_path=short / "vm",
        cgroup_root=tmp_path / "cg",
        allocation=lambda u, c: allocs.get((u, c)),
        pod=pods.get,
        driver_version="550.54.15",
    )
    try:
        for each in allocs.values():
            vm.prepare(each)
        for uid, name, socket_pod, subdir in ((a, "x", b, "y"), (b, "y", a, "x")):
            written = vm.register(socket_pod, pb.VDeviceRequest(pod_uid=uid, container_name=name), time_left=1.0)
            assert written == short / "vm" / "configs" / socket_pod / subdir
            config = files.unpack((written / names.VCUDA_CONFIG_FILE).read_bytes())
            assert (config.pod_uid, config.container_name) == (uid, name)
            assert (written / names.PIDS_CONFIG_FILE).exists()
        # Only b mounts a's directory: a registration there by the name of that directory is b's.
        written = vm.register(a, pb.VDeviceRequest(pod_uid=a, container_name="x"), time_left=1.0)
        assert written == short / "vm" / "configs" / a / "x"
        config = files.unpack((written / names.VCUDA_CONFIG_FILE).read_bytes())
        assert (config.pod_uid, config.container_name) == (b, "y")
    finally:
        vm.stop()
        shutil.rmtree(short, ignore_errors=True)
