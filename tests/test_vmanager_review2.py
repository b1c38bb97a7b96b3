"""Defects of the virtual manager found by review: each test fails on the code before its fix."""

from __future__ import annotations

from pathlib import Path

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
    (vm / "lost+found").mkdir()
    (vm / "checkpoint").mkdir()
    (vm / "checkpoint" / "gpumanager_internal_checkpoint").write_text("{}")
    (vm / "vdriver" / "nvidia").mkdir(parents=True)

    removed = manager.gc(active=[OTHER])

    assert removed == [POD]
    assert sorted(p.name for p in vm.iterdir()) == ["checkpoint", "lost+found", "vdriver"]
    assert (vm / "checkpoint" / "gpumanager_internal_checkpoint").read_text() == "{}"
