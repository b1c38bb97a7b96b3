"""Recovery from the kubelet's records when our checkpoint cannot be trusted: what its answers and
PodResources say is taken as it is, odd values are not, and nothing the kubelet holds is dropped."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from gpumanager import names
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.deviceplugin.devices import DeviceLayout
from gpumanager.deviceplugin.handlers import to_pb
from gpumanager.kube import kubelet_checkpoint
from gpumanager.kube.podresources import ContainerDevices, PodResourcesClient
from gpumanager.recovery import Recovery, from_kubelet_checkpoint, from_pod_resources
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of, v100x4


def _answer(cores: str, memory: str, devices: str) -> str:
    resp = pb.ContainerAllocateResponse(
        annotations={names.VCORE_RESOURCE: cores, names.VMEMORY_RESOURCE: memory, names.VDEVICE_ANNOTATION: devices}
    )
    return base64.b64encode(resp.SerializeToString()).decode()


def _kubelet_checkpoint(path: Path, entries: list[dict[str, object]]) -> Path:
    path.write_text(json.dumps({"Data": {"PodDeviceEntries": entries}, "Checksum": 1}))
    return path


def _entry(pod: str, container: str, ids: list[str], answer: str) -> dict[str, object]:
    return {
        "PodUID": pod,
        "ContainerName": container,
        "ResourceName": names.VCORE_RESOURCE,
        "DeviceIDs": {"0": ids},
        "AllocResp": answer,
    }


def test_odd_values_in_the_kubelets_answers_are_not_taken_as_they_are(tmp_path: Path) -> None:
    pod, ids = uid_of("p"), core_ids(0, 50)
    entries = kubelet_checkpoint.read(
        _kubelet_checkpoint(
            tmp_path / "kc",
            [
                _entry(pod, "negative-cores", ids, _answer("-50", "1024", "/dev/nvidia0")),
                _entry(pod, "negative-memory", core_ids(1, 50), _answer("50", "-1024", "/dev/nvidia1")),
                _entry(pod, "one-gpu-twice", core_ids(2, 50), _answer("50", "1024", "/dev/nvidia2,/dev/nvidia2")),
            ],
        )
    )
    found = {a.container: a for a in from_kubelet_checkpoint(entries)}
    assert sorted(found) == ["negative-cores"], "a negative memory or a GPU named twice is no answer of ours"
    assert found["negative-cores"].cores == 50, "one vcuda-core ID per core: the kubelet's count holds"


def test_a_kubelet_checkpoint_nested_too_deeply_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "kc"
    path.write_text("[" * 100_000 + "]" * 100_000)
    try:
        kubelet_checkpoint.read(path)
    except kubelet_checkpoint.KubeletCheckpointError as exc:
        assert str(path) in str(exc) and "too deeply" in str(exc)
    else:
        raise AssertionError("read a checkpoint nested 100000 deep")


def test_a_sidecar_is_rebuilt_from_pod_resources(tmp_path: Path) -> None:
    gpus, _ = v100x4()
    pod = make_pod("side", [("app", 30, 4)], phase="Running")
    pod["spec"]["initContainers"] = [
        {
            "name": "gpu-sidecar",
            "restartPolicy": "Always",
            "resources": {"limits": {names.VCORE_RESOURCE: "50", names.VMEMORY_RESOURCE: "4"}},
        }
    ]
    entries = [
        ContainerDevices("default", "side", "gpu-sidecar", names.VCORE_RESOURCE, tuple(core_ids(0, 50))),
        ContainerDevices("default", "side", "app", names.VCORE_RESOURCE, tuple(core_ids(0, 30, 50))),
    ]
    found = from_pod_resources(entries, find_pod=lambda ns, n: pod, layout=DeviceLayout(gpus), gpus=gpus)
    assert sorted((a.container, a.cores) for a in found) == [("app", 30), ("gpu-sidecar", 50)]


def test_an_answer_built_for_another_container_is_recovered_as_such(tmp_path: Path) -> None:
    # Two identical pods swapped at PreStartContainer: each holds the answer built for the other.
    gpus, _ = v100x4()
    pods = FakePods([make_pod("a", [("c0", 50, 4)]), make_pod("b", [("c0", 50, 4)])])
    first = make_allocator(tmp_path / "first", pods)
    x, y = core_ids(0, 50), core_ids(0, 50, 50)
    answers = {frozenset(x): first.allocate(x), frozenset(y): first.allocate(y)}
    holders = {frozenset(a.device_ids): a.key for a in first.allocations()}
    other = uid_of("b") if holders[frozenset(x)][0] == uid_of("a") else uid_of("a")
    first.pre_start(x, (other, "c0"))
    assert all(a.answered != a.key for a in first.allocations()), "no swap"
    entries = []
    for alloc in first.allocations():
        answer = base64.b64encode(to_pb(answers[frozenset(alloc.device_ids)]).SerializeToString()).decode()
        entries.append(_entry(alloc.pod_uid, alloc.container, list(alloc.device_ids), answer))
    kc = _kubelet_checkpoint(tmp_path / "kc", entries)
    second = make_allocator(tmp_path / "second", pods)  # our checkpoint is lost
    Recovery(second, kubelet_checkpoint_path=kc, layout=DeviceLayout(gpus), gpus=gpus).from_disk()
    assert {a.key: a.answered for a in second.allocations()} == {a.key: a.answered for a in first.allocations()}


def test_a_container_the_kubelet_holds_ids_for_keeps_its_gpu_when_nothing_rebuilds_it(tmp_path: Path) -> None:
    gpus, _ = v100x4()
    pod = make_pod("run", [("c0", 50, 4)], phase="Running")
    ours = tmp_path / "checkpoint" / "gpumanager_internal_checkpoint"
    ours.parent.mkdir(parents=True)
    entry = {"Devices": ["/dev/nvidia0"], "Cores": "fifty", "Memory": 1 << 30}
    ours.write_text(json.dumps({"PodGPUMapping": {uid_of("run"): {"c0": entry}}}))
    kc = _kubelet_checkpoint(tmp_path / "kc", [_entry(uid_of("run"), "c0", core_ids(0, 50), "")])
    alloc = make_allocator(tmp_path, FakePods([pod]))
    recovery = Recovery(alloc, kubelet_checkpoint_path=kc, layout=DeviceLayout(gpus), gpus=gpus)
    recovery.from_disk()
    recovery.from_pod_resources(PodResourcesClient(tmp_path / "no-kubelet.sock"), lambda ns, n: pod)
    assert [(a.container, a.minors) for a in alloc.allocations()] == [("c0", (0,))], "a running pod's GPU was freed"
