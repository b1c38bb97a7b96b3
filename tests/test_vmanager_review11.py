"""Attacks on the virtual manager: registrations, limit files, cgroups, clean-up."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumanager.allocation.claims import ClaimAllocation, ClaimDevice
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.api import vcuda_pb2 as pb
from gpumanager.vmanager import cgroups, claims, files
from gpumanager.vmanager.manager import RegistrationRefused, VirtualManager

UID = "0b7c6a1e-1111-4222-8333-944455556666"
ID_WORKER = "a" * 64
GIB = 1 << 30


def _pod(statuses: dict[str, str]) -> dict[str, Any]:
    def container(name: str) -> dict[str, Any]:
        return {
            "name": name,
            "resources": {"limits": {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "4"}},
        }

    return {
        "metadata": {"uid": UID, "name": "p", "namespace": "ns"},
        "spec": {"containers": [container("worker"), container("gpu-main")]},
        "status": {
            "qosClass": "BestEffort",
            "phase": "Running",
            "containerStatuses": [
                {"name": n, "containerID": f"containerd://{cid}", "state": {"running": {}}}
                for n, cid in statuses.items()
            ],
        },
    }


def _alloc(name: str) -> ContainerAllocation:
    return ContainerAllocation(pod_uid=UID, container=name, minors=(0,), cores=50, memory=GIB, namespace="ns")


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[VirtualManager, Path, dict[str, Any]]]:
    cg = tmp_path / "cgroup"
    state: dict[str, Any] = {"pod": _pod({"worker": ID_WORKER})}
    allocs = {(UID, "worker"): _alloc("worker"), (UID, "gpu-main"): _alloc("gpu-main")}
    vm = VirtualManager(
        vm_path=tmp_path / "vm",
        cgroup_root=cg,
        allocation=lambda uid, name: allocs.get((uid, name)),
        pod=lambda uid: state["pod"] if uid == UID else None,
        driver_version="550.54.15",
    )
    state["allocs"] = list(allocs.values())
    try:
        yield vm, cg, state
    finally:
        vm.stop()


def _claim(uid: str) -> ClaimAllocation:
    def share(request: str, share_id: str) -> ClaimDevice:
        return ClaimDevice(request, "node", "gpu-0", 0, share_id, 20, GIB, False)

    return ClaimAllocation(uid, "ns", "c", (share("a", "s1"), share("b", "s2")))


def _procs(directory: Path, *pids: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))


def test_registration_by_an_id_that_is_a_container_name_never_touches_that_containers_directory(
    world: tuple[VirtualManager, Path, dict[str, Any]],
) -> None:
    """A process that can make a cgroup below its own (a container with a writable cgroup) names it after a
    sibling container that has not started yet, and registers by that "ID": the pod directory's entry of
    that name is the sibling's mount point (its limit files for an earlier version's answer). It must not
    get the caller's PIDs, nor be removed once the made-up cgroup is gone."""
    vm, cg, state = world
    pod_cg = cg / "kubepods" / "besteffort" / f"pod{UID}"
    _procs(pod_cg / ID_WORKER, 100)
    vm.prepare_ahead(UID, ["worker", "gpu-main"])
    vm.prepare(_alloc("worker"))
    mount_point = vm.pod_dir(UID) / "gpu-main"
    assert mount_point.is_dir()
    _procs(pod_cg / ID_WORKER / "gpu-main", 4242)  # made by the worker's process
    with pytest.raises(RegistrationRefused, match="gpu-main"):
        vm.register(UID, pb.VDeviceRequest(container_id="gpu-main"), time_left=1.0)
    assert not (mount_point / "pids.config").exists()
    (pod_cg / ID_WORKER / "gpu-main" / "cgroup.procs").unlink()
    (pod_cg / ID_WORKER / "gpu-main").rmdir()
    vm.refresh_pids(state["allocs"])
    assert mount_point.is_dir(), "the sibling's mount point was removed"


def test_a_pod_removed_while_its_registration_writes_gets_no_directory_made_again(
    world: tuple[VirtualManager, Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pod goes (its directories removed) while a registration by container ID is between its
    pids.config and its vcuda.config: the registration is refused, and no directory of the pod is made
    again (only the periodic clean-up would find it, a period later)."""
    vm, cg, _state = world
    pod_cg = cg / "kubepods" / "besteffort" / f"pod{UID}"
    _procs(pod_cg / ID_WORKER, 100)
    vm.prepare_ahead(UID, ["worker", "gpu-main"])
    vm.prepare(_alloc("worker"))
    real = files.write_pids

    def write_then_pod_gone(path: Path, pids: Any, **kwargs: Any) -> list[int]:
        written = real(path, pids, **kwargs)
        vm.gc([], only=[UID])
        return written

    monkeypatch.setattr(files, "write_pids", write_then_pod_gone)
    with pytest.raises(RegistrationRefused, match="gone"):
        vm.register(UID, pb.VDeviceRequest(container_id=ID_WORKER), time_left=1.0)
    leftovers = [str(p) for p in vm.vm_path.rglob("*")]
    assert leftovers == [] or all(UID not in p for p in leftovers), leftovers
    assert not vm.has_registered_ids()


@pytest.fixture
def strict_umask() -> Iterator[None]:
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def test_directories_a_container_reads_are_open_to_any_user_whatever_the_agents_umask(
    world: tuple[VirtualManager, Path, dict[str, Any]], strict_umask: None
) -> None:
    """An agent started with umask 077 (a hardened host's service, an image's default): the pod's directory
    (mounted at /etc/vcuda, holding vcuda.sock), the container's own directory and a registration's
    directory are made 0755, so a container running as another user than root reaches its limit files
    and its socket."""
    vm, cg, _state = world
    _procs(cg / "kubepods" / "besteffort" / f"pod{UID}" / ID_WORKER, 100)
    vm.prepare_ahead(UID, ["worker", "gpu-main"])
    vm.prepare(_alloc("worker"))
    vm.register(UID, pb.VDeviceRequest(container_id=ID_WORKER), time_left=1.0)
    claim = vm.vm_path / "0c1a1e2e-3333-4444-8555-966677778888"
    claims.write_config(vm.vm_path, _claim(claim.name), "550.54.15")
    made = [
        vm.vm_path,
        vm.pod_dir(UID),
        vm.pod_dir(UID) / "worker",
        vm.pod_dir(UID) / "gpu-main",
        vm.pod_dir(UID) / ID_WORKER,
        vm.configs_path,
        vm.configs_path / UID,
        vm.own_dir(UID, "worker"),
        vm.own_dir(UID, "gpu-main"),
        claim,
        claim / "request-a",
    ]
    modes = {str(p.relative_to(vm.vm_path.parent)): oct(stat.S_IMODE(p.stat().st_mode)) for p in made}
    assert all(m == "0o755" for m in modes.values()), modes


def test_processes_outside_the_agents_pid_namespace_are_no_pids_and_are_reported(
    world: tuple[VirtualManager, Path, dict[str, Any]],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An agent run without hostPID reads 0 in cgroup v2's cgroup.procs for each process it cannot see: a
    pids.config of zeros matches no process (the container's memory use counted as none) and a
    registration with it was answered as if it had found the container's processes. Zero is no PID: the
    registration is refused naming the cause, the file holds no zero, and the cause is logged."""
    vm, cg, state = world
    monkeypatch.setattr(cgroups, "_hidden_seen", False)  # reported once per process
    _procs(cg / "kubepods" / "besteffort" / f"pod{UID}" / ID_WORKER, 0, 0)
    vm.prepare_ahead(UID, ["worker", "gpu-main"])
    vm.prepare(_alloc("worker"))
    with pytest.raises(RegistrationRefused, match="PID namespace"):
        vm.register(UID, pb.VDeviceRequest(container_id=ID_WORKER), time_left=1.0)
    vm.refresh_pids(state["allocs"])
    written = vm.own_dir(UID, "worker") / "pids.config"
    assert 0 not in files.read_pids(written)
    assert "hostPID" in caplog.text


def test_a_pod_directory_that_cannot_be_removed_is_reported_once_not_logged_as_removed(
    world: tuple[VirtualManager, Path, dict[str, Any]],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read-only (or failing) vm directory: the directory of a pod that is gone cannot be removed. Each
    periodic clean-up said it had removed it; it is now reported as not removed, with the reason, once."""
    import errno
    import logging
    import shutil

    vm, _cg, _state = world
    vm.prepare_ahead(UID, ["worker"])
    real_rmtree = shutil.rmtree

    def read_only(path: Any, ignore_errors: bool = False, **kwargs: Any) -> None:
        if ignore_errors:
            return
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(shutil, "rmtree", read_only)
    caplog.set_level(logging.INFO, logger="gpumanager.vmanager.manager")
    assert vm.gc([]) == []
    assert vm.gc([]) == []
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    lines = [r.getMessage() for r in caplog.records]
    assert not [line for line in lines if "removed the directories" in line], lines
    failed = [line for line in lines if "cannot remove" in line]
    assert len(failed) == 1 and UID in failed[0] and "Read-only file system" in failed[0], lines
    assert vm.gc([]) == [UID]
    assert not vm.pod_dir(UID).exists()


def test_after_an_agent_restart_a_crio_registrations_pids_config_is_still_kept_current(
    tmp_path: Path, world: tuple[VirtualManager, Path, dict[str, Any]]
) -> None:
    """CRI-O with the cgroupfs driver: the library registers with the last component of its cgroup path,
    ``crio-<id>``, and reads ``/etc/vcuda/crio-<id>/pids.config``. The refresh kept that file current
    only while the agent remembered the registration: after a restart a process the container forks (it
    does not register again) was never added."""
    vm, cg, state = world
    crio = cg / "kubepods" / "besteffort" / f"pod{UID}" / f"crio-{ID_WORKER}"
    _procs(crio, 100)
    vm.prepare_ahead(UID, ["worker", "gpu-main"])
    vm.prepare(_alloc("worker"))
    vm.register(UID, pb.VDeviceRequest(pod_uid=UID, container_id=f"crio-{ID_WORKER}"), time_left=1.0)
    registered = vm.pod_dir(UID) / f"crio-{ID_WORKER}" / "pids.config"
    assert files.read_pids(registered) == [100]
    vm.stop()
    again = VirtualManager(
        vm_path=vm.vm_path,
        cgroup_root=cg,
        allocation=lambda uid, name: next((a for a in state["allocs"] if a.key == (uid, name)), None),
        pod=lambda uid: state["pod"] if uid == UID else None,
        driver_version="550.54.15",
    )
    try:
        again.resume([UID])
        _procs(crio, 100, 101)  # a process forked by the container's
        again.refresh_pids(state["allocs"])
        assert files.read_pids(registered) == [100, 101]
        assert files.read_pids(again.own_dir(UID, "worker") / "pids.config") == [100, 101]
    finally:
        again.stop()
