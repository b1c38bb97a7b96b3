"""The allocator: matching requests to pods, choosing GPUs, refusing clearly, checkpointing first."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest

from gpumanager.allocation import ids as ids_module
from gpumanager.allocation.allocator import AllocationError, Allocator
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.allocation.response import ContainerResponse, Mount, ResponseSettings, build_response
from tests.alloc_fixtures import MIB, FakePods, core_ids, make_allocator, make_pod, uid_of, v100x4

GIB = 1 << 30


def test_share_response_has_upstreams_exact_shape(tmp_path: Path) -> None:
    pods = FakePods([make_pod("a", [("main", 50, 8)])])
    alloc = make_allocator(tmp_path, pods)
    resp = alloc.allocate(core_ids(0, 50))
    assert resp.envs == {
        "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64",
        "NVIDIA_VISIBLE_DEVICES": "GPU-0000",
        "VCUDA_CONFIG_PATH": "/etc/vcuda/main/vcuda.config",
    }
    assert [(d.container_path, d.host_path, d.permissions) for d in resp.devices] == [
        ("/dev/nvidia0", "/dev/nvidia0", "rwm"),
        ("/dev/nvidiactl", "/dev/nvidiactl", "rwm"),
        ("/dev/nvidia-uvm", "/dev/nvidia-uvm", "rwm"),
        ("/dev/nvidia-uvm-tools", "/dev/nvidia-uvm-tools", "rwm"),
    ]
    assert [(m.container_path, m.host_path, m.read_only) for m in resp.mounts] == [
        ("/usr/local/nvidia", "/etc/gpu-manager/vdriver/nvidia", True),
        ("/etc/vcuda", f"/etc/gpu-manager/vm/{uid_of('a')}", True),
        # The container's own directory, mounted alone over its (empty) mount point in the pod's.
        ("/etc/vcuda/main", f"/etc/gpu-manager/vm/configs/{uid_of('a')}/main", True),
    ]
    assert resp.annotations == {
        "tencent.com/vcuda-core": "50",
        "tencent.com/vcuda-memory": str(8 * 256 * MIB),
        "tencent.com/vcuda-device": "/dev/nvidia0",
    }


def test_response_paths_are_normalised_as_paths() -> None:
    gpus, _ = v100x4()
    alloc = ContainerAllocation(uid_of("a"), "main", (2,), 30, GIB, answered_as=(uid_of("b"), "side"))
    for vm in ("/etc/gpu-manager//vm/", "/etc/gpu-manager/vm", "/etc/gpu-manager/./vm"):
        settings = ResponseSettings("/vd/nvidia", "/vd/origin", vm)
        resp = build_response(alloc, gpus, settings)
        assert resp.mounts == (
            Mount("/usr/local/nvidia", "/vd/nvidia", True),
            Mount("/etc/vcuda", f"/etc/gpu-manager/vm/{uid_of('b')}", True),
            Mount("/etc/vcuda/side", f"/etc/gpu-manager/vm/configs/{uid_of('b')}/side", True),
        )
        # The answer's container directory in the answer's pod directory: where the agent writes it.
        assert resp.envs["VCUDA_CONFIG_PATH"] == "/etc/vcuda/side/vcuda.config"
        assert [d.host_path for d in resp.devices] == ["/dev/nvidia2", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    root = build_response(alloc, gpus, ResponseSettings("/vd/nvidia", "/vd/origin", "/"))
    assert root.mounts[1].host_path == f"/{uid_of('b')}"
    assert root.mounts[2].host_path == f"/configs/{uid_of('b')}/side"


def test_whole_gpus_mount_the_untouched_driver_and_compat32(tmp_path: Path) -> None:
    pods = FakePods([make_pod("a", [("main", 200, 0)], env={"compat32": "True"})])
    resp = make_allocator(tmp_path, pods).allocate(core_ids(0, 100) + core_ids(1, 100))
    assert resp.envs["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib"
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-0000,GPU-0001"
    assert resp.mounts[0].host_path == "/etc/gpu-manager/vdriver/origin"
    assert resp.annotations["tencent.com/vcuda-device"] == "/dev/nvidia0,/dev/nvidia1"


def test_predicated_gpu_is_used(tmp_path: Path) -> None:
    pods = FakePods([make_pod("a", [("main", 30, 4)], annotations={"tencent.com/predicate-gpu-idx-0": "3"})])
    alloc = make_allocator(tmp_path, pods)
    assert alloc.allocate(core_ids(0, 30)).annotations["tencent.com/vcuda-device"] == "/dev/nvidia3"


def test_checkpoint_is_written_in_upstreams_format(tmp_path: Path) -> None:
    pods = FakePods([make_pod("a", [("main", 50, 8)]), make_pod("b", [("x", 100, 0)])])
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(0, 50))
    alloc.allocate(core_ids(1, 100))
    alloc.compact()  # the snapshot, upstream's file, is brought up to date in the background
    data = json.loads((tmp_path / "checkpoint" / "gpumanager_internal_checkpoint").read_text())
    assert data["PodGPUMapping"][uid_of("a")]["main"]["Devices"] == ["/dev/nvidia0"]
    assert data["PodGPUMapping"][uid_of("a")]["main"]["Cores"] == 50
    assert data["PodGPUMapping"][uid_of("a")]["main"]["Memory"] == 8 * 256 * MIB
    assert data["PodGPUMapping"][uid_of("b")]["x"]["Cores"] == 100
    assert len(data["PodGPUMapping"][uid_of("b")]["x"]["DeviceIDs"]) == 100


def test_candidates_in_predicate_time_order(tmp_path: Path) -> None:
    late = make_pod("late", [("c", 50, 4)], annotations={"tencent.com/predicate-time": "200"})
    early = make_pod("early", [("c", 50, 4)], annotations={"tencent.com/predicate-time": "100"})
    alloc = make_allocator(tmp_path, FakePods([late, early]))
    alloc.allocate(core_ids(0, 50))
    assert alloc.get(uid_of("early"), "c") is not None
    assert alloc.get(uid_of("late"), "c") is None


def test_containers_in_spec_order_and_count_must_match(tmp_path: Path) -> None:
    pod = make_pod("multi", [("sidecar", 0, 0), ("a", 100, 0), ("b", 50, 4)])
    alloc = make_allocator(tmp_path, FakePods([pod]))
    alloc.allocate(core_ids(0, 50))
    assert alloc.get(uid_of("multi"), "b") is not None
    alloc.allocate(core_ids(1, 100))
    assert alloc.get(uid_of("multi"), "a") is not None


def test_repeated_allocate_gets_the_same_answer_without_taking_more(tmp_path: Path) -> None:
    alloc = make_allocator(tmp_path, FakePods([make_pod("a", [("main", 50, 8)]), make_pod("b", [("m", 50, 8)])]))
    first = alloc.allocate(core_ids(2, 50))
    again = alloc.allocate(list(reversed(core_ids(2, 50))))
    assert again == first
    assert len(alloc.allocations()) == 1


def test_several_identical_pods_get_distinct_correct_allocations(tmp_path: Path) -> None:
    pods = FakePods([make_pod(f"p{i}", [("c", 100, 0)], created=f"2026-11-21T10:00:0{i}Z") for i in range(4)])
    alloc = make_allocator(tmp_path, pods)
    results: list[object] = []

    def one(i: int) -> None:
        results.append(alloc.allocate(core_ids(i, 100)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    allocations = alloc.allocations()
    assert sorted(a.pod_uid for a in allocations) == sorted(uid_of(f"p{i}") for i in range(4))
    assert sorted(m for a in allocations for m in a.minors) == [0, 1, 2, 3]
    with pytest.raises(AllocationError, match="candidate pod not found"):
        alloc.allocate([*core_ids(0, 100)[:99], "tencent.com/vcuda-core-399"])


def test_shares_fill_a_gpu_and_never_overcommit(tmp_path: Path) -> None:
    pods = FakePods([make_pod(f"s{i}", [("c", 40, 4)], created=f"2026-11-21T10:00:{i:02d}Z") for i in range(12)])
    alloc = make_allocator(tmp_path, pods)
    for i in range(8):
        alloc.allocate(core_ids(0, 40, start=i))
    per_gpu: dict[int, int] = {}
    for a in alloc.allocations():
        per_gpu[a.minors[0]] = per_gpu.get(a.minors[0], 0) + a.cores
    assert all(v <= 100 for v in per_gpu.values())
    assert sorted(per_gpu.values()) == [80, 80, 80, 80]


@pytest.mark.parametrize(
    ("containers", "annotations", "share_mode", "message"),
    [
        ([("c", 50, 4)], {"tencent.com/predicate-gpu-idx-0": "x"}, True, "predicate-gpu-idx-0='x'"),
        ([("c", 50, 4)], {"tencent.com/predicate-gpu-idx-0": "9"}, True, "GPU 9, which this node does not have"),
        ([("c", 150, 0)], {}, True, "150 tencent.com/vcuda-core is more than 100 and not a multiple of 100"),
        ([("c", 50, 0)], {}, True, "needs tencent.com/vcuda-memory > 0"),
        ([("c", 50, 200)], {}, True, "request memory 53687091200 bytes is larger than any GPU"),
        ([("c", 50, 4)], {}, False, "--share-mode is off"),
        ([("c", 200, 0)], {"tencent.com/predicate-gpu-idx-0": "1"}, True, "need 2 distinct GPU(s)"),
    ],
)
def test_bad_requests_are_refused_naming_pod_and_value(
    tmp_path: Path, containers: list[tuple[str, int, int]], annotations: dict[str, str], share_mode: bool, message: str
) -> None:
    pods = FakePods([make_pod("bad", containers, annotations=annotations)])
    alloc = make_allocator(tmp_path, pods, share_mode=share_mode)
    with pytest.raises(AllocationError) as err:
        alloc.allocate([f"tencent.com/vcuda-core-{i}" for i in range(containers[0][1])])
    assert message in str(err.value)
    assert "default/bad" in str(err.value)
    assert alloc.allocations() == []
    assert not (tmp_path / "checkpoint" / "gpumanager_internal_checkpoint").exists()


def test_an_allocate_that_succeeds_spells_out_none_of_its_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Describing a whole GPU's 100 IDs for a message sorts them (0.1 ms of each such Allocate): only a
    refusal does it."""
    described: list[int] = []
    real = ids_module.describe

    def counting(device_ids: list[str]) -> str:
        described.append(len(device_ids))
        return real(device_ids)

    monkeypatch.setattr(ids_module, "describe", counting)
    alloc = make_allocator(tmp_path, FakePods([make_pod("whole", [("c", 100, 0)]), make_pod("odd", [("c", 150, 0)])]))
    alloc.allocate(core_ids(1, 100))
    assert described == []
    with pytest.raises(AllocationError, match=r"pod default/odd container c \(150 devices tencent.com/vcuda-core-"):
        alloc.allocate(core_ids(2, 100) + core_ids(3, 50))
    assert described == [150]


def test_predicated_gpu_that_cannot_hold_the_request(tmp_path: Path) -> None:
    first = make_pod("first", [("c", 100, 0)], annotations={"tencent.com/predicate-gpu-idx-0": "2"})
    second = make_pod(
        "second",
        [("c", 50, 4)],
        annotations={"tencent.com/predicate-gpu-idx-0": "2", "tencent.com/predicate-time": "9"},
    )
    alloc = make_allocator(tmp_path, FakePods([first]))
    alloc.allocate(core_ids(2, 100))
    alloc._pods.items.append(second)  # type: ignore[attr-defined]
    with pytest.raises(AllocationError, match=r"predicated GPU 2 cannot hold 50 cores / 1024 MiB: it has 0 cores"):
        alloc.allocate(core_ids(0, 50))


def test_a_gpu_held_by_a_pod_only_the_cache_still_lists_is_freed_by_a_fresh_list(tmp_path: Path) -> None:
    # The scheduler (or its extender) saw the old pod end and placed a new share on its GPU; this
    # node's pod watch has not delivered the deletion yet. The agent asks the API server before refusing.
    old = make_pod("old", [("c", 60, 4)], annotations={"tencent.com/predicate-gpu-idx-0": "2"})
    new = make_pod(
        "new",
        [("c", 60, 4)],
        annotations={"tencent.com/predicate-gpu-idx-0": "2", "tencent.com/predicate-time": "9"},
        created="2026-11-21T11:00:00Z",
    )
    pods = FakePods([old])
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(2, 60))
    pods.items.append(new)
    pods.gone_at_server.add(uid_of("old"))
    resp = alloc.allocate(core_ids(3, 60))
    assert resp.annotations["tencent.com/vcuda-device"] == "/dev/nvidia2"
    assert pods.refreshes == 1
    assert alloc.get(uid_of("old"), "c") is None
    assert [(a.pod_uid, a.minors) for a in alloc.allocations()] == [(uid_of("new"), (2,))]
    # The release is durable like any other: a restart does not bring the old pod back.
    alloc.close()
    again = make_allocator(tmp_path, FakePods([new]))
    again.load()
    assert [a.pod_uid for a in again.allocations()] == [uid_of("new")]


def test_a_gpu_whose_holder_is_alive_is_still_refused_after_the_fresh_list(tmp_path: Path) -> None:
    old = make_pod("old", [("c", 60, 4)], annotations={"tencent.com/predicate-gpu-idx-0": "2"})
    new = make_pod("new", [("c", 60, 4)], annotations={"tencent.com/predicate-gpu-idx-0": "2"})
    pods = FakePods([old])
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(2, 60))
    pods.items.append(new)
    with pytest.raises(AllocationError, match=r"pod default/new .*predicated GPU 2 cannot hold 60 cores") as err:
        alloc.allocate(core_ids(3, 60))
    assert err.value.kind == "exhausted" and pods.refreshes == 1
    pods.refresh_error = TimeoutError("the API server did not answer a pod list within 3 s")
    with pytest.raises(AllocationError, match=r"predicated GPU 2 cannot hold 60 cores.*did not answer") as err:
        alloc.allocate(core_ids(3, 60))
    assert err.value.kind == "exhausted"
    assert [a.pod_uid for a in alloc.allocations()] == [uid_of("old")]


def test_cache_miss_asks_the_api_server_and_outage_is_clear(tmp_path: Path) -> None:
    pods = FakePods()
    pods.hidden = [make_pod("new", [("c", 100, 0)])]
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(0, 100))
    assert pods.refreshes == 1 and alloc.get(uid_of("new"), "c") is not None
    pods.refresh_error = ConnectionError("connection refused")
    with pytest.raises(AllocationError, match="API server cannot be asked: connection refused") as err:
        alloc.allocate(core_ids(1, 100))
    assert err.value.kind == "unavailable"
    assert len(alloc.allocations()) == 1


def test_checkpoint_failure_leaves_no_partial_state(tmp_path: Path) -> None:
    alloc = make_allocator(tmp_path, FakePods([make_pod("a", [("c", 100, 0)])]))
    (tmp_path / "checkpoint").write_text("a file where the directory should be")
    with pytest.raises(AllocationError, match="cannot write checkpoint"):
        alloc.allocate(core_ids(0, 100))
    assert alloc.allocations() == []
    (tmp_path / "checkpoint").unlink()
    alloc.allocate(core_ids(0, 100))
    assert alloc.get(uid_of("a"), "c") is not None
    assert alloc.get(uid_of("a"), "c").minors == (0,)  # type: ignore[union-attr]


def test_release_and_recycle_free_the_gpus(tmp_path: Path) -> None:
    pods = FakePods([make_pod("a", [("c", 100, 0)]), make_pod("b", [("c", 100, 0)], created="2026-11-21T11:00:00Z")])
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(0, 100))
    alloc.allocate(core_ids(1, 100))
    pods.items = [p for p in pods.items if p["metadata"]["name"] != "a"]
    assert alloc.recycle() == [uid_of("a")]
    pods.is_synced = False
    pods.items = []
    assert alloc.recycle() == [], "without a complete view nothing is freed"
    assert [a.pod_uid for a in alloc.allocations()] == [uid_of("b")]


def test_restart_recovers_from_checkpoint(tmp_path: Path) -> None:
    pods = FakePods([make_pod("a", [("c", 60, 4)]), make_pod("b", [("c", 100, 0)], created="2026-11-21T11:00:00Z")])
    first = make_allocator(tmp_path, pods)
    first.allocate(core_ids(0, 60))
    first.allocate(core_ids(1, 100))
    second = make_allocator(tmp_path, pods)
    loaded = second.load()
    assert (len(loaded.allocations), loaded.problems, loaded.untrusted) == (2, [], [])
    assert {(a.pod_uid, a.minors) for a in second.allocations()} == {(a.pod_uid, a.minors) for a in first.allocations()}
    pods.items.append(make_pod("c", [("c", 60, 4)], created="2026-11-21T12:00:00Z"))
    second.allocate(core_ids(2, 60))
    # 60 + 60 cores cannot share one GPU, so the recovered share keeps its GPU to itself.
    assert second.get(uid_of("c"), "c").minors[0] != second.get(uid_of("a"), "c").minors[0]  # type: ignore[union-attr]


def test_corrupt_checkpoint_is_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint" / "gpumanager_internal_checkpoint"
    path.parent.mkdir()
    path.write_text("{not json")
    alloc = make_allocator(tmp_path, FakePods())
    with pytest.raises(AllocationError, match="not valid JSON"):
        alloc.load()
    assert not path.exists()
    assert len(list(path.parent.glob("gpumanager_internal_checkpoint.corrupt-*"))) == 1


@pytest.mark.parametrize("content", ["null", "[]", '"text"', "7"])
def test_checkpoint_that_is_not_an_object_is_unusable_not_empty(tmp_path: Path, content: str) -> None:
    path = tmp_path / "checkpoint" / "gpumanager_internal_checkpoint"
    path.parent.mkdir()
    path.write_text(content)
    with pytest.raises(AllocationError, match="not an object"):
        make_allocator(tmp_path, FakePods()).load()
    assert len(list(path.parent.glob("gpumanager_internal_checkpoint.corrupt-*"))) == 1


def test_untrusted_checkpoint_entries_are_listed_for_rebuild_never_dropped_silently(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint" / "gpumanager_internal_checkpoint"
    path.parent.mkdir()
    u = [uid_of(f"u{i}") for i in range(5)]
    path.write_text(
        json.dumps(
            {
                "PodGPUMapping": {
                    u[0]: {"c": {"Devices": ["/dev/nvidia7"], "Cores": 100, "Memory": 0}},
                    u[1]: {"c": {"Devices": ["/dev/nvidia1"], "Cores": 100, "Memory": 0}},
                    u[2]: {"c": {"Devices": ["/dev/sda"], "Cores": 100, "Memory": 0}},
                    u[3]: {"c": {"Devices": ["/dev/nvidia2"], "Cores": "thirty", "Memory": 0}},
                    "../" + u[4]: {"c": {"Devices": ["/dev/nvidia3"], "Cores": 30, "Memory": 0}},
                }
            }
        )
    )
    alloc = make_allocator(tmp_path, FakePods())
    parsed = alloc.load()
    assert [a.pod_uid for a in alloc.allocations()] == [u[1]]
    assert sorted(parsed.untrusted) == sorted([(u[0], "c"), (u[2], "c"), (u[3], "c"), ("../" + u[4], "c")])
    assert any("/dev/sda" in p for p in parsed.problems)
    assert any("'thirty'" in p for p in parsed.problems)
    assert parsed.salvaged[(u[3], "c")] == (2,)


def test_reused_ids_of_a_started_container_go_to_the_new_pod(tmp_path: Path) -> None:
    pods = FakePods([make_pod("old", [("c", 50, 4)])])
    alloc = make_allocator(tmp_path, pods)
    ids = core_ids(0, 50)
    alloc.allocate(ids)
    alloc.pre_start(ids, (uid_of("old"), "c"))
    # The kubelet freed the old pod's IDs (it was deleted) before the deletion reached the agent,
    # and gives the very same IDs to a new container of the same size.
    pods.items.append(make_pod("new", [("c", 50, 4)], created="2026-11-21T11:00:00Z"))
    answer = alloc.allocate(list(reversed(ids)))
    assert answer.mounts[1].host_path.endswith(uid_of("new"))
    assert alloc.get(uid_of("old"), "c") is None
    alloc.release_pod(uid_of("old"))  # the deletion arrives
    assert alloc.pre_start(ids, (uid_of("new"), "c")).pod_uid == uid_of("new")
    assert sum(a.cores for a in alloc.allocations()) == 50


def test_reused_ids_of_a_gone_pod_are_matched_anew(tmp_path: Path) -> None:
    old = make_pod("old", [("c", 50, 4)])
    pods = FakePods([old])
    alloc = make_allocator(tmp_path, pods)
    ids = core_ids(1, 50)
    alloc.allocate(ids)  # never started: the pod was deleted first
    pods.items = [make_pod("new", [("c", 50, 4)], created="2026-11-21T11:00:00Z")]
    assert alloc.allocate(ids).mounts[1].host_path.endswith(uid_of("new"))
    assert [a.pod_uid for a in alloc.allocations()] == [uid_of("new")]


def test_reused_ids_of_a_running_container_seen_in_the_pod_status(tmp_path: Path) -> None:
    old = make_pod("old", [("c", 50, 4)])
    pods = FakePods([old])
    alloc = make_allocator(tmp_path, pods)
    ids = core_ids(2, 50)
    alloc.allocate(ids)
    old["status"] = {"phase": "Running", "containerStatuses": [{"name": "c", "containerID": "containerd://abc"}]}
    pods.items.append(make_pod("new", [("c", 50, 4)], created="2026-11-21T11:00:00Z"))
    assert alloc.allocate(ids).mounts[1].host_path.endswith(uid_of("new"))


def test_duplicate_ids_are_refused_naming_the_id(tmp_path: Path) -> None:
    alloc = make_allocator(tmp_path, FakePods([make_pod("a", [("c", 3, 4)])]))
    doubled = ["tencent.com/vcuda-core-5", "tencent.com/vcuda-core-6", "tencent.com/vcuda-core-5"]
    with pytest.raises(AllocationError, match=r"device ID tencent\.com/vcuda-core-5 appears more than once"):
        alloc.allocate(doubled)
    assert alloc.allocations() == []


def test_refusals_name_the_device_ids(tmp_path: Path) -> None:
    alloc = make_allocator(tmp_path, FakePods([make_pod("a", [("c", 50, 4)])]))
    with pytest.raises(AllocationError, match=r"tencent\.com/vcuda-core-300") as err:
        alloc.pre_start(core_ids(3, 10), None)
    assert "container the kubelet's records do not name" in str(err.value)
    with pytest.raises(AllocationError, match=r"candidate pod not found for 7 devices tencent\.com/vcuda-core-100"):
        alloc.allocate(core_ids(1, 7))


@pytest.mark.parametrize("bad", ["../other/worker", "Main", "a/b"])
def test_container_names_that_are_not_dns_labels_are_refused(tmp_path: Path, bad: str) -> None:
    alloc = make_allocator(tmp_path, FakePods([make_pod("a", [(bad, 50, 4)])]))
    with pytest.raises(AllocationError, match="is not a DNS label") as err:
        alloc.allocate(core_ids(0, 50))
    assert "default/a" in str(err.value) and "tencent.com/vcuda-core-0" in str(err.value)
    assert alloc.allocations() == []


def test_pod_uids_that_are_not_uuids_are_refused(tmp_path: Path) -> None:
    alloc = make_allocator(tmp_path, FakePods([make_pod("a", [("c", 50, 4)], uid="../../etc")]))
    with pytest.raises(AllocationError, match="is not a UUID"):
        alloc.allocate(core_ids(0, 50))


def test_api_server_is_never_asked_while_the_lock_is_held(tmp_path: Path) -> None:
    known = make_pod("known", [("c", 100, 0)])
    pods = FakePods([known])
    alloc = make_allocator(tmp_path, pods)
    entered, release = threading.Event(), threading.Event()

    def hanging_refresh() -> list[object]:
        entered.set()
        release.wait(10)
        raise TimeoutError("the API server did not answer a pod list within 3 s")

    pods.refresh = hanging_refresh  # type: ignore[method-assign]
    failed: list[Exception] = []

    def unknown() -> None:
        try:
            alloc.allocate(core_ids(0, 30))
        except AllocationError as exc:
            failed.append(exc)

    t = threading.Thread(target=unknown)
    t.start()
    assert entered.wait(5)
    # While a request for an unknown pod waits on the API server, a known pod is served.
    done = threading.Event()
    threading.Thread(target=lambda: (alloc.allocate(core_ids(1, 100)), done.set())).start()
    assert done.wait(5), "Allocate for a known pod waited on the API server"
    assert alloc.tree_snapshot() and alloc.allocations()
    release.set()
    t.join(5)
    assert failed and "did not answer" in str(failed[0])


def test_pre_start_checks_and_repairs_a_swap(tmp_path: Path) -> None:
    a = make_pod("a", [("c", 50, 4)], created="2026-11-21T10:00:00Z")
    b = make_pod("b", [("c", 50, 4)], created="2026-11-21T10:00:01Z")
    alloc = make_allocator(tmp_path, FakePods([a, b]))
    ids_first = core_ids(0, 50)
    alloc.allocate(ids_first)  # matched to a (older)
    got = alloc.pre_start(ids_first, (uid_of("b"), "c"))  # but the kubelet gave those devices to b
    assert got.pod_uid == uid_of("b")
    assert alloc.get(uid_of("a"), "c") is None
    ids_second = core_ids(1, 50)
    alloc.allocate(ids_second)  # a's own Allocate now finds a
    assert alloc.pre_start(ids_second, (uid_of("a"), "c")).pod_uid == uid_of("a")
    assert alloc.pre_start(ids_first, None).pod_uid == uid_of("b")


def test_pre_start_refusals(tmp_path: Path) -> None:
    a = make_pod("a", [("c", 50, 4)])
    big = make_pod("big", [("c", 100, 0)], created="2026-11-21T11:00:00Z")
    alloc = make_allocator(tmp_path, FakePods([a, big]))
    alloc.allocate(core_ids(0, 50))
    with pytest.raises(AllocationError, match="PreStartContainer check failed: no allocation"):
        alloc.pre_start(core_ids(3, 10), None)
    with pytest.raises(AllocationError, match="whose request differs"):
        alloc.pre_start(core_ids(0, 50), (uid_of("big"), "c"))
    assert alloc.get(uid_of("a"), "c") is not None


def test_upstream_checkpoint_without_ids_is_matched_at_prestart(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint" / "gpumanager_internal_checkpoint"
    path.parent.mkdir()
    path.write_text(
        json.dumps({"PodGPUMapping": {uid_of("a"): {"c": {"Devices": ["/dev/nvidia1"], "Cores": 50, "Memory": GIB}}}})
    )
    alloc = make_allocator(tmp_path, FakePods([make_pod("a", [("c", 50, 4)], phase="Running")]))
    alloc.load()
    got = alloc.pre_start(core_ids(3, 50), (uid_of("a"), "c"))
    assert got.minors == (1,) and len(got.device_ids) == 50
    alloc.compact()
    assert "DeviceIDs" in json.loads(path.read_text())["PodGPUMapping"][uid_of("a")]["c"]


def test_generation_moves_with_every_change_and_only_then(tmp_path: Path) -> None:
    pods = FakePods([make_pod("a", [("main", 50, 8)])])
    alloc = make_allocator(tmp_path, pods)
    seen = [alloc.generation]
    alloc.allocations(), alloc.tree_snapshot(), alloc.get(uid_of("a"), "main")
    assert alloc.generation == seen[-1]  # reading changes nothing
    alloc.allocate(core_ids(0, 50))
    seen.append(alloc.generation)
    alloc.pre_start(core_ids(0, 50), (uid_of("a"), "main"))  # the allocation is marked started
    seen.append(alloc.generation)
    alloc.release_pod(uid_of("a"))
    seen.append(alloc.generation)
    assert len(set(seen)) == 4, seen


def test_ids_of_a_pod_deleted_before_it_started_go_to_the_next_pod_while_the_cache_still_shows_it(
    tmp_path: Path,
) -> None:
    """The kubelet failed pod a's admission after our Allocate answered (a restart in between), freed its
    IDs and gave them to b. The pod watch has not delivered a's deletion: the cache still shows a waiting.
    That is not a's Allocate repeated: the API server, asked, no longer has a."""
    pods = FakePods(
        [make_pod("a", [("main", 25, 2)]), make_pod("b", [("main", 25, 2)], created="2026-11-21T10:00:01Z")]
    )
    alloc = make_allocator(tmp_path, pods)
    first = alloc.allocate(core_ids(2, 25))
    assert alloc.get(uid_of("a"), "main") is not None
    pods.gone_at_server.add(uid_of("a"))
    again = alloc.allocate(core_ids(2, 25))
    assert alloc.get(uid_of("a"), "main") is None
    assert alloc.get(uid_of("b"), "main") is not None
    assert again != first


def test_a_repeated_allocate_stays_a_repeat_while_the_api_server_cannot_be_asked(tmp_path: Path) -> None:
    pods = FakePods(
        [make_pod("a", [("main", 25, 2)]), make_pod("b", [("main", 25, 2)], created="2026-11-21T10:00:01Z")]
    )
    alloc = make_allocator(tmp_path, pods)
    first = alloc.allocate(core_ids(2, 25))
    pods.refresh_error = ConnectionError("refused")
    assert alloc.allocate(core_ids(2, 25)) == first
    assert [a.pod_uid for a in alloc.allocations()] == [uid_of("a")]


def test_the_other_containers_of_a_pod_gone_at_the_api_server_are_not_matched_either(tmp_path: Path) -> None:
    """Pod a, gone at the API server but waiting in the cache, has a second container of the same size:
    the IDs given on go to b, not to a's other container."""
    a = make_pod("a", [("c1", 25, 2), ("c2", 25, 2)])
    pods = FakePods([a, make_pod("b", [("main", 25, 2)], created="2026-11-21T10:00:01Z")])
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(2, 25))
    assert alloc.get(uid_of("a"), "c1") is not None
    pods.gone_at_server.add(uid_of("a"))
    alloc.allocate(core_ids(2, 25))
    assert alloc.get(uid_of("b"), "main") is not None
    assert [x.pod_uid for x in alloc.allocations()] == [uid_of("b")]


def test_a_match_among_identical_waiting_pods_names_no_holder_until_the_container_starts(tmp_path: Path) -> None:
    """PreStartContainer asks the kubelet for the pod we expect first: when Allocate had to pick among
    pods waiting with the same request, that expectation is a guess, and it is not offered."""
    pods = FakePods(
        [
            make_pod("a", [("main", 25, 2)]),
            make_pod("b", [("main", 25, 2)], created="2026-11-21T10:00:01Z"),
            make_pod("solo", [("main", 40, 2)], created="2026-11-21T10:00:02Z"),
        ]
    )
    alloc = make_allocator(tmp_path, pods)
    guessed = core_ids(2, 25)
    alloc.allocate(guessed)
    assert alloc.holder_of(guessed) is None
    sure = core_ids(3, 40)
    alloc.allocate(sure)
    assert alloc.holder_of(sure) == ("default", "solo")
    alloc.pre_start(guessed, (uid_of("a"), "main"))
    assert alloc.holder_of(guessed) == ("default", "a")
    last = core_ids(2, 25, start=25)
    alloc.allocate(last)  # b waits alone now
    assert alloc.holder_of(last) == ("default", "b")


def test_the_owner_hint_carries_when_the_ids_allocate_reached_us_through_a_swap_but_not_a_restart(
    tmp_path: Path,
) -> None:
    """PreStartContainer may read the holder of some IDs from a PodResources List made after their
    Allocate reached us: the moment belongs to the IDs, whichever pod they turn out to be."""
    pods = FakePods(
        [make_pod("a", [("main", 25, 2)]), make_pod("b", [("main", 25, 2)], created="2026-11-21T10:00:01Z")]
    )
    alloc = make_allocator(tmp_path, pods)
    first, second = core_ids(2, 25), core_ids(2, 25, start=25)
    before = time.monotonic()
    alloc.allocate(first)
    between = time.monotonic()
    alloc.allocate(second)
    after = time.monotonic()
    hint_first, hint_second = alloc.owner_hint(first), alloc.owner_hint(second)
    assert hint_first.pod is None, "a guess among identical pods is not offered"
    assert hint_first.since is not None and before <= hint_first.since <= between
    assert hint_second.since is not None and between <= hint_second.since <= after
    # The kubelet says b holds the first IDs: the two allocations swap pods, the IDs keep their moments.
    alloc.pre_start(first, (uid_of("b"), "main"))
    assert alloc.get(uid_of("b"), "main") is not None
    assert alloc.owner_hint(first).since == hint_first.since
    assert alloc.owner_hint(second).since == hint_second.since
    assert alloc.owner_hint(core_ids(2, 25, start=50)).since is None, "IDs nobody holds"
    # After a restart nothing is known of when the IDs were asked for.
    restarted = make_allocator(tmp_path, pods)
    restarted.load()
    assert restarted.get(uid_of("b"), "main") is not None
    assert restarted.owner_hint(first).since is None
    # Released: forgotten.
    alloc.release_pod(uid_of("a"))
    assert alloc.owner_hint(second).since is None


def test_gpus_predicated_for_another_node_are_not_used(tmp_path: Path) -> None:
    stale = {
        "tencent.com/predicate-gpu-idx-0": "9",
        "tencent.com/predicate-node": "node-7",
        "tencent.com/gpu-assigned": "false",
    }
    pods = FakePods([make_pod("a", [("main", 30, 4)], annotations=stale)])  # bound to node-1
    alloc = make_allocator(tmp_path, pods)
    assert alloc.allocate(core_ids(0, 30)).annotations["tencent.com/vcuda-device"] == "/dev/nvidia0"


def test_an_allocate_taken_as_a_repeat_moves_the_moment_of_its_ids_on(tmp_path: Path) -> None:
    """A second Allocate of the same IDs taken as a repeat (the API server cannot say whether the first
    pod is gone) may in truth be the kubelet giving them to another pod after failing the first one's
    admission. A PodResources List made between the two Allocates may show the first pod holding them:
    PreStartContainer must not read the holder from it, so the IDs' moment is the newest Allocate's."""
    pods = FakePods(
        [make_pod("a", [("main", 25, 2)]), make_pod("b", [("main", 25, 2)], created="2026-11-21T10:00:01Z")]
    )
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(2, 25))
    pods.refresh_error = ConnectionError("refused")
    between = time.monotonic()
    alloc.allocate(core_ids(2, 25))
    since = alloc.owner_hint(core_ids(2, 25)).since
    assert since is not None and since >= between


def test_a_swap_after_a_guess_is_told_at_info_and_one_after_a_sure_match_at_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Fifty identical pods admitted together make about fifty swaps at PreStartContainer, all expected:
    they are no warning. A swap of a match that was not a guess is."""
    pods = FakePods(
        [make_pod("a", [("main", 25, 2)]), make_pod("b", [("main", 25, 2)], created="2026-11-21T10:00:01Z")]
    )
    alloc = make_allocator(tmp_path, pods)
    guessed = core_ids(2, 25)
    alloc.allocate(guessed)
    caplog.set_level(logging.INFO, logger="gpumanager.allocation.allocator")
    alloc.pre_start(guessed, (uid_of("b"), "main"))
    swaps = [r for r in caplog.records if "swapping the two" in r.getMessage()]
    assert [r.levelno for r in swaps] == [logging.INFO]
    # c waits alone when its Allocate comes: a sure match, which the kubelet then says is d's.
    alloc.release_pod(uid_of("a"))
    alloc.release_pod(uid_of("b"))
    pods.items[:] = [make_pod("c", [("main", 40, 2)], created="2026-11-21T10:00:02Z")]
    sure = core_ids(3, 40)
    alloc.allocate(sure)
    pods.items.append(make_pod("d", [("main", 40, 2)], created="2026-11-21T10:00:03Z"))
    caplog.clear()
    alloc.pre_start(sure, (uid_of("d"), "main"))
    swaps = [r for r in caplog.records if "swapping the two" in r.getMessage()]
    assert [r.levelno for r in swaps] == [logging.WARNING]


def test_an_init_container_leaves_the_gpus_predicated_for_its_pods_other_containers(tmp_path: Path) -> None:
    """The kubelet allocates the init container first and it keeps its GPU while the app container
    allocates: put on the GPU predicated for the app container, it would make that one's Allocate fail."""
    busy = [
        make_pod(f"busy{g}", [("c", 100, 0)], annotations={"tencent.com/predicate-gpu-idx-0": str(g)}) for g in (0, 1)
    ]
    pods = FakePods(busy)
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(0, 100))
    alloc.allocate(core_ids(1, 100))
    for predicated in (2, 3):  # whichever of the two free GPUs the app container was given
        pod = make_pod(
            f"p{predicated}",
            [("app", 100, 0)],
            annotations={"tencent.com/predicate-gpu-idx-0": str(predicated), "tencent.com/predicate-time": "9"},
        )
        limits = {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "8"}
        pod["spec"]["initContainers"] = [{"name": "setup", "resources": {"limits": limits, "requests": limits}}]
        pods.items.append(pod)
        alloc.allocate(core_ids(predicated, 50, start=50))  # the kubelet's IDs say nothing of the GPU
        alloc.allocate(core_ids(predicated, 100))
        got = {a.container: a.minors for a in alloc.allocations_of(uid_of(f"p{predicated}"))}
        assert got == {"setup": (5 - predicated,), "app": (predicated,)}
        pods.items.remove(pod)
        alloc.release_pod(uid_of(f"p{predicated}"))


@pytest.mark.parametrize(
    "spoil",
    [
        lambda p: p["status"].update(containerStatuses=[None]),
        lambda p: p["status"].update(containerStatuses=[{"name": "c0", "state": "odd"}]),
        lambda p: p["spec"]["containers"].append(None),
        lambda p: p["spec"].update(initContainers=[None, 7]),
        lambda p: p["spec"]["containers"][0].update(resources=["limits"]),
        lambda p: p.update(status="Pending"),
        lambda p: p["metadata"].update(annotations=None),
    ],
    ids=[
        "null-status",
        "odd-state",
        "null-container",
        "odd-init-containers",
        "odd-resources",
        "odd-status",
        "null-annotations",
    ],
)
def test_an_odd_pod_object_fails_no_other_pods_allocate(tmp_path: Path, spoil: object) -> None:
    held = make_pod("held", [("c0", 30, 4)])
    pods = FakePods([held])
    alloc = make_allocator(tmp_path, pods)
    first = alloc.allocate(core_ids(0, 30))
    odd = make_pod("odd", [("c0", 50, 4)])
    spoil(odd)  # type: ignore[operator]
    spoil(held)  # type: ignore[operator]
    pods.items.append(odd)
    assert alloc.allocate(core_ids(0, 30)) == first, "the kubelet's repeat of held's Allocate"
    pods.items.append(make_pod("fine", [("c0", 20, 4)]))
    assert alloc.allocate(core_ids(1, 20)).envs["VCUDA_CONFIG_PATH"].endswith("/c0/vcuda.config")
    assert alloc.get(uid_of("fine"), "c0") is not None


def _running(pod: dict[str, object], container: str) -> None:
    pod["status"] = {
        "phase": "Running",
        "containerStatuses": [{"name": container, "containerID": "containerd://0f1e", "state": {"running": {}}}],
    }


def _one_running(tmp_path: Path) -> tuple[Allocator, FakePods, list[str], ContainerResponse]:
    """A node with pod ``run`` (50 cores on GPU 0), allocated, started and running."""
    run = make_pod("run", [("c", 50, 8)])
    pods = FakePods([run])
    alloc = make_allocator(tmp_path, pods)
    ids = core_ids(0, 50)
    first = alloc.allocate(ids)
    alloc.pre_start(ids, (uid_of("run"), "c"))
    _running(run, "c")
    return alloc, pods, ids, first


def test_the_ids_of_a_running_container_again_with_no_other_container_waiting_get_its_own_answer(
    tmp_path: Path,
) -> None:
    # A kubelet that lost its device records asks again for a running container, with the same IDs:
    # nothing else waits for them, so the container keeps its share and gets the same answer.
    alloc, pods, ids, first = _one_running(tmp_path)
    assert alloc.allocate(ids) == first
    assert alloc.get(uid_of("run"), "c") is not None
    assert alloc.tree_snapshot()[0][1] == 50, "GPU 0 must still count the running container's 50 cores"
    restarted = make_allocator(tmp_path, pods)
    restarted.load()
    assert restarted.get(uid_of("run"), "c") is not None, "the share was journaled away"


def test_a_refused_allocate_of_a_running_containers_ids_changes_nothing(tmp_path: Path) -> None:
    alloc, pods, ids, _ = _one_running(tmp_path)
    pods.refresh_error = TimeoutError("the API server did not answer a pod list within 3 s")
    with pytest.raises(AllocationError) as refused:
        alloc.allocate(ids)
    assert refused.value.kind == "unavailable"
    assert alloc.get(uid_of("run"), "c") is not None
    assert alloc.tree_snapshot()[0][1] == 50
    restarted = make_allocator(tmp_path, pods)
    restarted.load()
    assert restarted.get(uid_of("run"), "c") is not None


def test_the_ids_of_a_running_container_go_to_the_container_waiting_for_them(tmp_path: Path) -> None:
    # The container ended (its status not yet told) and the kubelet gave its IDs to a new pod.
    alloc, pods, ids, _ = _one_running(tmp_path)
    pods.items.append(make_pod("next", [("c", 50, 8)]))
    alloc.allocate(ids)
    assert alloc.get(uid_of("run"), "c") is None
    assert alloc.get(uid_of("next"), "c") is not None
    restarted = make_allocator(tmp_path, pods)
    restarted.load()
    assert restarted.get(uid_of("run"), "c") is None and restarted.get(uid_of("next"), "c") is not None


def _init_container(pod: dict[str, object], *inits: tuple[str, int, int]) -> None:
    spec = pod["spec"]
    assert isinstance(spec, dict)
    spec["initContainers"] = [
        {
            "name": name,
            "image": "cuda",
            "resources": {
                "limits": {"tencent.com/vcuda-core": str(cores), "tencent.com/vcuda-memory": str(blocks)},
            },
        }
        for name, cores, blocks in inits
    ]


def test_init_container_ids_handed_on_to_the_next_container_get_that_containers_own_answer(tmp_path: Path) -> None:
    # The kubelet allocates init containers first and gives the same IDs to the next container of the
    # pod asking for as many (devicesToReuse), before any of them starts: each gets its own answer.
    pod = make_pod("p", [("app", 50, 40)])
    _init_container(pod, ("setup", 50, 4), ("warm", 50, 8))
    pods = FakePods([pod])
    alloc = make_allocator(tmp_path, pods)
    ids = core_ids(0, 50)
    answers = [alloc.allocate(ids) for _ in range(3)]
    paths = [a.envs["VCUDA_CONFIG_PATH"] for a in answers]
    assert paths == ["/etc/vcuda/setup/vcuda.config", "/etc/vcuda/warm/vcuda.config", "/etc/vcuda/app/vcuda.config"]
    uid = uid_of("p")
    memory = {c: alloc.get(uid, c).memory for c in ("setup", "warm", "app")}  # type: ignore[union-attr]
    assert memory["setup"] < memory["warm"] < memory["app"]
    assert alloc.allocate(ids) == answers[2], "the kubelet's repeat of the last Allocate"
    assert len(alloc.allocations()) == 3
    # PreStartContainer names no container: whichever of them the kubelet's records name, or none,
    # the start finds a record of these IDs, and every container holding them has its own.
    for owner in [(uid, "app"), (uid, "setup"), None]:
        started = alloc.pre_start(ids, owner)
        assert started.pod_uid == uid
        assert sorted(a.container for a in alloc.holding_same_ids(started)) == ["app", "setup", "warm"]
    restarted = make_allocator(tmp_path, pods)
    restarted.load()
    assert sorted(a.container for a in restarted.allocations()) == ["app", "setup", "warm"]
    assert restarted.allocate(ids).envs["VCUDA_CONFIG_PATH"] == "/etc/vcuda/app/vcuda.config"


def test_an_init_containers_ids_again_with_no_later_container_waiting_repeat_its_answer(tmp_path: Path) -> None:
    pod = make_pod("p", [("app", 30, 4)])
    _init_container(pod, ("setup", 50, 4))
    pods = FakePods([pod])
    alloc = make_allocator(tmp_path, pods)
    first = alloc.allocate(core_ids(0, 50))
    assert alloc.allocate(core_ids(0, 50)) == first
    assert [a.container for a in alloc.allocations()] == ["setup"]


def test_a_container_handed_its_init_containers_ids_shares_its_charge(tmp_path: Path) -> None:
    # The two never run together: the pod holds the larger of each on the init container's GPU, as the
    # kubelet counts their IDs once. The rest of the GPU stays free for other pods.
    pod = make_pod("p", [("app", 60, 8)])
    _init_container(pod, ("setup", 60, 4))
    pods = FakePods([pod])
    alloc = make_allocator(tmp_path, pods)
    total = alloc.tree_snapshot()[0][3]
    ids = core_ids(0, 60)
    alloc.allocate(ids)
    alloc.allocate(ids)
    uid = uid_of("p")
    setup, app = alloc.get(uid, "setup"), alloc.get(uid, "app")
    assert setup is not None and app is not None and setup.minors == app.minors
    gpu = setup.minors[0]
    assert alloc.tree_snapshot()[gpu][1:3] == (40, total - app.memory), "counted twice"
    restarted = make_allocator(tmp_path, pods)
    restarted.load()
    assert restarted.tree_snapshot()[gpu][1:3] == (40, total - app.memory)
    alloc.release_pod(uid)
    assert alloc.tree_snapshot()[gpu][1:3] == (100, total)


def test_a_container_the_scheduler_placed_keeps_a_charge_of_its_own_beside_its_init_container(
    tmp_path: Path,
) -> None:
    # GPU 2 has room for the app container only: the init container goes elsewhere.
    other = make_pod("other", [("c", 50, 4)], annotations={"tencent.com/predicate-gpu-idx-0": "2"})
    pods = FakePods([other])
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(3, 50))
    pod = make_pod("p", [("app", 50, 8)], annotations={"tencent.com/predicate-gpu-idx-0": "2"})
    _init_container(pod, ("setup", 50, 4))
    pods.items.append(pod)
    ids = core_ids(0, 50)
    alloc.allocate(ids)
    alloc.allocate(ids)
    setup, app = alloc.get(uid_of("p"), "setup"), alloc.get(uid_of("p"), "app")
    assert setup is not None and app is not None
    assert app.minors == (2,) and setup.minors != (2,)
    assert sum(100 - free for _, free, *_ in alloc.tree_snapshot()) == 150, "each holds its own 50 cores"


def _tree_as_rebuilt(alloc: object, tmp_path: Path, pods: FakePods) -> None:
    """The live tree equals one rebuilt from the checkpoint: no charge drifted."""
    import shutil

    copy = tmp_path / f"rebuilt-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(tmp_path / "checkpoint", copy / "checkpoint")
    rebuilt = make_allocator(copy, FakePods(list(pods.items)))
    rebuilt.load()
    assert alloc.tree_snapshot() == rebuilt.tree_snapshot()  # type: ignore[attr-defined]
    assert sorted(a.key for a in alloc.allocations()) == sorted(a.key for a in rebuilt.allocations())  # type: ignore[attr-defined]


def test_a_prestart_swap_moving_one_of_an_init_pair_keeps_the_charges(tmp_path: Path) -> None:
    # Two identical pods with an init container each; the kubelet admits b, the order matches a.
    a = make_pod("a", [("app", 50, 4)], created="2026-11-21T10:00:00Z")
    b = make_pod("b", [("app", 50, 4)], created="2026-11-21T10:00:01Z")
    _init_container(a, ("setup", 50, 4))
    _init_container(b, ("setup", 50, 4))
    pods = FakePods([a, b])
    alloc = make_allocator(tmp_path, pods)
    ids = core_ids(0, 50)
    alloc.allocate(ids)
    alloc.allocate(ids)
    _tree_as_rebuilt(alloc, tmp_path, pods)
    alloc.pre_start(ids, (uid_of("b"), "setup"))
    _tree_as_rebuilt(alloc, tmp_path, pods)
    alloc.pre_start(ids, (uid_of("b"), "app"))
    _tree_as_rebuilt(alloc, tmp_path, pods)
    alloc.release_pod(uid_of("b"))
    _tree_as_rebuilt(alloc, tmp_path, pods)


def test_a_running_container_sharing_its_init_containers_ids_asked_for_again_keeps_them(tmp_path: Path) -> None:
    pod = make_pod("p", [("app", 50, 16)])
    _init_container(pod, ("setup", 50, 4))
    pods = FakePods([pod])
    alloc = make_allocator(tmp_path, pods)
    ids = core_ids(0, 50)
    alloc.allocate(ids)
    app = alloc.allocate(ids)
    alloc.pre_start(ids, (uid_of("p"), "setup"))
    alloc.pre_start(ids, (uid_of("p"), "app"))
    _running(pod, "app")
    assert alloc.allocate(ids) == app
    assert sorted(a.container for a in alloc.allocations()) == ["app", "setup"]
    _tree_as_rebuilt(alloc, tmp_path, pods)


def test_a_sidecars_ids_are_its_own(tmp_path: Path) -> None:
    # An init container with restartPolicy Always runs beside the others: the kubelet hands its IDs
    # on to nobody, so the same IDs again are its own Allocate repeated.
    pod = make_pod("p", [("app", 50, 16)])
    _init_container(pod, ("side", 50, 4))
    pod["spec"]["initContainers"][0]["restartPolicy"] = "Always"
    pods = FakePods([pod])
    alloc = make_allocator(tmp_path, pods)
    first = alloc.allocate(core_ids(0, 50))
    assert alloc.allocate(core_ids(0, 50)) == first
    assert alloc.allocate(core_ids(1, 50)).envs["VCUDA_CONFIG_PATH"] == "/etc/vcuda/app/vcuda.config"


def test_init_container_ids_handed_on_in_a_pod_known_only_from_a_fresh_list(tmp_path: Path) -> None:
    pod = make_pod("p", [("app", 50, 16)])
    _init_container(pod, ("setup", 50, 4))
    pods = FakePods([])
    pods.refresh_fills_cache = False
    pods.hidden = [pod]
    alloc = make_allocator(tmp_path, pods)
    ids = core_ids(0, 50)
    alloc.allocate(ids)
    assert alloc.allocate(ids).envs["VCUDA_CONFIG_PATH"] == "/etc/vcuda/app/vcuda.config"
    assert sorted(a.container for a in alloc.allocations()) == ["app", "setup"]
    pods.show_hidden()
    assert alloc.pre_start(ids, (uid_of("p"), "setup")).container == "setup"


def test_a_repeated_allocate_of_a_pod_known_only_from_a_fresh_list_is_a_repeat(tmp_path: Path) -> None:
    pod = make_pod("q", [("c0", 50, 4), ("c1", 50, 4)])
    pods = FakePods([])
    pods.refresh_fills_cache = False
    pods.hidden = [pod]
    alloc = make_allocator(tmp_path, pods)
    first = alloc.allocate(core_ids(0, 50))
    assert alloc.allocate(core_ids(0, 50)) == first
    alloc.allocate(core_ids(1, 50))
    assert sorted(a.container for a in alloc.allocations()) == ["c0", "c1"]


def test_an_init_pair_on_a_whole_gpu_is_no_overcommit_at_load(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pod = make_pod("p", [("app", 100, 0)])
    _init_container(pod, ("setup", 100, 0))
    pods = FakePods([pod])
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(0, 100))
    alloc.allocate(core_ids(0, 100))
    restarted = make_allocator(tmp_path, pods)
    with caplog.at_level(logging.ERROR):
        restarted.load()
    assert "more than 100" not in caplog.text
    assert len(restarted.allocations()) == 2


def test_a_pod_recreated_under_the_same_name_keeps_its_own_record_at_prestart(tmp_path: Path) -> None:
    # The kubelet names pods, not UIDs: the owner of the new pod's IDs comes back as the old pod's UID
    # while the cache still shows the old pod. No swap into the old pod's running container.
    old = make_pod("p", [("c0", 50, 4)], uid="aaaaaaaa-0000-4000-8000-000000000001")
    new = make_pod("p", [("c0", 50, 4)], uid="bbbbbbbb-0000-4000-8000-000000000002")
    pods = FakePods([old])
    pods.refresh_fills_cache = False
    alloc = make_allocator(tmp_path, pods)
    first, second = core_ids(0, 50), core_ids(1, 50)
    alloc.allocate(first)
    alloc.pre_start(first, (old["metadata"]["uid"], "c0"))
    _running(old, "c0")
    pods.gone_at_server.add(old["metadata"]["uid"])
    pods.hidden = [new]
    alloc.allocate(second)
    started = alloc.pre_start(second, (old["metadata"]["uid"], "c0"))
    assert started.pod_uid == new["metadata"]["uid"]
    held = {a.pod_uid: a.device_ids for a in alloc.allocations()}
    assert held == {old["metadata"]["uid"]: tuple(first), new["metadata"]["uid"]: tuple(second)}


def test_prestart_never_hands_a_started_containers_record_other_ids(tmp_path: Path) -> None:
    pods = FakePods([make_pod("a", [("c", 50, 4)]), make_pod("b", [("c", 50, 4)], created="2026-11-21T11:00:00Z")])
    alloc = make_allocator(tmp_path, pods)
    mine, theirs = core_ids(0, 50), core_ids(1, 50)
    alloc.allocate(mine)
    alloc.pre_start(mine, (uid_of("a"), "c"))
    alloc.allocate(theirs)
    with pytest.raises(AllocationError) as swapped:
        alloc.pre_start(theirs, (uid_of("a"), "c"))  # a kubelet record naming a's started container
    assert swapped.value.kind == "mismatch" and "has started with" in str(swapped.value)
    with pytest.raises(AllocationError) as unknown:
        alloc.pre_start(core_ids(2, 50), (uid_of("a"), "c"))
    assert unknown.value.kind == "not_found"
    assert {a.pod_uid: a.device_ids for a in alloc.allocations()} == {
        uid_of("a"): tuple(mine),
        uid_of("b"): tuple(theirs),
    }
