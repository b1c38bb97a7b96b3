"""Two pods asking for the same vcuda-core but different vcuda-memory, admitted by the kubelet in another
order than their predicate times: the vcuda-core Allocate carries only core IDs, so each call is matched to
the other pod. At PreStartContainer each takes over the allocation of the IDs the kubelet gave it (its
GPUs, its answer's directory) with its own memory budget, when those GPUs have room for it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from gpumanager.allocation.allocator import AllocationError, Allocator
from gpumanager.allocation.journal import read_document
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.vmanager import files
from simnode.cluster import SimCluster, admission_annotations, gpu_pod
from simnode.mounts import host_path
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of

MIB = 1 << 20
BLOCK = 256 * MIB
GPU_BLOCKS = 128  # the fixture's V100s: 32 GiB


def _notes(t: int, gpu: int) -> dict[str, str]:
    return {
        f"{names.PREDICATE_GPU_IDX_PREFIX}0": str(gpu),
        names.PREDICATE_NODE: "node-1",
        names.PREDICATE_TIME: str(t),
        names.GPU_ASSIGNED: "false",
    }


def _pods(*extra: dict[str, Any]) -> FakePods:
    """x (4 blocks, chosen first: the smaller predicate time) and y (8 blocks), both 50 cores."""
    x = make_pod("x", [("main", 50, 4)], annotations=_notes(1_000, 0), created="2026-11-21T10:00:00Z")
    y = make_pod("y", [("main", 50, 8)], annotations=_notes(2_000, 1), created="2026-11-21T10:00:01Z")
    return FakePods([*extra, x, y])


def _record(alloc: Allocator, name: str) -> ContainerAllocation:
    record = alloc.get(uid_of(name), "main")
    assert record is not None, f"pod {name} has no allocation"
    return record


def _memory_by_gpu(alloc: Allocator, *, started_only: bool) -> dict[int, int]:
    held: dict[int, int] = {}
    for record in alloc.allocations():
        if started_only and not record.started:
            continue
        for minor in record.minors:
            held[minor] = held.get(minor, 0) + record.memory
    return held


def _fits(alloc: Allocator, *, started_only: bool = False) -> None:
    """No GPU holds more memory than it has: in the records, or (``started_only``) in the started containers."""
    held = _memory_by_gpu(alloc, started_only=started_only)
    over = {m: b // BLOCK for m, b in held.items() if b > GPU_BLOCKS * BLOCK}
    assert not over, f"GPUs charged beyond their memory (blocks): {over}"


def test_each_pod_starts_with_its_own_budget_when_the_first_starts_before_the_second_allocate(tmp_path: Path) -> None:
    """The kubelet admits y first (X, matched to x) and starts it before admitting x (Y, then matched to
    x again). Both starts were refused, at every try ('their requests differ'): neither pod ever ran."""
    pods = _pods()
    alloc = make_allocator(tmp_path, pods)
    first, second = core_ids(2, 50), core_ids(3, 50)
    alloc.allocate(first)
    given_x = _record(alloc, "x")
    started_y = alloc.pre_start(first, (uid_of("y"), "main"))
    assert started_y.key == (uid_of("y"), "main")
    assert started_y.memory == 8 * BLOCK, "y's vcuda.config holds y's own budget"
    assert started_y.minors == given_x.minors, "y runs on the GPUs of the answer the kubelet gave it"
    assert started_y.answered == given_x.answered, "y mounts the directory of the answer it got"
    assert alloc.get(uid_of("x"), "main") is None, "x waits for its own Allocate"
    alloc.allocate(second)
    started_x = alloc.pre_start(second, (uid_of("x"), "main"))
    assert started_x.key == (uid_of("x"), "main")
    assert started_x.memory == 4 * BLOCK
    assert frozenset(started_x.device_ids) == frozenset(second)
    assert started_x.answered != started_y.answered
    _fits(alloc)


def test_each_pod_starts_with_its_own_budget_when_both_are_allocated_first(tmp_path: Path) -> None:
    """Both Allocates, then y's start with X (matched to x) and x's with Y (matched to y); the records
    survive a restart as started, each with its own memory and the directory of its own answer."""
    pods = _pods()
    alloc = make_allocator(tmp_path, pods)
    first, second = core_ids(2, 50), core_ids(3, 50)
    alloc.allocate(first)
    alloc.allocate(second)
    answer_of_first = _record(alloc, "x").answered
    answer_of_second = _record(alloc, "y").answered
    gpus_of_first, gpus_of_second = _record(alloc, "x").minors, _record(alloc, "y").minors
    started_y = alloc.pre_start(first, (uid_of("y"), "main"))
    assert (started_y.memory, started_y.minors, started_y.answered) == (8 * BLOCK, gpus_of_first, answer_of_first)
    waiting_x = _record(alloc, "x")
    assert (waiting_x.memory, waiting_x.minors, waiting_x.started) == (4 * BLOCK, gpus_of_second, False)
    started_x = alloc.pre_start(second, (uid_of("x"), "main"))
    assert (started_x.memory, started_x.minors, started_x.answered) == (4 * BLOCK, gpus_of_second, answer_of_second)
    assert started_x.started
    _fits(alloc)
    restarted = make_allocator(tmp_path, pods)
    restarted.load()
    for name, memory, answered in (("x", 4, answer_of_second), ("y", 8, answer_of_first)):
        record = _record(restarted, name)
        assert (record.memory, record.answered, record.started) == (memory * BLOCK, answered, True)
    # Restarted from the journal alone as from a compacted snapshot.
    restarted.compact()
    again = make_allocator(tmp_path, pods)
    again.load()
    assert {r.key: r.memory for r in again.allocations()} == {
        (uid_of("x"), "main"): 4 * BLOCK,
        (uid_of("y"), "main"): 8 * BLOCK,
    }


def _full_gpu_pods() -> tuple[FakePods, str]:
    """A started pod w holding 50 cores and 122 blocks of GPU 0, where x (4 blocks) fits and y (8) does not."""
    w = make_pod("w", [("main", 50, GPU_BLOCKS - 6)], annotations=_notes(500, 0), created="2026-11-21T09:00:00Z")
    return _pods(w), uid_of("w")


def test_a_start_without_room_for_its_budget_waits_and_starts_once_room_frees(tmp_path: Path) -> None:
    """y's start with X (GPU 0, matched to x) would put 128 blocks beside w's 122: refused, naming y, its
    container, the GPU and the figures, not as 'PreStartContainer check failed' (which fails the pod). x
    starts with Y; y starts once w has ended."""
    pods, w = _full_gpu_pods()
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(0, 50))
    alloc.pre_start(core_ids(0, 50), (w, "main"))
    first, second = core_ids(0, 50, start=50), core_ids(1, 50)
    alloc.allocate(first)
    assert _record(alloc, "x").minors == (0,)
    alloc.allocate(second)
    with pytest.raises(AllocationError) as refused:
        alloc.pre_start(first, (uid_of("y"), "main"))
    text = str(refused.value)
    assert refused.value.kind == "unavailable"
    assert not text.startswith(names.PRESTART_FAILED)
    for part in (uid_of("y"), "container main", "GPU 0", f"{8 * 256} MiB", f"{6 * 256} MiB"):
        assert part in text, f"{part!r} not in {text!r}"
    _fits(alloc)
    started_x = alloc.pre_start(second, (uid_of("x"), "main"))
    assert (started_x.memory, started_x.minors) == (4 * BLOCK, (1,))
    # y's record is now of the IDs the kubelet gave it, on GPU 0, with its own budget: its start waits for
    # room among the containers started there.
    waiting_y = _record(alloc, "y")
    assert (waiting_y.memory, waiting_y.minors, waiting_y.started) == (8 * BLOCK, (0,), False)
    assert frozenset(waiting_y.device_ids) == frozenset(first)
    _fits(alloc, started_only=True)
    with pytest.raises(AllocationError) as again:
        alloc.pre_start(first, (uid_of("y"), "main"))
    assert again.value.kind == "unavailable"
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != w]
    alloc.release_pod(w)
    started_y = alloc.pre_start(first, (uid_of("y"), "main"))
    assert (started_y.memory, started_y.minors) == (8 * BLOCK, (0,))
    _fits(alloc)


def test_a_refused_start_changes_no_record(tmp_path: Path) -> None:
    """y's start refused for want of room (x not allocated its own IDs yet) leaves x's allocation as it
    was, in memory and across a restart."""
    pods, _ = _full_gpu_pods()
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(0, 50))
    alloc.pre_start(core_ids(0, 50), (uid_of("w"), "main"))
    first = core_ids(0, 50, start=50)
    alloc.allocate(first)
    before = sorted((r.key, r.memory, r.minors, r.started) for r in alloc.allocations())
    with pytest.raises(AllocationError):
        alloc.pre_start(first, (uid_of("y"), "main"))
    assert sorted((r.key, r.memory, r.minors, r.started) for r in alloc.allocations()) == before
    restarted = make_allocator(tmp_path, pods)
    restarted.load()
    assert sorted((r.key, r.memory, r.minors, r.started) for r in restarted.allocations()) == before


def test_a_pod_given_the_ids_of_a_deleted_pod_of_another_memory_size_starts_with_its_own_budget(
    tmp_path: Path,
) -> None:
    """y is admitted first (X, matched to x); x is deleted before y starts: y's start with X takes over the
    freed allocation (its GPUs, its answer's directory) with y's own budget. It was refused ('no
    allocation', which fails the pod)."""
    pods = _pods()
    alloc = make_allocator(tmp_path, pods)
    first = core_ids(2, 50)
    alloc.allocate(first)
    given = _record(alloc, "x")
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != uid_of("x")]
    alloc.release_pod(uid_of("x"))
    started = alloc.pre_start(first, (uid_of("y"), "main"))
    assert started.key == (uid_of("y"), "main")
    assert (started.memory, started.minors, started.answered) == (8 * BLOCK, given.minors, given.answered)
    restarted = make_allocator(tmp_path, pods)
    restarted.load()
    record = _record(restarted, "y")
    assert (record.memory, record.started, record.answered) == (8 * BLOCK, True, given.answered)


def test_a_freed_allocation_without_room_for_the_budget_waits_for_room(tmp_path: Path) -> None:
    """As above, with w holding 122 blocks of GPU 0: y's start is refused until w ends (nothing changes
    meanwhile; the freed allocation stays remembered), then y starts there with its own budget."""
    pods, w = _full_gpu_pods()
    alloc = make_allocator(tmp_path, pods)
    alloc.allocate(core_ids(0, 50))
    alloc.pre_start(core_ids(0, 50), (w, "main"))
    first = core_ids(0, 50, start=50)
    alloc.allocate(first)
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != uid_of("x")]
    alloc.release_pod(uid_of("x"))
    for _ in range(2):
        with pytest.raises(AllocationError) as refused:
            alloc.pre_start(first, (uid_of("y"), "main"))
        assert refused.value.kind == "unavailable"
        for part in (uid_of("y"), "container main", "GPU 0", f"{8 * 256} MiB", f"{6 * 256} MiB"):
            assert part in str(refused.value), f"{part!r} not in {str(refused.value)!r}"
        assert alloc.get(uid_of("y"), "main") is None
    pods.items = [p for p in pods.items if p["metadata"]["uid"] != w]
    alloc.release_pod(w)
    started = alloc.pre_start(first, (uid_of("y"), "main"))
    assert (started.memory, started.minors) == (8 * BLOCK, (0,))
    _fits(alloc)


def test_through_the_agent_each_pod_runs_with_its_own_budget_in_the_directory_its_answer_mounts(
    tmp_path: Path, sim_built: Path
) -> None:
    """On the simulated node: x (4 blocks, predicate time 1000, GPU 0) and y (8 blocks, 2000, GPU 1) wait;
    the kubelet admits y first, then x, and starts both. Each vcuda.config, in the directory its answer
    mounts, holds its own pod and budget; the checkpoint records each pod's own memory."""
    with SimCluster(tmp_path, "v100-pcie-x4") as cluster:
        x = cluster.create(gpu_pod("x", [("main", 50, 4)], annotations=admission_annotations([[0]], 1000)))
        y = cluster.create(gpu_pod("y", [("main", 50, 8)], annotations=admission_annotations([[1]], 2000)))
        runs = {"x": cluster.runs[str(x["metadata"]["uid"])], "y": cluster.runs[str(y["metadata"]["uid"])]}
        deadline = time.monotonic() + 10
        while not all((cluster.vm_path / r.uid).is_dir() for r in runs.values()):  # the agent's pod cache has both
            assert time.monotonic() < deadline, "the agent never saw the pods"
            time.sleep(0.05)
        cluster.admit(y, create=False)
        cluster.admit(x, create=False)
        for name in ("y", "x"):
            cluster.start_containers(runs[name])
        mapping = (read_document(cluster.checkpoint_dir / names.OWN_CHECKPOINT) or {})["PodGPUMapping"]
        for name, blocks in (("x", 4), ("y", 8)):
            run = runs[name]
            response = run.core["main"].response
            config = files.unpack(host_path(response.mounts, response.envs[names.VCUDA_CONFIG_ENV]).read_bytes())
            assert (config.pod_uid, config.gpu_memory, config.utilization) == (run.uid, blocks * BLOCK, 50), name
            assert mapping[run.uid]["main"]["Memory"] == blocks * BLOCK
            gpus = {int(i.rsplit("-", 1)[1]) // 100 for i in run.core["main"].device_ids}
            assert mapping[run.uid]["main"]["Devices"] == [f"/dev/nvidia{g}" for g in sorted(gpus)]


def _with_init(name: str, blocks: int, second: int) -> dict[str, Any]:
    """A pod whose init container and app container ask for 50 cores and ``blocks`` blocks each."""
    pod = make_pod(name, [("app", 50, blocks)], created=f"2026-11-21T10:00:0{second}Z")
    limits = {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": str(blocks)}
    pod["spec"]["initContainers"] = [{"name": "setup", "image": "cuda", "resources": {"limits": limits}}]
    return pod


@pytest.mark.parametrize("room", [True, False])
def test_a_pod_whose_init_container_handed_its_ids_on_takes_both_over_with_its_budget(
    tmp_path: Path, room: bool
) -> None:
    """q (8 blocks) is admitted while p (4 blocks, first in line) waits: both of q's Allocates (the init
    container's IDs handed on) are matched to p's containers. q's start takes both over with its own budget;
    where the GPU has no room for it, the start is refused and no record changes (none half swapped)."""
    q = uid_of("q")
    held = [] if room else [make_pod("w", [("main", 50, GPU_BLOCKS - 6)], created="2026-11-21T09:00:00Z")]
    pods = FakePods([*held, _with_init("p", 4, 0), _with_init("q", 8, 1)])
    alloc = make_allocator(tmp_path, pods)
    if not room:
        alloc.allocate(core_ids(0, 50))
        alloc.pre_start(core_ids(0, 50), (uid_of("w"), "main"))
    ids = core_ids(0, 50, start=50)
    alloc.allocate(ids)
    alloc.allocate(ids)
    before = sorted((r.key, r.memory, r.minors, r.answered) for r in alloc.allocations())
    if not room:
        with pytest.raises(AllocationError) as refused:
            alloc.pre_start(ids, (q, "setup"))
        assert refused.value.kind == "unavailable"
        assert sorted((r.key, r.memory, r.minors, r.answered) for r in alloc.allocations()) == before
        return
    for name in ("setup", "app"):
        started = alloc.pre_start(ids, (q, name))
        assert started.pod_uid == q
    records = {r.key: r for r in alloc.allocations()}
    assert sorted(records) == [(q, "app"), (q, "setup")]
    assert {r.memory for r in records.values()} == {8 * BLOCK}
    _fits(alloc)


@pytest.mark.parametrize(
    ("source", "cache_late"), [("kubelet checkpoint", False), ("kubelet checkpoint", True), ("PodResources", False)]
)
def test_a_restart_between_the_allocate_and_the_start_keeps_each_pods_own_budget(
    tmp_path: Path, source: str, cache_late: bool
) -> None:
    """The agent restarts after the kubelet gave X (matched to x) to y, before y starts. Its records come
    back from the kubelet's: its checkpoint holds our answer (x's GPUs, directory and memory); PodResources
    only the IDs (y's request read from its pod). y takes over x's allocation, never kept beside it (its
    GPU charged twice, x holding IDs it never got), and starts with its own budget, also when the pod cache
    shows y only after the records are read (``cache_late``); x, allocated next, starts with its own."""
    pods = _pods()
    alloc = make_allocator(tmp_path, pods)
    first, second = core_ids(2, 50), core_ids(3, 50)
    alloc.allocate(first)
    matched = _record(alloc, "x")
    alloc.close()
    restarted = make_allocator(tmp_path, pods)
    restarted.load()
    answered = source == "kubelet checkpoint"
    held = ContainerAllocation(
        pod_uid=uid_of("y"),
        container="main",
        minors=matched.minors,
        cores=50,
        memory=matched.memory if answered else 8 * BLOCK,  # the answer's annotation, or y's request
        device_ids=tuple(first),
        namespace="default",
        pod_name="y",
        container_index=0,
        answered_as=matched.answered if answered else ("", ""),
    )
    if cache_late:
        y_pod = next(p for p in pods.items if p["metadata"]["uid"] == uid_of("y"))
        pods.items.remove(y_pod)
    assert restarted.adopt([held], source=source, kubelet_holds=True, answered=answered) == 1
    if cache_late:
        pods.items.append(y_pod)
    assert [r.key for r in restarted.allocations()] == [(uid_of("y"), "main")], "x's allocation was taken over"
    started_y = restarted.pre_start(first, (uid_of("y"), "main"))
    assert (started_y.memory, started_y.minors, started_y.answered) == (8 * BLOCK, matched.minors, matched.answered)
    restarted.allocate(second)
    started_x = restarted.pre_start(second, (uid_of("x"), "main"))
    assert (started_x.memory, frozenset(started_x.device_ids)) == (4 * BLOCK, frozenset(second))
    _fits(restarted)
    again = make_allocator(tmp_path, pods)
    again.load()
    assert {r.key: (r.memory, r.started) for r in again.allocations()} == {
        (uid_of("x"), "main"): (4 * BLOCK, True),
        (uid_of("y"), "main"): (8 * BLOCK, True),
    }
