"""Defects of the virtual manager found by review: each test fails on the code before its fix."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from gpumanager.vmanager.manager import VirtualManager

POD = "12345678-1234-1234-1234-123456789abc"
OTHER = "87654321-4321-4321-4321-cba987654321"


def _manager(tmp_path: Path) -> VirtualManager:
    vm = tmp_path / "vm"
    vm.mkdir(exist_ok=True)
    return VirtualManager(
        vm_path=vm,
        cgroup_root=tmp_path / "cgroup",
        allocation=lambda _pod, _container: None,
        pod=lambda _uid: None,
        driver_version="550.54.15",
    )


def test_gc_removes_only_pod_directories(tmp_path: Path) -> None:
    """The periodic collection removes the directories of pods that are gone, not whatever else an
    operator or the file system keeps under --virtual-manager-path (``lost+found`` of a mounted
    volume, the agent's other directories when the path is their parent)."""
    manager = _manager(tmp_path)
    vm = manager.vm_path
    (vm / POD / "main").mkdir(parents=True)
    (vm / "configs" / POD / "main").mkdir(parents=True)  # its container's own directory
    (vm / "lost+found").mkdir()
    (vm / "checkpoint").mkdir()
    (vm / "checkpoint" / "gpumanager_internal_checkpoint").write_text("{}")
    (vm / "vdriver" / "nvidia").mkdir(parents=True)

    removed = manager.gc(active=[OTHER])

    assert removed == [POD]
    assert sorted(p.name for p in vm.iterdir()) == ["checkpoint", "configs", "lost+found", "vdriver"]
    assert list((vm / "configs").iterdir()) == []
    assert (vm / "checkpoint" / "gpumanager_internal_checkpoint").read_text() == "{}"


# -- a container ID as the upstream library reads it from a CRI-O cgroupfs path -------------------


def test_crio_cgroupfs_registration_by_the_cgroup_directory_name(tmp_path: Path) -> None:
    """Under CRI-O with the cgroupfs driver a container's cgroup is ``kubepods/pod<uid>/crio-<id>``: the
    library takes the last path component whole and registers ``--cont-id crio-<id>``, then reads
    ``/etc/vcuda/crio-<id>/``. That container is the one whose status says ``cri-o://<id>``; it is
    registered whether or not the status names it yet (it was refused once it did)."""
    import os

    from gpumanager import names
    from gpumanager.allocation.records import ContainerAllocation
    from gpumanager.api import vcuda_pb2 as pb
    from gpumanager.vmanager import files

    cid = "3f2a" * 16
    leaf = f"crio-{cid}"
    cgroup = tmp_path / "cgroup" / "kubepods" / f"pod{POD}" / leaf
    cgroup.mkdir(parents=True)
    (cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")
    (tmp_path / "cgroup" / "kubepods" / f"pod{POD}" / f"crio-conmon-{cid}").mkdir()
    pod = {
        "metadata": {"uid": POD, "name": "crio-pod", "namespace": "default"},
        "spec": {"containers": [{"name": "main"}]},
        "status": {
            "phase": "Running",
            "qosClass": "Guaranteed",
            "containerStatuses": [{"name": "main", "containerID": f"cri-o://{cid}", "state": {"running": {}}}],
        },
    }
    allocation = ContainerAllocation(pod_uid=POD, container="main", minors=(0,), cores=20, memory=1 << 30)
    vm = Path(tempfile.mkdtemp(prefix="vmr", dir="/tmp")) / "vm"
    (vm / POD).mkdir(parents=True)  # made with its vcuda.sock, which the registration comes in on
    manager = VirtualManager(
        vm_path=vm,
        cgroup_root=tmp_path / "cgroup",
        allocation=lambda u, c: allocation if (u, c) == (POD, "main") else None,
        pod=lambda u: pod if u == POD else None,
        driver_version="550.54.15",
    )
    try:
        directory = manager.register(POD, pb.VDeviceRequest(pod_uid=POD, container_id=leaf), time_left=1.0)
        assert directory == vm / POD / leaf
        assert files.read_pids(directory / names.PIDS_CONFIG_FILE) == [os.getpid()]
        assert files.unpack((directory / names.VCUDA_CONFIG_FILE).read_bytes()).container_name == "main"
        # A process started since (no CUDA call yet) is in the file the library reads after the next refresh.
        (cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n{os.getppid()}\n")
        manager.refresh_pids([allocation])
        assert files.read_pids(directory / names.PIDS_CONFIG_FILE) == sorted([os.getpid(), os.getppid()])
    finally:
        manager.stop()
        shutil.rmtree(vm.parent, ignore_errors=True)


# -- a pids.config written as its directory goes --------------------------------------------------


def test_pids_of_a_removed_claim_do_not_bring_its_directory_back(tmp_path: Path) -> None:
    """The DRA pids refresh looks for the claim's directory, then writes; a NodeUnprepareResources in
    between removes the directory. The write must not make it again: nothing removes a claim's
    directory but the unprepare, so it would stay on the node for good."""
    import pytest

    from gpumanager.vmanager import claims

    vm = tmp_path / "vm"
    (vm / POD).mkdir(parents=True)
    claims.write_pids(vm, POD, [7])
    assert claims.remove(vm, POD)
    with pytest.raises(FileNotFoundError):
        claims.write_pids(vm, POD, [7, 8])
    assert not (vm / POD).exists()


# -- a whole-GPU container that crash-loops ------------------------------------------------------


def test_registrations_of_ended_whole_gpu_containers_are_removed(tmp_path: Path) -> None:
    """The library registers every container it runs in, a whole GPU's too (``enable=0``), each start
    under its new container ID. On a node with no shared container the pids refresh has nothing to
    keep current, but the directories of the IDs that ended must still go: a crash-looping container
    added one per restart until its pod was deleted."""
    import os

    from gpumanager.allocation.records import ContainerAllocation
    from gpumanager.api import vcuda_pb2 as pb
    from gpumanager.vmanager.refresh import PidsRefresher

    allocation = ContainerAllocation(pod_uid=POD, container="main", minors=(0,), cores=100, memory=16 << 30)
    pod: dict[str, object] = {}

    def started(cid: str) -> None:
        cgroup = tmp_path / "cgroup" / "kubepods" / f"pod{POD}" / cid
        cgroup.mkdir(parents=True)
        (cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")
        pod.update(
            metadata={"uid": POD, "name": "whole", "namespace": "default"},
            spec={"containers": [{"name": "main"}]},
            status={
                "phase": "Running",
                "qosClass": "Guaranteed",
                "containerStatuses": [{"name": "main", "containerID": f"containerd://{cid}", "state": {"running": {}}}],
            },
        )

    vm = Path(tempfile.mkdtemp(prefix="vmr", dir="/tmp")) / "vm"
    (vm / POD).mkdir(parents=True)
    manager = VirtualManager(
        vm_path=vm,
        cgroup_root=tmp_path / "cgroup",
        allocation=lambda u, c: allocation if (u, c) == (POD, "main") else None,
        pod=lambda u: dict(pod) if u == POD and pod else None,
        driver_version="550.54.15",
    )
    refresher = PidsRefresher(manager, lambda: [allocation], period=0.02)
    refresher.start()
    try:
        first, second = "a1" * 32, "b2" * 32
        started(first)
        manager.register(POD, pb.VDeviceRequest(pod_uid=POD, container_id=first), time_left=1.0)
        # The container ends and starts again under a new ID, which registers too.
        shutil.rmtree(tmp_path / "cgroup" / "kubepods" / f"pod{POD}" / first)
        started(second)
        manager.register(POD, pb.VDeviceRequest(pod_uid=POD, container_id=second), time_left=1.0)
        deadline = time.monotonic() + 10
        while (vm / POD / first).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not (vm / POD / first).exists(), sorted(p.name for p in (vm / POD).iterdir())
        assert (vm / POD / second / "pids.config").exists()
    finally:
        refresher.stop()
        manager.stop()
        shutil.rmtree(vm.parent, ignore_errors=True)


# -- a registration whose files cannot be written -----------------------------------------------


def test_a_registration_that_cannot_write_its_config_is_refused_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk while a registration writes vcuda.config: the call is refused with the file and the
    reason (gRPC UNAVAILABLE), not answered UNKNOWN with a traceback in the agent's log."""
    import errno
    import os

    import grpc

    from gpumanager.allocation.records import ContainerAllocation
    from gpumanager.api import vcuda_pb2 as pb
    from gpumanager.vmanager import files
    from gpumanager.vmanager.manager import RegistrationRefused

    cid = "c3" * 32
    cgroup = tmp_path / "cgroup" / "kubepods" / f"pod{POD}" / cid
    cgroup.mkdir(parents=True)
    (cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")
    pod = {
        "metadata": {"uid": POD, "name": "full", "namespace": "default"},
        "spec": {"containers": [{"name": "main"}]},
        "status": {"phase": "Running", "containerStatuses": [{"name": "main", "containerID": f"containerd://{cid}"}]},
    }
    allocation = ContainerAllocation(pod_uid=POD, container="main", minors=(0,), cores=20, memory=1 << 30)
    vm = tmp_path / "vm"
    (vm / POD).mkdir(parents=True)
    manager = VirtualManager(
        vm_path=vm,
        cgroup_root=tmp_path / "cgroup",
        allocation=lambda u, c: allocation if (u, c) == (POD, "main") else None,
        pod=lambda u: pod if u == POD else None,
        driver_version="550.54.15",
    )

    def full(path: Path, _config: files.VcudaConfig, **_how: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(files, "write_config", full)
    with pytest.raises(RegistrationRefused) as refused:
        manager.register(POD, pb.VDeviceRequest(pod_uid=POD, container_id=cid), time_left=1.0)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert str(vm / POD / cid / "vcuda.config") in str(refused.value)
    assert "No space left on device" in str(refused.value)


# -- a pids.config the refresh cannot write --------------------------------------------------------


def test_a_pids_config_that_cannot_be_written_is_reported_once_and_blocks_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One container's pids.config failing to be written (a full disk, a read-only file system) must not
    stop the refresh of the other containers, nor fill the log with a traceback each second."""
    import errno
    import logging
    import os

    from gpumanager import names
    from gpumanager.allocation.records import ContainerAllocation
    from gpumanager.vmanager import files

    ids = {"a": "a4" * 32, "b": "b5" * 32}
    pods: dict[str, dict[str, object]] = {}
    allocs = {}
    uids = {"a": POD, "b": OTHER}
    for name, uid in uids.items():
        cgroup = tmp_path / "cgroup" / "kubepods" / f"pod{uid}" / ids[name]
        cgroup.mkdir(parents=True)
        (cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")
        pods[uid] = {
            "metadata": {"uid": uid, "name": f"p-{name}", "namespace": "default"},
            "spec": {"containers": [{"name": "main"}]},
            "status": {
                "phase": "Running",
                "containerStatuses": [{"name": "main", "containerID": f"containerd://{ids[name]}"}],
            },
        }
        allocs[uid] = ContainerAllocation(pod_uid=uid, container="main", minors=(0,), cores=20, memory=1 << 30)
    vm = tmp_path / "vm"
    for uid in uids.values():
        (vm / "configs" / uid / "main").mkdir(parents=True)
    manager = VirtualManager(
        vm_path=vm,
        cgroup_root=tmp_path / "cgroup",
        allocation=lambda u, c: allocs.get(u) if c == "main" else None,
        pod=pods.get,
        driver_version="550.54.15",
    )
    real = files.write_pids
    broken = vm / "configs" / POD / "main" / names.PIDS_CONFIG_FILE

    def write_pids(path: Path, pids: list[int], **kwargs: bool) -> list[int]:
        if path == broken:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, pids, **kwargs)

    monkeypatch.setattr(files, "write_pids", write_pids)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            manager.refresh_pids(list(allocs.values()))
    assert files.read_pids(vm / "configs" / OTHER / "main" / names.PIDS_CONFIG_FILE) == [os.getpid()]
    reports = [r for r in caplog.records if str(broken) in r.getMessage()]
    assert len(reports) == 1, [r.getMessage() for r in caplog.records]
    assert "No space left on device" in reports[0].getMessage()
    assert reports[0].exc_info is None
