"""A model of the kubelet driving the allocator as the agent's device-plugin handlers do, through random
sequences from fixed seeds: pods created in one order (the order the agent's queue sees them wait in) and
admitted in another, identical pods, init containers whose IDs the kubelet hands on to the app container,
deletions before and after a start, container restarts, PreStartContainer refused and retried.

The kubelet's Allocate carries only device IDs and its PreStartContainer the IDs and (from its records)
the container holding them (either of a pod's containers holding the same IDs), as the real one does. A
refused Allocate fails the pod's admission (its IDs free again); a refused start is tried again. After
every step:

- no GPU holds more cores or memory than it has, counting every container the kubelet runs, with the
  GPUs and budget its start was answered with;
- every started container runs with the answer it got at Allocate: the GPUs of that answer, its own
  request's budget, written (PreStartContainer writes the limit files of every record holding the IDs)
  in the directory that answer mounts, which no other running container uses.

Then every admitted container is started: one whose start is refused must be refused for want of room
on its GPU (an allocation matched to an identical pod whose room went to another container meanwhile),
and start once the pods running there are deleted. Once every pod is deleted nothing is held.
``ALLOCATION_MODEL_SEEDS`` (a count, or ``a-b``) runs other seeds than the committed ones, and
``ALLOCATION_MODEL_LOG`` shows that many of the last steps of a failing one.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from gpumanager import names
from gpumanager.allocation.allocator import AllocationError, Allocator
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.allocation.response import ContainerResponse
from tests.alloc_fixtures import FakePods, make_allocator, uid_of

GPUS = 4
GPU_MEMORY = 32768 << 20  # v100x4 in tests.alloc_fixtures
BLOCKS_PER_GPU = GPU_MEMORY // names.MEMORY_BLOCK_BYTES
CORE_IDS = [f"{names.VCORE_RESOURCE}-{i}" for i in range(GPUS * names.HUNDRED_CORES)]
# A few shapes only, so that many pods are identical: (cores, memory blocks) of the app container, and
# of an init container asking for the same (its IDs handed on) or none.
SHAPES: list[tuple[int, int]] = [(50, 4), (30, 4), (20, 8), (40, 2), (100, 0), (10, 1)]


@dataclass
class KContainer:
    """One container as the kubelet sees it."""

    name: str
    cores: int
    blocks: int
    init: bool
    ids: frozenset[str] = frozenset()
    blocks_held: int = 0
    answer: tuple[tuple[str, str], frozenset[int]] | None = None  # (directory, GPU minors) of its Allocate answer
    running: ContainerAllocation | None = None  # what its last start was answered with
    done: bool = False  # an init container that ran to its end


@dataclass
class KPod:
    name: str
    uid: str
    containers: list[KContainer]
    admitted: bool = False
    obj: dict[str, Any] = field(default_factory=dict)


def _pod_object(name: str, containers: list[KContainer], created: str) -> dict[str, Any]:
    def spec(c: KContainer) -> dict[str, Any]:
        limits = {names.VCORE_RESOURCE: str(c.cores)}
        if c.blocks:
            limits[names.VMEMORY_RESOURCE] = str(c.blocks)
        return {"name": c.name, "image": "cuda", "resources": {"limits": limits, "requests": limits}}

    body: dict[str, Any] = {"nodeName": "node-1", "containers": [spec(c) for c in containers if not c.init]}
    inits = [spec(c) for c in containers if c.init]
    if inits:
        body["initContainers"] = inits
    return {
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": uid_of(name),
            "annotations": {},
            "creationTimestamp": created,
        },
        "spec": body,
        "status": {"phase": "Pending"},
    }


def _answer_of(response: ContainerResponse) -> tuple[tuple[str, str], frozenset[int]]:
    mount = next(m.host_path for m in response.mounts if m.container_path == names.VCUDA_MOUNTPOINT)
    config = PurePosixPath(response.envs[names.VCUDA_CONFIG_ENV])
    uuids = [u for u in response.envs.get("NVIDIA_VISIBLE_DEVICES", "").split(",") if u]
    return (PurePosixPath(mount).name, config.parent.name), frozenset(int(u.split("-")[1]) for u in uuids)


class Kubelet:
    """The kubelet's device manager, admission and container starts, over one agent's allocator."""

    def __init__(self, rng: random.Random, alloc: Allocator, pods: FakePods) -> None:
        self.rng = rng
        self.alloc = alloc
        self.api = pods
        self.pods: dict[str, KPod] = {}  # created, not deleted
        self.free_ids = set(CORE_IDS)
        self.free_blocks = GPUS * BLOCKS_PER_GPU
        self.created = 0
        self.log: list[str] = []
        self.refusals: dict[tuple[str, str], str] = {}  # the last refusal of each container's start

    # -- steps -------------------------------------------------------------------------------------

    def create(self) -> None:
        self.created += 1
        name = f"p{self.created}"
        cores, blocks = self.rng.choice(SHAPES)
        containers = [KContainer("main", cores, blocks, False)]
        if self.rng.random() < 0.25:
            containers.insert(0, KContainer("setup", cores, blocks, True))
        obj = _pod_object(name, containers, f"2026-11-21T10:{self.created // 60:02d}:{self.created % 60:02d}Z")
        self.pods[name] = KPod(name, uid_of(name), containers, obj=obj)
        self.api.items.append(obj)
        self.log.append(f"create {name} {[(c.name, c.cores, c.blocks) for c in containers]}")

    def admit(self) -> None:
        waiting = [p for p in self.pods.values() if not p.admitted]
        if not waiting:
            return
        pod = self.rng.choice(waiting)  # not the order they wait in
        need = max(c.cores for c in pod.containers)
        blocks = max(c.blocks for c in pod.containers)
        if need > len(self.free_ids) or blocks > self.free_blocks:
            self.log.append(f"admit {pod.name}: no room at the kubelet")
            return
        reuse: set[str] = set()
        reuse_blocks = 0
        taken: set[str] = set()
        taken_blocks = 0
        for c in pod.containers:  # init containers come first
            ids = set(self.rng.sample(sorted(reuse), min(len(reuse), c.cores)))
            more = c.cores - len(ids)
            fresh = set(self.rng.sample(sorted(self.free_ids - taken), more))
            ids |= fresh
            taken |= fresh
            c.ids = frozenset(ids)
            c.blocks_held = c.blocks
            taken_blocks += max(0, c.blocks - reuse_blocks)
            if c.init:
                reuse |= ids
                reuse_blocks = max(reuse_blocks, c.blocks)
            else:
                reuse -= ids
                reuse_blocks = max(0, reuse_blocks - c.blocks)
        self.free_ids -= taken
        self.free_blocks -= taken_blocks
        pod.admitted = True
        for c in pod.containers:
            try:
                c.answer = _answer_of(self.alloc.allocate(sorted(c.ids)))
                self.log.append(f"allocate {pod.name}/{c.name}: {sorted(c.answer[1])} {c.answer[0]}")
            except AllocationError as exc:
                # Admission fails: the kubelet rejects the pod (Failed), its IDs free again.
                self.log.append(f"admit {pod.name}/{c.name}: refused: {exc}")
                self.delete(pod.name, why="rejected")
                return
        self.log.append(f"admit {pod.name} {[(c.name, sorted(c.ids)[:1], len(c.ids)) for c in pod.containers]}")

    def start(self, pod: KPod, c: KContainer) -> bool:
        holders = [o for o in pod.containers if o.ids == c.ids and not o.done]
        named = self.rng.choice(holders) if holders else c
        try:
            started = self.alloc.pre_start(sorted(c.ids), (pod.uid, named.name))
        except AllocationError as exc:
            self.log.append(f"start {pod.name}/{c.name}: refused: {exc}")
            self.refusals[(pod.uid, c.name)] = str(exc)
            return False
        # The agent writes the limit files of every record holding these IDs (the kubelet does not say
        # which of them starts): the container reads the one in the directory its answer mounts.
        assert c.answer is not None
        written = {r.answered: r for r in [started, *self.alloc.holding_same_ids(started)]}
        config = written.get(c.answer[0])
        self.log.append(f"start {pod.name}/{c.name} (named {named.name}): {started.minors} {started.answered}")
        assert config is not None, f"{pod.name}/{c.name} started: no vcuda.config in {c.answer[0]} ({sorted(written)})"
        c.running = config
        return True

    def step_start(self) -> None:
        ready = []
        for pod in self.pods.values():
            if not pod.admitted:
                continue
            inits = [c for c in pod.containers if c.init and not c.done]
            if inits:
                if inits[0].running is None:
                    ready.append((pod, inits[0]))
                continue
            ready.extend((pod, c) for c in pod.containers if not c.init and c.running is None)
        if ready:
            self.start(*self.rng.choice(ready))

    def finish_init(self) -> None:
        running = [(p, c) for p in self.pods.values() for c in p.containers if c.init and c.running and not c.done]
        if running:
            pod, c = self.rng.choice(running)
            c.done, c.running = True, None
            self.log.append(f"init {pod.name}/{c.name} ended")

    def restart(self) -> None:
        running = [(p, c) for p in self.pods.values() for c in p.containers if not c.init and c.running]
        if running:
            pod, c = self.rng.choice(running)
            c.running = None
            if not self.start(pod, c):
                self.log.append(f"restart {pod.name}/{c.name}: not started again yet")

    def delete(self, name: str, why: str = "deleted") -> None:
        pod = self.pods.pop(name)
        if pod.admitted:
            held: set[str] = set()
            for c in pod.containers:
                held |= c.ids
            self.free_ids |= held
            self.free_blocks += (
                max((c.blocks for c in pod.containers if c.init), default=0)
                + sum(c.blocks for c in pod.containers if not c.init)
                - self._reused_blocks(pod)
            )
        self.api.items = [p for p in self.api.items if p["metadata"]["uid"] != pod.uid]
        self.alloc.release_pod(pod.uid)
        self.log.append(f"{why} {name}")

    def _name_of(self, uid: str) -> str:
        return next((p.name for p in self.pods.values() if p.uid == uid), uid[:8])

    @staticmethod
    def _reused_blocks(pod: KPod) -> int:
        """Blocks the app containers took from their init containers (counted once by the kubelet)."""
        reuse = 0
        reused = 0
        for c in pod.containers:
            if c.init:
                reuse = max(reuse, c.blocks)
            else:
                got = min(reuse, c.blocks)
                reused += got
                reuse -= got
        return reused

    def delete_some(self) -> None:
        if self.pods:
            self.delete(self.rng.choice(sorted(self.pods)))

    # -- checks ------------------------------------------------------------------------------------

    def check(self) -> None:
        """The invariants, after a step."""
        cores = [0] * GPUS
        memory = [0] * GPUS
        dirs: dict[tuple[str, str], str] = {}
        for pod in self.pods.values():
            for c in pod.containers:
                if c.running is None:
                    continue
                got = c.running
                assert c.answer is not None
                where = f"{pod.name}/{c.name}"
                assert got.answered == c.answer[0], f"{where} mounts {c.answer[0]}, its config is at {got.answered}"
                assert frozenset(got.minors) == c.answer[1], f"{where} sees GPUs {c.answer[1]}, budget on {got.minors}"
                assert got.cores == c.cores, f"{where} asks for {c.cores} cores, its config says {got.cores}"
                if c.cores < names.HUNDRED_CORES:
                    assert got.memory == c.blocks * names.MEMORY_BLOCK_BYTES, f"{where}: memory {got.memory}"
                other = dirs.get(got.answered)
                assert other is None, f"{where} and {other} share the vcuda.config of {got.answered}"
                dirs[got.answered] = where
                for minor in got.minors:
                    cores[minor] += min(got.cores, names.HUNDRED_CORES)
                    memory[minor] += GPU_MEMORY if got.cores >= names.HUNDRED_CORES else got.memory
        over = {
            m: (cores[m], memory[m] >> 20)
            for m in range(GPUS)
            if cores[m] > names.HUNDRED_CORES or memory[m] > GPU_MEMORY
        }
        assert not over, f"GPUs over capacity (cores, MiB) with the containers running: {over}: " + "; ".join(
            f"{p.name}/{c.name} on {c.running.minors} {c.running.cores}c {c.running.memory >> 20}MiB"
            for p in self.pods.values()
            for c in p.containers
            if c.running is not None and set(c.running.minors) & set(over)
        )

    def drain(self) -> None:
        """Start every admitted container; one whose start waits for room (the agent refuses to start it
        beyond its GPU's capacity) starts once the pods running there are deleted."""
        for _ in range(4 * len(self.pods) + 4):
            waiting: list[tuple[KPod, KContainer]] = []
            for pod in list(self.pods.values()):
                if not pod.admitted:
                    continue
                for c in pod.containers:
                    if c.running is not None and c.init:
                        c.done, c.running = True, None
                    if c.done or c.running is not None:
                        continue
                    if c.init and any(o.init and not o.done for o in pod.containers[: pod.containers.index(c)]):
                        continue
                    if not self.start(pod, c):
                        waiting.append((pod, c))
                    elif c.init:
                        c.done, c.running = True, None
                self.check()
            if not waiting:
                return
            for pod, c in waiting:
                refusal = self.refusals.get((pod.uid, c.name), "")
                assert "cannot start yet" in refusal, f"{pod.name}/{c.name} refused: {refusal}"
            # Delete a pod running on a GPU the first waiting container wants.
            pod, c = waiting[0]
            assert c.answer is not None
            on_it = sorted(
                p.name
                for p in self.pods.values()
                if p is not pod and any(o.running and set(o.running.minors) & c.answer[1] for o in p.containers)
            )
            assert on_it, f"{pod.name}/{c.name} is refused though nothing runs on GPUs {sorted(c.answer[1])}"
            self.delete(on_it[0])
        raise AssertionError("containers still wait after the pods running beside them were deleted")


def _run(seed: int, steps: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    pods = FakePods()
    alloc = make_allocator(tmp_path / f"s{seed}", pods)
    kubelet = Kubelet(rng, alloc, pods)
    actions = [
        (kubelet.create, 4),
        (kubelet.admit, 4),
        (kubelet.step_start, 4),
        (kubelet.finish_init, 1),
        (kubelet.restart, 1),
        (kubelet.delete_some, 2),
    ]
    weights = [w for _, w in actions]
    try:
        for _ in range(steps):
            rng.choices(actions, weights)[0][0]()
            kubelet.check()
        kubelet.drain()
        for name in sorted(kubelet.pods):
            kubelet.delete(name)
            kubelet.check()
        alloc.recycle()
        assert not alloc.allocations(), [a.key for a in alloc.allocations()]
        free = alloc.tree_snapshot()
        assert all(cores == names.HUNDRED_CORES and left == total for _, cores, left, total, _ in free), free
    except AssertionError as exc:
        shown = int(os.environ.get("ALLOCATION_MODEL_LOG", "40"))  # the last steps, in the message
        raise AssertionError(f"seed {seed}: {exc}\n" + "\n".join(kubelet.log[-shown:])) from exc
    finally:
        alloc.close()


# Seeds beyond the first 200 that broke an invariant once, run with them (each has a deterministic case:
# tests/test_model_seeds_review9.py, tests/test_model_seed<seed>_review10.py):
# - 1377: the records of a pod's IDs (its init container's, handed on) split between two pods, one of
#   them that pod, were not gathered when its init container started (the kubelet naming its app
#   container): its vcuda.config was written elsewhere than the directory it mounts.
FIXED: list[int] = [1377]


def _seeds() -> list[int]:
    wanted = os.environ.get("ALLOCATION_MODEL_SEEDS", "")
    if not wanted:
        return list(range(200)) + FIXED
    if "-" in wanted:
        low, high = wanted.split("-", 1)
        return list(range(int(low), int(high) + 1))
    return list(range(int(wanted)))


@pytest.mark.parametrize("seed", _seeds())
def test_a_random_kubelet_never_over_commits_a_gpu(seed: int, tmp_path: Path) -> None:
    """No GPU runs beyond its capacity, every started container reads its own budget, none waits for
    ever, nothing leaks."""
    _run(seed, 150, tmp_path)
