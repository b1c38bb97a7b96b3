"""A rebuild from PodResources alone (both checkpoints lost) answers a container with the directory its
``vcuda.config`` lies in only when nothing contradicts it: content the agent finds on disk may have been
written by a container into its own mounted directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from gpumanager.deviceplugin.devices import DeviceLayout
from gpumanager.kube.podresources import ContainerDevices
from gpumanager.recovery import Recovery
from gpumanager.vmanager import files
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of, v100x4

CORE = names.VCORE_RESOURCE


class _FixedPodResources:
    """A PodResources client whose kubelet answers with ``entries``."""

    def __init__(self, entries: list[Any]) -> None:
        self.entries = entries

    def list_all(self) -> list[Any]:
        return list(self.entries)


def _plant(vm: Path, directory: str, names_pod: str) -> None:
    config = vm / directory / "main" / names.VCUDA_CONFIG_FILE
    config.parent.mkdir(parents=True)
    config.write_bytes(
        files.pack(files.VcudaConfig(pod_uid=names_pod, container_name="main", gpu_memory=1, utilization=50))
    )


@pytest.mark.parametrize("contradiction", ["own-file-names-it", "two-gone-directories-name-it"])
def test_a_vcuda_config_naming_b_in_a_gone_directory_does_not_move_b_when_contradicted(
    tmp_path: Path, contradiction: str
) -> None:
    """A file naming b in the directory of a pod that is gone (written there by that pod's container, or left
    by anything but b's take-over) does not move b when b's own directory holds the vcuda.config that
    PreStartContainer wrote for b (b mounts its own), nor when two such directories name b (which is b's
    cannot be told)."""
    b = uid_of("b")
    pods = [make_pod("b", [("main", 50, 4)], phase="Running")]
    vm = tmp_path / "vm"
    _plant(vm, uid_of("gone"), b)
    if contradiction == "own-file-names-it":
        _plant(vm, b, b)
    else:
        _plant(vm, uid_of("gone2"), b)
    alloc = make_allocator(tmp_path, FakePods(pods))
    gpus, _ = v100x4()
    try:
        rec = Recovery(
            alloc, kubelet_checkpoint_path=tmp_path / "none", layout=DeviceLayout(gpus), gpus=gpus, vm_path=vm
        )
        rec.from_disk()
        listed = ContainerDevices("default", "b", "main", CORE, tuple(core_ids(1, 50)))
        rec.from_pod_resources(_FixedPodResources([listed]), lambda ns, name: pods[0] if name == "b" else None)  # type: ignore[arg-type]
        record = alloc.get(b, "main")
        assert record is not None and record.answered == (b, "main"), record
    finally:
        alloc.close()


@pytest.mark.parametrize("how", ["cache-not-synced", "unnamed-pod"])
def test_a_vcuda_config_in_a_running_pods_directory_does_not_move_b(tmp_path: Path, how: str) -> None:
    """c runs (the kubelet's PodResources lists it) and wrote a vcuda.config naming b into the directory it
    mounts; the pod cache does not know c (not synced yet, or c deleted at the API server while its containers
    still run), or c cannot be named at all (the API server does not answer): its directory is not free, and b
    keeps its own (else b's and c's files would share c's directory)."""
    b, c = uid_of("b"), uid_of("c")
    pod_b = make_pod("b", [("main", 50, 4)], phase="Running")
    pod_c = make_pod("c", [("main", 50, 4)], phase="Running")
    vm = tmp_path / "vm"
    _plant(vm, c, b)
    cache = FakePods([pod_b])
    cache.is_synced = False
    alloc = make_allocator(tmp_path, cache)
    gpus, _ = v100x4()
    lookup = {"b": pod_b, "c": pod_c if how == "cache-not-synced" else None}
    try:
        rec = Recovery(
            alloc, kubelet_checkpoint_path=tmp_path / "none", layout=DeviceLayout(gpus), gpus=gpus, vm_path=vm
        )
        rec.from_disk()
        listed = [
            ContainerDevices("default", "b", "main", CORE, tuple(core_ids(1, 50))),
            ContainerDevices("default", "c", "main", CORE, tuple(core_ids(2, 50))),
        ]
        rec.from_pod_resources(_FixedPodResources(listed), lambda ns, name: lookup.get(name))  # type: ignore[arg-type]
        record = alloc.get(b, "main")
        assert record is not None and record.answered == (b, "main"), record
        if how == "cache-not-synced":
            assert alloc.get(c, "main") is not None
    finally:
        alloc.close()
