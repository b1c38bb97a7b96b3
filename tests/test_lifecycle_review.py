"""A pod's allocations over its life, as the kubelet drives them: init containers whose devices it
reuses, requests it hands on, containers it restarts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpumanager.allocation.allocator import AllocationError, Allocator, AllocatorSettings
from gpumanager.allocation.response import ResponseSettings
from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.topology import build_tree
from tests.alloc_fixtures import MIB, FakePods, core_ids, make_pod, uid_of


def _one_gpu(tmp_path: Path, pods: FakePods) -> Allocator:
    gpus = [GPUInfo(0, "GPU-0000", "Tesla T4", 0, 16384 * MIB, "00000000:10:00.0", 0)]
    return Allocator(
        gpus=gpus,
        tree=build_tree(gpus, NodeTopology(levels=((0,),))),
        pods=pods,
        settings=AllocatorSettings(
            share_mode=True,
            response=ResponseSettings(
                vdriver_nvidia="/etc/gpu-manager/vdriver/nvidia",
                vdriver_origin="/etc/gpu-manager/vdriver/origin",
                virtual_manager_path="/etc/gpu-manager/vm",
            ),
        ),
        checkpoint_path=tmp_path / "checkpoint" / "gpumanager_internal_checkpoint",
    )


def _with_init(name: str, inits: list[tuple[str, int, int]], apps: list[tuple[str, int, int]]) -> dict[str, Any]:
    pod = make_pod(name, apps)
    limits = [
        {"tencent.com/vcuda-core": str(c), **({"tencent.com/vcuda-memory": str(b)} if b else {})} for _, c, b in inits
    ]
    pod["spec"]["initContainers"] = [
        {"name": n, "image": "cuda", "resources": {"limits": lim, "requests": lim}}
        for (n, _, _), lim in zip(inits, limits, strict=True)
    ]
    return pod


def _free(allocator: Allocator) -> tuple[int, int]:
    """(cores, MiB) left on GPU 0."""
    _, cores, memory, _, _ = allocator.tree_snapshot()[0]
    return cores, memory // MIB


# -- init containers whose devices the kubelet reuses for containers of another size ------------------


def test_init_share_then_whole_gpu_app_fits_on_the_one_gpu(tmp_path: Path) -> None:
    """The kubelet counts a pod as max(init, sum of apps) and hands the init container's IDs on: a pod
    with a 50-core init container and a whole-GPU app container fits a one-GPU node."""
    pods = FakePods([_with_init("p", [("init", 50, 4)], [("app", 100, 0)])])
    allocator = _one_gpu(tmp_path, pods)
    ids = core_ids(0, 100)
    allocator.allocate(ids[:50])
    answer = allocator.allocate(ids)  # the init container's 50 IDs reused, 50 more
    assert answer.annotations["tencent.com/vcuda-device"] == "/dev/nvidia0"
    assert allocator.get(uid_of("p"), "app") is not None
    assert _free(allocator) == (0, 0)
    allocator.release_pod(uid_of("p"))
    assert _free(allocator) == (100, 16384)


def test_whole_gpu_init_split_between_two_app_shares(tmp_path: Path) -> None:
    pods = FakePods([_with_init("p", [("init", 100, 0)], [("a", 50, 4), ("b", 50, 4)])])
    allocator = _one_gpu(tmp_path, pods)
    ids = core_ids(0, 100)
    allocator.allocate(ids)
    allocator.allocate(ids[:50])
    allocator.allocate(ids[50:])
    assert {a.container for a in allocator.allocations_of(uid_of("p"))} == {"init", "a", "b"}
    assert _free(allocator) == (0, 0)
    allocator.release_pod(uid_of("p"))
    assert _free(allocator) == (100, 16384)


def test_init_charge_is_the_larger_of_init_and_the_apps_together(tmp_path: Path) -> None:
    """A 60-core init container, then two 40-core apps: the pod holds 80 cores (never 60 + 80 = 140,
    never 60 alone), and another pod's 20-core share still fits beside it, a 30-core one does not."""
    pods = FakePods([_with_init("p", [("init", 60, 8)], [("a", 40, 4), ("b", 40, 4)])])
    allocator = _one_gpu(tmp_path, pods)
    ids = core_ids(0, 100)
    allocator.allocate(ids[:60])
    allocator.allocate(ids[:40])
    allocator.allocate(ids[40:60] + ids[60:80])
    assert _free(allocator) == (20, 16384 - 2048)
    pods.items.append(make_pod("q", [("c", 30, 4)]))
    with pytest.raises(AllocationError, match="no GPU has 30 cores"):
        allocator.allocate(core_ids(1, 30))  # IDs no container of p holds
    pods.items[-1] = make_pod("q2", [("c", 20, 4)])
    allocator.allocate(ids[80:])
    assert _free(allocator) == (0, 16384 - 3072)


def test_init_charge_survives_a_restart(tmp_path: Path) -> None:
    pods = FakePods([_with_init("p", [("init", 50, 4)], [("app", 100, 0)])])
    allocator = _one_gpu(tmp_path, pods)
    ids = core_ids(0, 100)
    allocator.allocate(ids[:50])
    allocator.allocate(ids)
    allocator.close()
    again = _one_gpu(tmp_path, pods)
    again.load()
    assert _free(again) == (0, 0)
    again.release_pod(uid_of("p"))
    assert _free(again) == (100, 16384)


# -- a PreStartContainer that fails for a while ------------------------------------------------------


def test_prestart_that_cannot_write_files_does_not_mark_the_pod_failed(tmp_path: Path) -> None:
    """The kubelet retries a container whose PreStartContainer failed, and puts the error in the
    container's waiting message. A failure to write the limit files (a full disk) is passing: the
    allocation check must neither free the pod's GPUs (the retried start would then find no
    allocation, for good) nor delete the pod, as it does for a failed check."""
    import errno

    from gpumanager.allocation.check import AllocationCheck
    from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
    from gpumanager.deviceplugin.devices import DeviceLayout
    from gpumanager.deviceplugin.handlers import Handlers
    from gpumanager.deviceplugin.servicer import RequestError

    pod = make_pod("p", [("c", 50, 4)])
    pod["metadata"]["ownerReferences"] = [{"kind": "ReplicaSet", "name": "rs", "uid": "r", "controller": True}]
    pods = FakePods([pod])
    allocator = _one_gpu(tmp_path, pods)
    gpus = [GPUInfo(0, "GPU-0000", "Tesla T4", 0, 16384 * MIB, "00000000:10:00.0", 0)]

    def full_disk(_alloc: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "/etc/gpu-manager/vm/x/vcuda.config")

    handlers = Handlers(
        allocator=allocator,
        layout=DeviceLayout(gpus),
        owner=lambda *_: (uid_of("p"), "c"),
        prepared=full_disk,
    )
    ids = core_ids(0, 50)
    allocator.allocate(ids)
    with pytest.raises(RequestError) as failed:
        handlers.pre_start_core(pb.PreStartContainerRequest(devices_ids=ids))
    assert uid_of("p") in str(failed.value) and "No space left on device" in str(failed.value)
    # As the kubelet reports it.
    pod["status"]["containerStatuses"] = [
        {
            "name": "c",
            "state": {
                "waiting": {
                    "reason": "CreateContainerConfigError",
                    "message": f"device plugin PreStartContainer rpc failed with err: rpc error: code = "
                    f"{failed.value.code.name} desc = {failed.value}",
                }
            },
        }
    ]
    deleted: list[str] = []
    check = AllocationCheck(
        allocator,
        pods,
        period=30.0,
        annotate=lambda _uid: None,
        delete_failed=lambda p: deleted.append(p["metadata"]["name"]),
        collect_dirs=lambda *_a, **_k: None,
        wait_synced=lambda _t: True,
    )
    check.check()
    assert deleted == []
    assert allocator.get(uid_of("p"), "c") is not None
    # The disk has room again: the retried start goes through.
    handlers = Handlers(
        allocator=allocator, layout=DeviceLayout(gpus), owner=lambda *_: (uid_of("p"), "c"), prepared=lambda _a: None
    )
    handlers.pre_start_core(pb.PreStartContainerRequest(devices_ids=ids))


# -- a pod deleted before it started, its devices handed to an identical pod -------------------------


def test_ids_of_a_pod_deleted_before_it_started_go_to_the_identical_pod_admitted_next(tmp_path: Path) -> None:
    """Pod a was allocated, then deleted before the kubelet published any container status; the kubelet
    stops counting it and gives its device IDs to the identical pod b. That Allocate is b's, not a
    repeat of a's: b must hold the allocation, so that a's deletion does not free the GPU b starts on."""
    a = make_pod("a", [("c", 50, 4)])
    pods = FakePods([a])
    allocator = _one_gpu(tmp_path, pods)
    ids = core_ids(0, 50)
    allocator.allocate(ids)
    a["metadata"]["deletionTimestamp"] = "2026-11-21T10:01:00Z"
    pods.items.append(make_pod("b", [("c", 50, 4)], created="2026-11-21T10:01:00Z"))
    allocator.allocate(ids)
    assert allocator.get(uid_of("b"), "c") is not None
    pods.items.remove(a)
    allocator.release_pod(uid_of("a"))  # a's DELETED event
    assert allocator.pre_start(ids, (uid_of("b"), "c")).pod_uid == uid_of("b")
    assert _free(allocator) == (50, 16384 - 1024)


# -- static pods: the mirror pod is the kubelet's copy, deleted and made again ------------------------

MIRROR = "kubernetes.io/config.mirror"


def _mirror_pod(uid: str, config_hash: str) -> dict[str, Any]:
    pod = make_pod("etcd-node-1", [("c", 50, 4)], namespace="kube-system", uid=uid, phase="Running")
    pod["metadata"]["annotations"][MIRROR] = config_hash
    pod["status"]["containerStatuses"] = [{"name": "c", "state": {"running": {}}, "containerID": "containerd://ab"}]
    return pod


def _check(allocator: Allocator, pods: FakePods) -> Any:
    from gpumanager.allocation.check import AllocationCheck

    return AllocationCheck(
        allocator,
        pods,
        period=30.0,
        annotate=lambda _uid: None,
        delete_failed=lambda _p: None,
        collect_dirs=lambda *_a, **_k: None,
        wait_synced=lambda _t: True,
    )


def test_deleting_a_static_pods_mirror_pod_keeps_its_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kubectl delete`` of a static pod's mirror pod stops no container: the kubelet makes the mirror pod
    again (a new UID, the same config hash). The static pod keeps its GPU meanwhile and after."""

    old = _mirror_pod("00000000-0000-4000-8000-000000000001", "hash-1")
    old["status"] = {"phase": "Pending"}
    pods = FakePods([old])
    allocator = _one_gpu(tmp_path, pods)
    ids = core_ids(0, 50)
    allocator.allocate(ids)
    allocator.pre_start(ids, ("00000000-0000-4000-8000-000000000001", "c"))
    old.update(_mirror_pod("00000000-0000-4000-8000-000000000001", "hash-1"))
    check = _check(allocator, pods)
    now = [1000.0]
    monkeypatch.setattr("gpumanager.allocation.allocator.time.monotonic", lambda: now[0])

    pods.items.remove(old)
    check.on_pod_event("DELETED", old)
    check.check()  # before the kubelet made it again
    assert _free(allocator) == (50, 16384 - 1024)

    pods.items.append(_mirror_pod("00000000-0000-4000-8000-000000000002", "hash-1"))
    now[0] += 3600
    check.check()
    assert _free(allocator) == (50, 16384 - 1024)
    assert allocator.pre_start(ids, ("00000000-0000-4000-8000-000000000002", "c")).cores == 50

    # The static pod is removed for good (its manifest gone): the kubelet stops it and deletes the mirror.
    gone = pods.items.pop()
    gone["status"]["containerStatuses"] = [{"name": "c", "state": {"terminated": {"exitCode": 0}}}]
    gone["status"]["phase"] = "Succeeded"
    check.on_pod_event("DELETED", gone)
    check.check()
    assert _free(allocator) == (100, 16384)


def test_a_mirror_pod_not_made_again_frees_the_gpu_after_a_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpumanager.allocation import allocator as allocator_module

    pod = _mirror_pod("00000000-0000-4000-8000-000000000001", "hash-1")
    pod["status"] = {"phase": "Pending"}
    pods = FakePods([pod])
    allocator = _one_gpu(tmp_path, pods)
    allocator.allocate(core_ids(0, 50))
    pod.update(_mirror_pod("00000000-0000-4000-8000-000000000001", "hash-1"))
    check = _check(allocator, pods)
    now = [1000.0]
    monkeypatch.setattr("gpumanager.allocation.allocator.time.monotonic", lambda: now[0])
    pods.items.remove(pod)
    check.on_pod_event("DELETED", pod)
    check.check()
    assert _free(allocator) == (50, 16384 - 1024)
    # A new mirror pod of another static pod (its manifest changed: another hash) does not keep it.
    pods.items.append(_mirror_pod("00000000-0000-4000-8000-000000000003", "hash-2"))
    now[0] += allocator_module.MIRROR_GRACE_SECONDS
    check.check()
    assert allocator.get("00000000-0000-4000-8000-000000000001", "c") is None


def test_prestart_of_a_static_pod_named_by_the_kubelet_checkpoint(tmp_path: Path) -> None:
    """Without PodResources the kubelet's checkpoint names the holder of the IDs by the kubelet's UID of
    the pod, which for a static pod is its config hash, not the mirror pod's UID we allocated under."""
    pod = _mirror_pod("00000000-0000-4000-8000-000000000001", "0123456789abcdef0123456789abcdef")
    pod["status"] = {"phase": "Pending"}
    pods = FakePods([pod])
    allocator = _one_gpu(tmp_path, pods)
    ids = core_ids(0, 50)
    allocator.allocate(ids)
    alloc = allocator.pre_start(ids, ("0123456789abcdef0123456789abcdef", "c"))
    assert alloc.key == ("00000000-0000-4000-8000-000000000001", "c") and alloc.started


# -- an admission the kubelet failed after our Allocate ------------------------------------------------


def test_ids_repeated_then_their_pod_failed_admission_stay_with_the_pod_that_got_them(tmp_path: Path) -> None:
    """Pod a's Allocate succeeded, then the kubelet failed a's admission (another resource refused:
    UnexpectedAdmissionError) and gave the same IDs to the identical pod b before a's status said so,
    so b got a's answer as a repeat. When a's failure shows, the IDs and the answer are b's: b keeps
    the GPU (no other pod may be placed on it) and starts with those IDs."""
    a = make_pod("a", [("c", 50, 4)])
    b = make_pod("b", [("c", 50, 4)], created="2026-11-21T10:00:30Z")
    pods = FakePods([a, b])
    allocator = _one_gpu(tmp_path, pods)
    ids = core_ids(0, 50)
    first = allocator.allocate(ids)
    assert allocator.allocate(ids) == first  # b's, while a still shows Pending everywhere
    a["status"] = {"phase": "Failed", "reason": "UnexpectedAdmissionError", "message": "Allocate failed"}
    check = _check(allocator, pods)
    check.on_pod_event("MODIFIED", a)
    assert _free(allocator) == (50, 16384 - 1024)
    assert uid_of("a") in check.active_pod_dirs(among={uid_of("a")})  # b's answer mounts a's directory
    started = allocator.pre_start(ids, (uid_of("b"), "c"))
    assert started.key == (uid_of("b"), "c")
    assert started.answered == (uid_of("a"), "c")  # the directory its answer mounts
    assert _free(allocator) == (50, 16384 - 1024)


def test_init_container_place_is_taken_by_the_container_gpu_admission_predicated_there(tmp_path: Path) -> None:
    """With gpu-admission the app container comes with predicate-gpu-idx naming the one GPU, which its
    pod's init container holds a share of: that share is the pod's own, ended before the app starts."""
    pod = _with_init("p", [("init", 50, 4)], [("app", 100, 0)])
    pod["metadata"]["annotations"].update(
        {
            "tencent.com/predicate-gpu-idx-0": "0",
            "tencent.com/predicate-time": "1",
            "tencent.com/gpu-assigned": "false",
        }
    )
    allocator = _one_gpu(tmp_path, FakePods([pod]))
    ids = core_ids(0, 100)
    allocator.allocate(ids[:50])
    assert allocator.allocate(ids).annotations["tencent.com/vcuda-device"] == "/dev/nvidia0"
    assert _free(allocator) == (0, 0)


def test_allocate_with_no_pod_on_the_node_says_what_may_be_wrong(tmp_path: Path) -> None:
    """The kubelet admitted a pod, yet the API server lists none on the node the agent watches: the
    agent's node name differs from the kubelet's, or the pod is a static pod without a mirror pod yet."""
    allocator = _one_gpu(tmp_path, FakePods([]))
    with pytest.raises(AllocationError, match=r"no pod at all.*--hostname-override.*static pod") as refused:
        allocator.allocate(core_ids(0, 50))
    assert refused.value.kind == "not_found"


def test_a_static_pod_replaced_by_a_new_manifest_frees_the_old_ones_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A changed manifest makes another static pod of the same name (another config hash): the kubelet
    stops the old one, whose mirror pod it deletes. Once the new mirror pod shows, the old GPUs go."""
    pod = _mirror_pod("00000000-0000-4000-8000-000000000001", "hash-1")
    pod["status"] = {"phase": "Pending"}
    pods = FakePods([pod])
    allocator = _one_gpu(tmp_path, pods)
    allocator.allocate(core_ids(0, 50))
    pod.update(_mirror_pod("00000000-0000-4000-8000-000000000001", "hash-1"))
    check = _check(allocator, pods)
    monkeypatch.setattr("gpumanager.allocation.allocator.time.monotonic", lambda: 1000.0)
    pods.items.remove(pod)
    check.on_pod_event("DELETED", pod)
    new = _mirror_pod("00000000-0000-4000-8000-000000000002", "hash-2")
    new["status"] = {"phase": "Pending"}
    pods.items.append(new)
    check.check()
    assert allocator.get("00000000-0000-4000-8000-000000000001", "c") is None
    assert _free(allocator) == (100, 16384)
