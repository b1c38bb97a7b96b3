"""Names that become paths: checked before use, so nothing is written outside a pod's own directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumanager import safenames
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.vmanager.manager import VirtualManager

UID = "3f0c6a8e-51b2-4d7a-9b0e-7c1d2e3f4a5b"


@pytest.mark.parametrize("value", ["3f0c6a8e-51b2-4d7a-9b0e-7c1d2e3f4a5b", "3F0C6A8E-51B2-4D7A-9B0E-7C1D2E3F4A5B"])
def test_uuids_are_pod_uids(value: str) -> None:
    assert safenames.pod_uid(value) == value


@pytest.mark.parametrize("value", ["", "..", "../" + UID, UID + "/x", "uid-a", UID + "\0"])
def test_anything_else_is_not(value: str) -> None:
    with pytest.raises(safenames.UnsafeNameError, match="is not a UUID"):
        safenames.pod_uid(value)


@pytest.mark.parametrize("value", ["../other/worker", "Main", "a/b", "-x", "x-", "", "a" * 64, "a.b"])
def test_container_names_must_be_dns_labels(value: str) -> None:
    with pytest.raises(safenames.UnsafeNameError, match="is not a DNS label"):
        safenames.container_name(value)


@pytest.mark.parametrize("value", ["..", ".", "a/b", "", "-a"])
def test_container_ids_are_plain_tokens(value: str) -> None:
    with pytest.raises(safenames.UnsafeNameError):
        safenames.container_id(value)


def test_child_refuses_anything_but_one_component(tmp_path: Path) -> None:
    assert safenames.child(tmp_path, "a", "b") == tmp_path / "a" / "b"
    for bad in ("..", "a/b", "", "."):
        with pytest.raises(safenames.UnsafeNameError):
            safenames.child(tmp_path, bad)


def test_prepare_never_writes_outside_the_pods_directory(tmp_path: Path) -> None:
    vm = VirtualManager(
        vm_path=tmp_path / "vm",
        cgroup_root=tmp_path / "cgroup",
        allocation=lambda uid, name: None,
        pod=lambda uid: None,
        driver_version="550.54.15",
    )
    try:
        alloc = ContainerAllocation(pod_uid=UID, container="../victim", minors=(0,), cores=50, memory=1 << 30)
        with pytest.raises(safenames.UnsafeNameError):
            vm.prepare(alloc)
        assert not list(tmp_path.rglob("vcuda.config"))
    finally:
        vm.stop()
