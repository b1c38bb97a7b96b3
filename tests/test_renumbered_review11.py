"""A node reboots and one GPU is no longer found: the driver numbers the GPUs after it one lower (their
minors, ``/dev/nvidia<N>``, and NVML indices), in device-plugin mode.

The kubelet keeps each container's device IDs (vcuda-core IDs in the range of the GPU's place, which
stays with the GPU by UUID) and its saved Allocate answer, whose device node names the GPU's minor as it
was. The checkpoint records allocations by minor too. After the renumbering:

- each allocation stays charged to the GPU its device IDs name (the GPU it was computed for), not to the
  GPU that now has the recorded minor, nor to the lost GPU that took a free minor;
- a container whose saved device node now reaches another GPU (or no GPU) is refused at
  PreStartContainer, naming both GPUs and the device node; it never runs on a GPU that does not count it;
- /metrics and /usage name each allocation's GPU by its UUID; ListAndWatch advertises every place's IDs,
  the lost GPU's Unhealthy."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpumanager import names
from gpumanager.vmanager import files
from simnode.cluster import PodRun, SimCluster, admission_annotations, gpu_pod
from simnode.kubelet import AllocationError, PluginRPCError
from tests.battery_fixtures import answered, gpu, http_get, write_spec

BLOCK = names.MEMORY_BLOCK_BYTES
SHARES = {1: (30, 4), 2: (50, 8), 3: (70, 12)}  # place -> (cores, memory blocks)


def _spec(path: Path, gpus: list[dict[str, Any]]) -> Path:
    return write_spec(path, gpus, lambda i, j: "PHB")


def _core_ids_of(place: int) -> set[str]:
    return {f"{names.VCORE_ID_PREFIX}{n}" for n in range(place * 100, place * 100 + 100)}


def _restart_with(cluster: SimCluster, path: Path, gpus: list[dict[str, Any]]) -> None:
    assert cluster.agent is not None
    cluster.agent.signal(signal.SIGKILL)
    cluster.agent.wait()
    cluster.spec = _spec(path, gpus)
    cluster.start_agent()
    cluster.kubelet.wait_for_devices(names.VCORE_RESOURCE, lambda d: len(d) == 400, timeout=30)


def _refusal(cluster: SimCluster, run: PodRun) -> PluginRPCError:
    with pytest.raises(PluginRPCError) as caught:
        cluster.start_containers(run)
    return caught.value


def _allocated_by_uuid(cluster: SimCluster) -> dict[str, tuple[int, int]]:
    """UUID -> (cores, memory bytes) the agent's /metrics says are allocated."""
    _, body = http_get(cluster, "/metrics")
    out: dict[str, list[int]] = {}
    for line in body.splitlines():
        for i, metric in enumerate(("gpu_manager_gpu_core_allocated_ratio", "gpu_manager_gpu_memory_allocated_bytes")):
            if line.startswith(metric + "{"):
                labels, value = line[len(metric) + 1 :].rsplit("} ", 1)
                uuid = labels.split('uuid="', 1)[1].split('"', 1)[0]
                out.setdefault(uuid, [0, 0])[i] = round(float(value) * (100 if i == 0 else 1))
    return {u: (c, m) for u, (c, m) in out.items()}


@pytest.fixture
def renumbered(tmp_path: Path) -> Any:
    """4 GPUs of 16 GiB; a share on each of GPUs 1, 2 and 3 (30, 50 and 70 cores; 1, 2 and 3 GiB); the node
    reboots without GPU 1: GPU 2 is /dev/nvidia1 now, GPU 3 /dev/nvidia2."""
    full = [gpu(i, memory_mib=16384) for i in range(4)]
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "four.json", full))
    with cluster:
        runs = {
            i: cluster.run_pod(
                gpu_pod(f"p{i}", [("main", SHARES[i][0], SHARES[i][1])], annotations=admission_annotations([[i]], 1))
            )
            for i in (1, 2, 3)
        }
        for i, run in runs.items():
            assert answered(run)["main"][0] == (i,)
        after = [full[0], dict(full[2], minor=1), dict(full[3], minor=2)]
        _restart_with(cluster, tmp_path / "three.json", after)
        yield cluster, full, runs


def _assert_charged_by_place(cluster: SimCluster, full: list[dict[str, Any]], extra: int = 0) -> None:
    got = _allocated_by_uuid(cluster)
    for i, (cores, blocks) in SHARES.items():
        assert got.get(full[i]["uuid"]) == (cores, blocks * BLOCK), (i, got)
    assert got.get(full[0]["uuid"]) == (extra, extra and 4 * BLOCK), got


def test_allocations_stay_charged_to_the_gpu_their_ids_name(renumbered: Any) -> None:
    cluster, full, _ = renumbered
    _assert_charged_by_place(cluster, full)


def test_a_second_agent_restart_keeps_the_charges(renumbered: Any, tmp_path: Path) -> None:
    """The agent restarts again (no reboot: the GPUs numbered as after it): the records, written again with
    the minors of now, are not moved a second time."""
    cluster, full, runs = renumbered
    _restart_with(cluster, tmp_path / "three-again.json", [full[0], dict(full[2], minor=1), dict(full[3], minor=2)])
    _assert_charged_by_place(cluster, full)
    err = _refusal(cluster, runs[2])
    assert full[3]["uuid"] in err.details and "/dev/nvidia2" in err.details, err.details


def test_usage_names_each_allocation_by_its_gpu(renumbered: Any) -> None:
    cluster, full, runs = renumbered
    status, body = http_get(cluster, "/usage")
    assert status == 200, body
    doc = json.loads(body)
    for i in (2, 3):
        devs = doc["usage"][runs[i].uid]["stat"]["main"].get("dev", [])
        assert [(d["id"], d["card_idx"]) for d in devs] == [(full[i]["pci_bus_id"], str(i))], (i, doc)
    assert not doc["usage"][runs[1].uid]["stat"]["main"].get("dev"), doc  # the lost GPU: no device to show


def test_a_restart_whose_device_node_reaches_another_gpu_is_refused(renumbered: Any) -> None:
    cluster, full, runs = renumbered
    err = _refusal(cluster, runs[2])  # /dev/nvidia2 is GPU 3 now
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION, err
    for part in ("default/p2", "container main", full[2]["uuid"], full[3]["uuid"], "/dev/nvidia2", "delete the pod"):
        assert part in err.details, (part, err.details)
    # The reason is the renumbering, not a replacement: GPU 2 is the same GPU, at /dev/nvidia1 now.
    assert "replaced" not in err.details and "numbered otherwise" in err.details, err.details
    assert "/dev/nvidia1" in err.details, err.details
    err = _refusal(cluster, runs[1])  # GPU 1 is lost; /dev/nvidia1 is GPU 2 now
    for part in ("default/p1", full[1]["uuid"], full[2]["uuid"], "no longer counted", "delete the pod"):
        assert part in err.details, (part, err.details)
    assert "replaced" not in err.details, err.details
    err = _refusal(cluster, runs[3])  # /dev/nvidia3 is no GPU now
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION, err
    for part in ("default/p3", full[3]["uuid"], "/dev/nvidia3", "delete the pod"):
        assert part in err.details, (part, err.details)
    assert "replaced" not in err.details and "numbered otherwise" in err.details, err.details


def test_list_and_watch_keeps_every_place_only_the_lost_gpu_unhealthy(renumbered: Any) -> None:
    cluster, _, _ = renumbered
    cluster.kubelet.wait_for_devices(
        names.VCORE_RESOURCE,
        lambda d: {i for i, x in d.items() if not x.healthy} == _core_ids_of(1),
        timeout=30,
    )
    assert set(cluster.kubelet.devices(names.VCORE_RESOURCE)) == set().union(*map(_core_ids_of, range(4)))


def test_new_pods_never_overcommit_the_renumbered_gpus(renumbered: Any) -> None:
    """With p2 and p3 held (50 and 70 cores on GPUs 2 and 3), a new 60-core share fits only GPU 0
    (/dev/nvidia0); the charges of the others stay. (The shares were placed by gpu-admission: the kubelet
    gave them IDs anywhere, so the IDs of the new share need not be GPU 0's.)"""
    cluster, full, _ = renumbered
    new = cluster.run_pod(gpu_pod("n0", [("main", 60, 4)]))
    assert answered(new)["main"][0] == (0,), answered(new)
    got = _allocated_by_uuid(cluster)
    for uuid, (cores, memory) in got.items():
        assert cores <= 100 and memory <= 16 << 30, (uuid, got)
    for i, (cores, blocks) in SHARES.items():
        assert got.get(full[i]["uuid"]) == (cores, blocks * BLOCK), (i, got)


def test_the_gpu_found_again_at_the_next_reboot(renumbered: Any, tmp_path: Path) -> None:
    """The next reboot finds GPU 1 again: the driver numbers the GPUs as at first. The records follow their
    GPUs back (charged by place), and each container's saved answer reaches its own GPU again. A share
    answered while GPU 2 was /dev/nvidia1 stays charged to GPU 2, and its start (its saved /dev/nvidia1 is
    GPU 1 again) is refused, naming both GPUs."""
    cluster, full, runs = renumbered
    late = cluster.run_pod(gpu_pod("late", [("main", 40, 4)], annotations=admission_annotations([[1]], 2)))
    assert answered(late)["main"][0] == (1,)  # GPU 2, /dev/nvidia1 then
    assert cluster.agent is not None
    cluster.agent.signal(signal.SIGKILL)
    cluster.agent.wait()
    cluster.spec = _spec(tmp_path / "four-again.json", full)
    cluster.start_agent()
    cluster.kubelet.wait_for_devices(
        names.VCORE_RESOURCE, lambda d: len(d) == 400 and all(x.healthy for x in d.values()), timeout=30
    )
    got = _allocated_by_uuid(cluster)
    assert got.get(full[2]["uuid"]) == (SHARES[2][0] + 40, (SHARES[2][1] + 4) * BLOCK), got
    for i in (1, 3):
        assert got.get(full[i]["uuid"]) == (SHARES[i][0], SHARES[i][1] * BLOCK), (i, got)
    err = _refusal(cluster, late)
    for part in (
        "default/late",
        full[2]["uuid"],
        full[1]["uuid"],
        "/dev/nvidia1",
        "/dev/nvidia2",
        "numbered otherwise",
    ):
        assert part in err.details, (part, err.details)
    assert "replaced" not in err.details, err.details
    _, body = http_get(cluster, "/usage")
    doc = json.loads(body)
    for i in (1, 2, 3):
        devs = doc["usage"][runs[i].uid]["stat"]["main"].get("dev", [])
        assert [(d["id"], d["card_idx"]) for d in devs] == [(full[i]["pci_bus_id"], str(i))], (i, doc)
    # Each saved answer's device node reaches the container's own GPU again: every start succeeds, with
    # the budget it was answered with, and no line calls its GPU replaced or renumbered.
    for i in (1, 2, 3):
        cluster.start_containers(runs[i])
        config = files.unpack(
            (cluster.vm_path / "configs" / runs[i].uid / "main" / names.VCUDA_CONFIG_FILE).read_bytes()
        )
        assert (config.utilization, config.gpu_memory) == (SHARES[i][0], SHARES[i][1] * BLOCK), (i, config)
    tail = cluster.agent.log_text().split("serving 4 GPUs")[-1]
    refused = [line for line in tail.splitlines() if "PreStartContainer refused" in line and "default/late" not in line]
    assert not refused, refused


def test_records_rebuilt_from_the_kubelets_answers_follow_their_gpus(tmp_path: Path) -> None:
    """Our checkpoint is gone at the renumbered start: the allocations rebuilt from the kubelet's saved
    answers (which name the minors of then) are charged by place too, and their starts refused."""
    full = [gpu(i, memory_mib=16384) for i in range(4)]
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "four.json", full))
    with cluster:
        runs = {
            i: cluster.run_pod(
                gpu_pod(f"p{i}", [("main", SHARES[i][0], SHARES[i][1])], annotations=admission_annotations([[i]], 1))
            )
            for i in (1, 2, 3)
        }
        assert cluster.agent is not None
        cluster.agent.signal(signal.SIGKILL)
        cluster.agent.wait()
        for path in (tmp_path / "node" / "checkpoint").glob(names.OWN_CHECKPOINT + "*"):
            path.unlink()
        cluster.spec = _spec(tmp_path / "three.json", [full[0], dict(full[2], minor=1), dict(full[3], minor=2)])
        cluster.start_agent()
        cluster.kubelet.wait_for_devices(names.VCORE_RESOURCE, lambda d: len(d) == 400, timeout=30)
        _assert_charged_by_place(cluster, full)
        err = _refusal(cluster, runs[2])
        assert full[3]["uuid"] in err.details and "/dev/nvidia2" in err.details, err.details


# ---- the allocation state alone ----------------------------------------------------------------------------


def _renumbered_allocator(tmp_path: Path, pods: Any, moved: dict[int, int]) -> Any:
    """The allocator of a start after GPU 1 of four was no longer found: GPUs 2 and 3 are minors 1 and 2,
    the lost GPU 1 is counted with minor 3; ``moved``: the minors of the records to move (empty at a later
    start, when the saved inventory says the minors of now)."""
    from dataclasses import replace as _replace

    from gpumanager.allocation.allocator import Allocator, AllocatorSettings
    from gpumanager.allocation.response import ResponseSettings
    from gpumanager.topology import build_tree
    from tests.alloc_fixtures import v100x4

    gpus, topo = v100x4()
    gpus = [_replace(g, minor={0: 0, 1: 3, 2: 1, 3: 2}[g.index]) for g in gpus]
    tree = build_tree(gpus, topo)
    tree.set_healthy(1, False)
    allocator = Allocator(
        gpus=gpus,
        tree=tree,
        pods=pods,
        settings=AllocatorSettings(
            share_mode=True,
            response=ResponseSettings(
                vdriver_nvidia="/etc/gpu-manager/vdriver/nvidia",
                vdriver_origin="/etc/gpu-manager/vdriver/origin",
                virtual_manager_path="/etc/gpu-manager/vm",
            ),
        ),
        checkpoint_path=tmp_path / "checkpoint" / names.OWN_CHECKPOINT,
    )
    allocator.renumbered = dict(moved)
    return allocator


def test_remembered_freed_allocations_follow_their_gpu_once(tmp_path: Path) -> None:
    """An allocation freed before its container started (kept in the checkpoint for a container the kubelet
    may have given its IDs) names its GPU by minor too: it follows its GPU at the renumbered start, and
    the state is written so, so that the next start (no move: the inventory says the minors of now) finds
    it on the same GPU, not on the GPU that has its old minor."""
    from gpumanager.allocation.allocator import Allocator
    from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of

    def crash(alloc: Allocator) -> None:
        alloc._closing.set()
        alloc._store.close()

    whole = [make_pod(f"x{g}", [("main", 100, 0)], created=f"2026-11-21T09:00:0{g}Z") for g in range(3)]
    pods = FakePods(
        [*whole, *(make_pod(n, [("main", 50, 4)], created=f"2026-11-21T10:00:0{i}Z") for i, n in enumerate("ab"))]
    )
    before = make_allocator(tmp_path, pods)
    before.load()
    for g in range(3):  # GPUs 0, 1 and 2 taken whole: the share goes to GPU 3
        before.allocate(core_ids(g, 100))
    ids = core_ids(3, 50)
    before.allocate(ids)  # the kubelet admits b; matched to a (first in line)
    guessed = before.get(uid_of("a"), "main")
    assert guessed is not None
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != uid_of("a")]
    before.release_pod(uid_of("a"))
    crash(before)
    assert guessed.minors == (3,), guessed.minors
    now_minor = {0: 0, 1: 3, 2: 1, 3: 2}
    want = tuple(now_minor[m] for m in guessed.minors)

    after = _renumbered_allocator(tmp_path, pods, {1: 3, 2: 1, 3: 2})
    after.load()
    assert [a.minors for same in after._freed_guesses.values() for a in same] == [want]
    crash(after)
    again = _renumbered_allocator(tmp_path, pods, {})
    try:
        again.load()
        assert [a.minors for same in again._freed_guesses.values() for a in same] == [want]
    finally:
        again.close()


def test_shares_placed_after_the_renumbering_never_overcommit(tmp_path: Path) -> None:
    """Shares placed by the agent on GPUs 0-3 (60 cores each); GPU 0's pod ends; the node reboots without
    GPU 1. Four new 40-core shares fit (GPU 0 twice, GPUs 2 and 3 once each); each is answered with the
    device node of a live GPU, no GPU is over-committed, and a fifth finds no room."""
    full = [gpu(i, memory_mib=16384) for i in range(4)]
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "four.json", full))
    with cluster:
        live = [cluster.run_pod(gpu_pod(f"p{i}", [("main", 60, 8)])) for i in range(4)]
        placed = {answered(r)["main"][0][0]: r for r in live}
        assert sorted(placed) == [0, 1, 2, 3], placed
        cluster.delete(placed[0], wait=True)
        _restart_with(cluster, tmp_path / "three.json", [full[0], dict(full[2], minor=1), dict(full[3], minor=2)])
        for n in range(4):
            run = cluster.run_pod(gpu_pod(f"n{n}", [("main", 40, 4)]))
            assert answered(run)["main"][0][0] in (0, 1, 2), answered(run)
        got = _allocated_by_uuid(cluster)
        assert got[full[1]["uuid"]] == (60, 8 * BLOCK), got  # the lost GPU keeps its pod's charge
        for uuid, (cores, memory) in got.items():
            assert cores <= 100 and memory <= 16 << 30, (uuid, got)
        assert sum(c for c, _ in got.values()) == 3 * 60 + 4 * 40, got
        with pytest.raises(AllocationError):  # 20 cores left on GPU 0, none on GPUs 2 and 3
            cluster.run_pod(gpu_pod("n4", [("main", 40, 4)]))


def test_after_an_agent_restart_a_shares_ids_name_the_gpu_it_is_answered_with(tmp_path: Path) -> None:
    """No renumbering: GPUs 1-3 hold 60-core shares, GPU 0 is free; after an agent restart (which rebuilds
    the deleted pod's record from the kubelet's checkpoint, then frees it, its room held while the kubelet
    may still hold its IDs) a 40-core share's IDs, taken at the agent's preference, name the GPU it is
    answered with: the kubelet offering the freed IDs as available tells that it holds them for nobody."""
    full = [gpu(i, memory_mib=16384) for i in range(4)]
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "four.json", full))
    with cluster:
        live = [cluster.run_pod(gpu_pod(f"p{i}", [("main", 60, 8)])) for i in range(4)]
        placed = {answered(r)["main"][0][0]: r for r in live}
        cluster.delete(placed[0], wait=True)
        _restart_with(cluster, tmp_path / "same.json", full)
        run = cluster.run_pod(gpu_pod("n0", [("main", 40, 4)]))
        (minor,) = answered(run)["main"][0]
        places = sorted({int(i.rsplit("-", 1)[1]) // 100 for i in run.core["main"].device_ids})
        assert places == [minor], (minor, places)
