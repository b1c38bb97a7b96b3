"""pids.config kept current: written when a shared container's processes change, and only then."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpumanager import names
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.api import vcuda_pb2
from gpumanager.vmanager import files
from gpumanager.vmanager.manager import VirtualManager

POD = "5a1e7c2d-3b4f-4a6e-9d8c-0f1e2d3c4b5a"
CID = "c0ffee0000000000000000000000000000000000000000000000000000000001"
NEW_CID = "c0ffee0000000000000000000000000000000000000000000000000000000002"


def pod_object(cid: str) -> dict[str, object]:
    return {
        "metadata": {"uid": POD, "name": "p", "namespace": "default"},
        "spec": {"containers": [{"name": "main"}]},
        "status": {
            "qosClass": "Guaranteed",
            "containerStatuses": [{"name": "main", "containerID": f"containerd://{cid}"}],
        },
    }


@dataclass
class Node:
    vm: VirtualManager
    vm_path: Path
    cgroup: Path
    pods: dict[str, dict[str, object]]
    alloc: ContainerAllocation

    def procs(self, pids: list[int], cid: str = CID) -> None:
        directory = self.cgroup / "kubepods" / f"pod{POD}" / cid
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))

    def refresh(self) -> int:
        return self.vm.refresh_pids([self.alloc])

    def pids(self, subdir: str) -> list[int]:
        # A container's own directory (by its name), or one of the pod's directory (by a container ID).
        directory = self.vm.own_dir(POD, subdir) if subdir == "main" else self.vm_path / POD / subdir
        return files.read_pids(directory / names.PIDS_CONFIG_FILE)

    def register(self) -> None:
        self.vm.register(POD, vcuda_pb2.VDeviceRequest(pod_uid=POD, container_id=CID))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    vm_path = Path(tempfile.mkdtemp(prefix="gm-vm-"))  # short: <vm>/<uid>/vcuda.sock < 108 bytes
    pods: dict[str, dict[str, object]] = {POD: pod_object(CID)}
    alloc = ContainerAllocation(POD, "main", (0,), 30, 4 << 28)
    vm = VirtualManager(
        vm_path=vm_path,
        cgroup_root=tmp_path / "cgroup",
        allocation=lambda uid, name: alloc if (uid, name) == (POD, "main") else None,
        pod=pods.get,  # type: ignore[arg-type]
        driver_version="550.54.15",
    )
    n = Node(vm, vm_path, tmp_path / "cgroup", pods, alloc)
    n.procs([17])
    vm.prepare(alloc)
    try:
        yield n
    finally:
        vm.stop()
        shutil.rmtree(vm_path, ignore_errors=True)


def test_written_when_the_processes_change_and_only_then(node: Node) -> None:
    assert node.refresh() == 1
    assert node.pids("main") == [17]
    assert node.refresh() == 0
    node.procs([17, 4242])
    assert node.refresh() == 1
    assert node.pids("main") == [17, 4242]
    assert node.refresh() == 0


def test_a_pid_that_registered_and_exited_leaves_the_registered_file(node: Node) -> None:
    """The upstream library's registration writes the file itself; a refresh after the process exits
    must still bring that file back to the cgroup's PIDs."""
    node.register()
    node.refresh()
    node.procs([17, 4242])
    node.register()  # a new process registers: <pod>/<container id>/pids.config lists it
    assert node.pids(CID) == [17, 4242]
    node.procs([17])  # ... and exits before the next refresh
    node.refresh()
    assert node.pids(CID) == [17]
    assert node.pids("main") == [17]


def test_a_restarted_container_is_followed_to_its_new_cgroup(node: Node) -> None:
    node.refresh()
    node.procs([900, 901], cid=NEW_CID)
    node.pods[POD] = pod_object(NEW_CID)  # the pod cache holds a new object for the new status
    node.refresh()
    assert node.pids("main") == [900, 901]


def test_a_directory_made_after_a_refresh_gets_the_file(node: Node) -> None:
    """The container's directory went away (an operator cleaned up): the file is written once it is back."""
    shutil.rmtree(node.vm.own_dir(POD, "main"))
    node.refresh()
    assert not node.vm.own_dir(POD, "main").exists()
    node.vm.own_dir(POD, "main").mkdir()
    node.refresh()
    assert node.pids("main") == [17]


def test_a_collected_directory_is_forgotten_and_written_again_when_it_returns(node: Node) -> None:
    node.refresh()
    assert node.vm.gc(set(), only={POD}) == [POD]
    assert not (node.vm_path / POD).exists()
    node.vm.prepare(node.alloc)  # the pod's container started again (the directory is made anew)
    node.refresh()
    assert node.pids("main") == [17]


def test_collecting_only_some_directories_leaves_the_others_for_the_full_pass(node: Node) -> None:
    gone_a, gone_b, never_made = (f"00000000-0000-4000-8000-00000000000{i}" for i in "abc")
    for uid in (gone_a, gone_b):
        (node.vm_path / uid / "main").mkdir(parents=True)
    assert node.vm.gc({POD}, only={gone_a, POD, never_made}) == [gone_a]
    assert sorted(p.name for p in node.vm_path.iterdir()) == sorted([POD, gone_b, names.VCUDA_CONFIGS_DIR])
    assert node.vm.gc({POD}) == [gone_b]
    assert sorted(p.name for p in node.vm_path.iterdir()) == sorted([POD, names.VCUDA_CONFIGS_DIR])
    assert [p.name for p in node.vm.configs_path.iterdir()] == [POD]


@pytest.mark.parametrize("refreshed", [True, False], ids=["refresh-each-restart", "no-refresh-sees-it"])
def test_a_crash_looping_container_leaves_nothing_remembered_per_restart(node: Node, refreshed: bool) -> None:
    """Each restart gets a new container ID, whose registration writes <pod>/<container id>/pids.config;
    what is remembered of an ID goes when its container does, not when the pod is deleted, also when
    each new ID registers and dies before the pod's status or a refresh names it."""
    node.register()
    if refreshed:
        node.refresh()
    remembered = len(node.vm._last_pids)
    for restart in range(3, 40):
        cid = f"c0ffee{restart:058d}"
        node.procs([1000 + restart], cid=cid)
        node.pods[POD] = pod_object(cid)
        node.vm.register(POD, vcuda_pb2.VDeviceRequest(pod_uid=POD, container_id=cid))
        if refreshed:
            node.refresh()
        assert node.pids(cid) == [1000 + restart]
    if refreshed:
        assert node.pids("main") == [1039]
    assert len(node.vm._last_pids) == remembered


def _gone(node: Node, cid: str) -> None:
    shutil.rmtree(node.cgroup / "kubepods" / f"pod{POD}" / cid)


def test_a_restarted_containers_old_id_directory_is_removed(node: Node) -> None:
    """A crash-looping container registers a new <pod>/<container id>/ at each start: the old one goes
    once its ID has left the pod's status and its cgroup is gone."""
    node.register()
    _gone(node, CID)
    for restart in range(3, 13):
        cid = f"c0ffee{restart:058d}"
        node.procs([1000 + restart], cid=cid)
        node.pods[POD] = pod_object(cid)
        node.vm.register(POD, vcuda_pb2.VDeviceRequest(pod_uid=POD, container_id=cid))
        node.refresh()
        _gone(node, cid)
    node.refresh()
    left = sorted(p.name for p in (node.vm_path / POD).iterdir() if p.is_dir())
    assert left == sorted(["main", "c0ffee" + f"{12:058d}"])  # the status still names the last one
    assert not (node.vm_path / POD / CID).exists()


def test_an_id_directory_stays_while_the_status_names_it_or_its_cgroup_lives(node: Node) -> None:
    node.register()
    # Registered before the status names it (recognised by its cgroup): kept while its cgroup lives.
    node.procs([900], cid=NEW_CID)
    node.pods[POD] = pod_object(NEW_CID)
    node.vm.register(POD, vcuda_pb2.VDeviceRequest(pod_uid=POD, container_id=NEW_CID))
    node.pods[POD] = pod_object(CID)
    node.refresh()
    assert (node.vm_path / POD / NEW_CID).is_dir()
    # Named by the status, its cgroup gone (the container ended; the status not updated yet): kept.
    _gone(node, CID)
    node.refresh()
    assert (node.vm_path / POD / CID).is_dir()
    # Neither: removed.
    _gone(node, NEW_CID)
    node.refresh()
    assert not (node.vm_path / POD / NEW_CID).exists()
    assert (node.vm_path / POD / CID).is_dir() and (node.vm_path / POD / "main").is_dir()


def test_old_id_directories_found_at_a_restart_of_the_agent_are_removed_too(node: Node) -> None:
    stale = node.vm_path / POD / ("ab" * 32)
    stale.mkdir()
    (stale / names.PIDS_CONFIG_FILE).write_bytes(b"")
    node.vm.resume([POD])
    node.refresh()
    assert not stale.exists()
    assert (node.vm_path / POD / "main").is_dir()
