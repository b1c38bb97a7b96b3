"""Chaos: the real agent under pod churn while it, the kubelet and the API server fail at random moments.

Pods of many shapes (shares of various cores and memory, identical pods of a Deployment created together
and admitted in any order, whole GPUs, init containers) are admitted, started, restarted and deleted
(before and after their start) through the kubelet simulator while, at random moments, the agent is
killed (SIGKILL) or stopped (SIGTERM) and started again, the kubelet restarts, and the API server hangs
for a while or answers errors. After every step:

* no GPU's started containers hold more cores or memory than it has;
* every started container's vcuda.config, in the directory its answer mounts, carries its own pod's
  budget, and no two running containers share a directory;
* /metrics and the display API (/usage) answer.

At the end every admitted container starts (none refused for ever), the agent's figures equal the
live containers', and once all pods are gone nothing is held (checkpoint, gauges, directories); every
GPU can then be taken whole; the agent never logged a traceback.

One round runs by default (fixed seed); ``GM_CHAOS_ROUNDS=N`` runs N rounds with the seeds after it.
The seed is in every failure message.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from types import SimpleNamespace
from typing import Any

import pytest

from gpumanager import names
from gpumanager.allocation.journal import read_document
from gpumanager.vmanager import files
from simnode.cluster import PodRun, SimCluster, gpu_pod
from simnode.kubelet import KubeletSimError
from tests.battery_fixtures import (
    agent_allocated,
    assert_no_overcommit,
    held,
    http_get,
    memory_of,
    spec_a100_pcie_x2,
)

ROUNDS = int(os.environ.get("GM_CHAOS_ROUNDS", "1"))
STEPS = int(os.environ.get("GM_CHAOS_STEPS", "45"))
SPEC = "v100-pcie-x4"


class Chaos:
    """One round: the cluster, the pods started (live) and admitted but not started (pending)."""

    def __init__(self, cluster: SimCluster, seed: int) -> None:
        self.c = cluster
        self.seed = seed
        self.rng = random.Random(seed)
        self.live: list[PodRun] = []
        self.pending: list[PodRun] = []
        self.mem = memory_of(cluster)
        self.n = 0
        self.events: list[str] = []
        self.last_refusal: dict[str, str] = {}  # pod UID -> why its last start failed
        self.later: list[threading.Timer] = []  # deletions the API server did not take at once

    def why(self, what: str) -> str:
        return f"seed {self.seed}: {what}; last events: {self.events[-12:]}"

    def note(self, event: str) -> None:
        self.events.append(event)

    # -- pods ---------------------------------------------------------------------------------------

    def shape(self) -> tuple[list[tuple[str, int, int]], bool]:
        r = self.rng.random()
        if r < 0.55:
            return [("main", self.rng.choice((10, 20, 25, 30, 50)), self.rng.randint(1, 24))], False
        if r < 0.7:
            return [("main", 100, 0)], False
        if r < 0.85:
            return [("a", self.rng.choice((10, 20)), self.rng.randint(1, 8)), ("b", 20, self.rng.randint(1, 8))], False
        return [("init", self.rng.choice((20, 40)), self.rng.randint(1, 8)), ("main", 30, self.rng.randint(1, 8))], True

    def manifest(self, shape: list[tuple[str, int, int]], init: bool) -> dict[str, Any]:
        self.n += 1
        m = gpu_pod(f"p{self.n}", shape)
        if init:
            spec = m["spec"]
            spec["initContainers"] = [spec["containers"].pop(0)]
        return m

    def admit(self, pod: dict[str, Any]) -> None:
        run = self.c.runs[pod["metadata"]["uid"]]
        try:
            self.c.admit(pod, create=False)
        except KubeletSimError as exc:
            self.note(f"{run.name} refused: {exc}")
            self.forget(run)
            return
        self.pending.append(run)

    def start(self, run: PodRun) -> None:
        try:
            self.c.start_containers(run)
        except KubeletSimError as exc:
            self.note(f"{run.name} start failed: {exc}")
            self.last_refusal[run.uid] = str(exc)
            return
        self.pending.remove(run)
        self.live.append(run)

    def forget(self, run: PodRun) -> None:
        """The pod goes from the API server (the kubelet already dropped it)."""
        self.c.kubelet.remove_pod(run.uid)
        try:
            self.c.delete(run)
        except Exception:  # the API server may be the fault
            self.later.append(threading.Timer(1.0, self._delete_later, args=(run,)))
            self.later[-1].start()

    def _delete_later(self, run: PodRun) -> None:
        """The deletion again until the API server takes it (as the user's kubectl or controller retries)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                self.c.delete(run)
                return
            except Exception:
                time.sleep(0.5)

    def step_pods(self) -> None:
        r = self.rng.random()
        if r < 0.3:
            shape, init = self.shape()
            pod = self.c.create(self.manifest(shape, init))
            self.admit(pod)
            if self.pending and self.rng.random() < 0.8:
                self.start(self.pending[-1])
        elif r < 0.45:  # a Deployment's identical pods, admitted in any order
            shape = [("main", self.rng.choice((20, 25, 50)), self.rng.randint(2, 12))]
            pods = [self.c.create(self.manifest(shape, False)) for _ in range(self.rng.randint(2, 4))]
            self.note(f"deployment {[p['metadata']['name'] for p in pods]} {shape}")
            time.sleep(self.rng.uniform(0.0, 0.6))
            self.rng.shuffle(pods)
            for pod in pods:
                self.admit(pod)
        elif r < 0.6 and self.pending:
            self.start(self.rng.choice(self.pending))
        elif r < 0.8 and (self.live or self.pending):
            pool = self.live if self.live and (not self.pending or self.rng.random() < 0.6) else self.pending
            run = pool.pop(self.rng.randrange(len(pool)))
            self.note(f"delete {run.name} ({'started' if pool is self.live else 'not started'})")
            try:
                self.c.delete(run)
            except Exception:
                self.c._stop_pod(run.uid)
                self.later.append(threading.Timer(1.0, self._delete_later, args=(run,)))
                self.later[-1].start()
        elif self.live:  # a container restarts: the kubelet calls PreStartContainer again
            run = self.rng.choice(self.live)
            inits = {c["name"] for c in run.manifest["spec"].get("initContainers") or []}
            name = self.rng.choice(sorted(set(run.core) - inits))
            self.note(f"restart container {run.name}/{name}")
            try:
                self.c.kubelet.pre_start(names.VCORE_RESOURCE, pod_uid=run.uid, container_name=name)
            except KubeletSimError as exc:
                self.note(f"restart of {run.name}/{name} failed: {exc}")

    # -- faults -------------------------------------------------------------------------------------

    def step_fault(self) -> Callable[[], None] | None:
        """Start a fault; returns what ends it after the step's pod actions (or None)."""
        r = self.rng.random()
        agent = self.c.agent
        assert agent is not None
        if r < 0.06:
            killer = threading.Timer(self.rng.uniform(0.0, 0.15), agent.signal, args=(signal.SIGKILL,))
            killer.start()
            self.note("SIGKILL")

            def restart() -> None:
                killer.join()
                agent.wait()
                self.c.start_agent()

            return restart
        if r < 0.1:
            self.note("SIGTERM")
            assert agent.stop() == 0, self.why("the agent did not stop cleanly on SIGTERM")
            self.c.start_agent()
            return None
        if r < 0.13:
            self.note("kubelet restart")
            self.c.restart_kubelet()
            for run in list(self.pending):  # admitted, not started: they failed admission
                if not self.c.kubelet.allocations(run.uid):
                    self.pending.remove(run)
                    self.forget(run)
            for resource in (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE):
                self.c.kubelet.wait_for_registration(resource, timeout=30, with_devices=True)
            return None
        if r < 0.17:
            hold = self.rng.uniform(0.5, 3.0)
            self.note(f"API server hangs {hold:.1f} s")
            self.c.api.set_down(True, "hang")
            self.c.api.close_watches(abrupt=True)
            threading.Timer(hold, self.c.api.set_down, args=(False,)).start()
            return None
        if r < 0.2:
            self.note("API server errors")
            self.c.api.fail_next("GET", r"^/api/v1/pods", 500, count=self.rng.randint(1, 6))
            self.c.api.close_watches()
        return None

    # -- invariants ---------------------------------------------------------------------------------

    def check(self, when: str) -> None:
        for minor, (cores, memory) in held_own(self.live, self.mem).items():
            assert cores <= names.HUNDRED_CORES and memory <= self.mem[minor], self.why(
                f"{when}: GPU {minor} holds {cores} cores, {memory} bytes"
            )
        seen: dict[tuple[str, str], str] = {}
        for run in self.live:
            inits = {c["name"] for c in run.manifest["spec"].get("initContainers") or []}
            for name, rec in run.core.items():
                cores = int(rec.response.annotations[names.VCORE_RESOURCE])
                if name in inits or cores >= names.HUNDRED_CORES:
                    continue
                where = answered_dir(rec.response)
                other = seen.setdefault(where, f"{run.name}/{name}")
                assert other == f"{run.name}/{name}", self.why(f"{when}: {other} and {run.name}/{name} share {where}")
                path = self.c.vm_path / "configs" / where[0] / where[1] / "vcuda.config"
                assert path.is_file(), self.why(f"{when}: {run.name}/{name}: no {path}")
                config = files.unpack(path.read_bytes())
                cores, memory = own_budget(run, name)
                got = (config.pod_uid, config.container_name, config.utilization, config.gpu_memory)
                assert got == (run.uid, name, cores, memory), self.why(
                    f"{when}: {run.name}/{name} reads {got} from {path}, wants {(run.uid, name, cores, memory)}"
                )
        dirs: dict[tuple[str, ...], str] = {}
        ids: dict[str, str] = {}
        running = {run.uid for run in self.live}  # a stopping pod's record goes once the pod is gone
        for uid, per in _mapping(self.c).items():
            if uid not in running:
                continue
            for name, entry in per.items():
                me = f"{uid}/{name}"
                answered = tuple(entry.get("AnsweredAs") or (uid, name))
                assert dirs.setdefault(answered, me) == me, self.why(f"{when}: {dirs[answered]}, {me} share {answered}")
                for device in entry.get("DeviceIDs") or ():  # an init container's IDs go on to its pod's others
                    holder = ids.setdefault(device, me)
                    assert holder.split("/")[0] == uid, self.why(f"{when}: {holder}, {me} hold {device}")
        agent = self.c.agent
        assert agent is not None and agent.proc is not None
        if agent.proc.poll() is None:
            for url in ("/metrics", "/usage"):
                status, body = http_get(self.c, url, timeout=10)
                assert status == 200, self.why(f"{when}: {url} answered {status}: {body[:300]}")


def own_budget(run: PodRun, name: str) -> tuple[int, int]:
    """(cores, memory bytes) the pod's spec asks for the container."""
    spec = run.manifest["spec"]
    container = next(c for c in [*spec.get("initContainers", []), *spec["containers"]] if c["name"] == name)
    limits = (container.get("resources") or {}).get("limits") or {}
    return (
        int(limits.get(names.VCORE_RESOURCE, 0)),
        int(limits.get(names.VMEMORY_RESOURCE, 0)) * names.MEMORY_BLOCK_BYTES,
    )


def held_own(runs: list[PodRun], memory_of: dict[int, int]) -> dict[int, tuple[int, int]]:
    """minor -> (cores, memory) the started containers hold by their own budgets on the GPUs their answers
    name (an init container runs alone before the others: a pod holds the most of either)."""
    out = {m: (0, 0) for m in memory_of}
    for run in runs:
        inits = {c["name"] for c in run.manifest["spec"].get("initContainers") or []}
        groups: dict[str, dict[int, tuple[int, int]]] = {}
        for name, rec in run.core.items():
            cores, memory = own_budget(run, name)
            devices = rec.response.annotations[names.VDEVICE_ANNOTATION].split(",")
            group = groups.setdefault(name if name in inits else "", {})
            for device in filter(None, devices):
                minor = int(device.removeprefix("/dev/nvidia"))
                c, b = group.get(minor, (0, 0))
                whole = cores >= names.HUNDRED_CORES
                group[minor] = (c + (100 if whole else cores), b + (memory_of[minor] if whole else memory))
        for m in memory_of:  # each figure the most of any one group (not the pair of the most cores)
            c = max([g.get(m, (0, 0))[0] for g in groups.values()] or [0])
            b = max([g.get(m, (0, 0))[1] for g in groups.values()] or [0])
            out[m] = (out[m][0] + c, out[m][1] + b)
    return out


def answered_dir(response: Any) -> tuple[str, str]:
    """(pod directory, container directory) that an Allocate answer mounts as its vcuda.config's."""
    mount = next(m.host_path for m in response.mounts if m.container_path == names.VCUDA_MOUNTPOINT)
    config = PurePosixPath(response.envs[names.VCUDA_CONFIG_ENV])
    return (PurePosixPath(mount).name, config.parent.name)


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _mapping(c: SimCluster) -> dict[str, Any]:
    document = read_document(c.checkpoint_dir / names.OWN_CHECKPOINT) or {}
    return dict(document.get("PodGPUMapping") or {})


def _pod_dirs(c: SimCluster) -> list[str]:
    return sorted(p.name for p in c.vm_path.iterdir() if p.is_dir() and len(p.name) == 36)


def run_round(tmp_path: Path, seed: int, chaos_out: list[Chaos] | None = None) -> None:
    cluster = SimCluster(
        tmp_path / f"r{seed}", SPEC, agent_flags=["--allocation-check-period=1"], status_lag=0.3, seed=seed
    )
    with cluster:
        chaos = Chaos(cluster, seed)
        if chaos_out is not None:
            chaos_out.append(chaos)
        for step in range(STEPS):
            end = chaos.step_fault()
            chaos.step_pods()
            if end is not None:
                end()
            chaos.check(f"step {step}")
        # The faults end: every admitted container starts (the kubelet retries its start).
        cluster.api.clear_faults()
        cluster.api.set_down(False)
        for timer in chaos.later:
            timer.join(70)
        deadline = time.monotonic() + 30
        while chaos.pending and time.monotonic() < deadline:
            for run in list(chaos.pending):
                chaos.start(run)
            time.sleep(0.5)
        # A start refused while the GPU its answer named has no room (the IDs the kubelet gave were matched
        # to another pod asking for as many cores, the room there went to others) waits for room there:
        # the agent says so; such pods are deleted (as their owner would).
        for run in [r for r in chaos.pending if "cannot start yet" in chaos.last_refusal.get(r.uid, "")]:
            chaos.note(f"{run.name} waits for room: {chaos.last_refusal[run.uid][:300]}")
            chaos.pending.remove(run)
            cluster.delete(run)
        assert not chaos.pending, chaos.why(
            f"never started: {[r.name for r in chaos.pending]}; log:\n{cluster.agent.log_text()[-4000:]}"  # type: ignore[union-attr]
        )
        chaos.check("end")
        want = held_own(chaos.live, chaos.mem)
        _wait(lambda: agent_allocated(cluster) == want, chaos.why(f"gauges say {agent_allocated(cluster)}, not {want}"))
        # Everything goes: nothing is held.
        for run in chaos.live:
            cluster.delete(run)
        chaos.live.clear()
        _wait(lambda: not _mapping(cluster), chaos.why(f"checkpoint still holds {_mapping(cluster)}"))
        zero = {m: (0, 0) for m in chaos.mem}
        _wait(lambda: agent_allocated(cluster) == zero, chaos.why(f"gauges say {agent_allocated(cluster)}"))
        _wait(lambda: not _pod_dirs(cluster), chaos.why(f"directories left: {_pod_dirs(cluster)}"), timeout=60)
        whole = [cluster.run_pod(gpu_pod(f"whole{i}", [("main", 100, 0)])) for i in range(len(chaos.mem))]
        assert_no_overcommit(whole, chaos.mem, chaos.why("whole GPUs at the end"))
        assert cluster.agent is not None
        log = cluster.agent.log_text()
        kinds = [
            e.split(" ", 1)[0] if not e.startswith("p") else e.split(" ", 1)[1].split(":")[0] for e in chaos.events
        ]
        print(f"seed {seed}: {chaos.n} pods; events: { {k: kinds.count(k) for k in sorted(set(kinds))} }")
        assert "Traceback" not in log, chaos.why(
            f"the agent logged a traceback:\n{log[log.index('Traceback') - 2000 :][:6000]}"
        )


@pytest.mark.parametrize("seed", [9000 + i for i in range(ROUNDS)])
def test_chaos_under_churn(tmp_path: Path, sim_built: Path, seed: int) -> None:
    run_round(tmp_path, seed)


def test_room_of_a_freed_allocation_the_kubelet_still_holds_is_not_given_away(tmp_path: Path, sim_built: Path) -> None:
    """Identical pods a and b wait; the kubelet admits b (its IDs matched to a, first in line), then a, whose
    Allocate finds no GPU with room (the cores left are split between the GPUs) and fails its admission; a is
    deleted, freeing the allocation b's IDs were matched to. c, asking for as many cores, is admitted next:
    the only room is that allocation's, which b still holds (the kubelet gave b its IDs). c must not get it:
    b starts (c is refused), not c while b's start waits for ever."""
    cluster = SimCluster(
        tmp_path / "node", spec_a100_pcie_x2(tmp_path / "spec.json"), agent_flags=["--allocation-check-period=1"]
    )
    with cluster:
        cluster.run_pod(gpu_pod("filler1", [("main", 85, 8)]))
        cluster.run_pod(gpu_pod("filler2", [("main", 65, 8)]))
        a = cluster.create(gpu_pod("a", [("main", 25, 8)]))
        b = cluster.create(gpu_pod("b", [("main", 25, 8)]))
        time.sleep(1.0)  # the agent's pod cache sees both
        run_b = cluster.admit(b, create=False)
        with pytest.raises(KubeletSimError):
            cluster.admit(a, create=False)  # no GPU has 25 cores left
        cluster.delete(cluster.runs[a["metadata"]["uid"]], wait=True)
        _wait(lambda: a["metadata"]["uid"] not in _mapping(cluster), "a's allocation to be freed")
        c = cluster.create(gpu_pod("c", [("main", 25, 12)]))
        time.sleep(1.0)
        with contextlib.suppress(KubeletSimError):
            cluster.start_containers(cluster.admit(c, create=False))
        cluster.start_containers(run_b)  # raises while its GPU has no room for it


def test_a_pod_with_an_init_container_holds_the_most_of_each_figure() -> None:
    """An init container of more memory and fewer cores than the app container on its GPU: the pod holds
    the app's cores and the init container's memory there (the agent charges each figure so)."""
    block = names.MEMORY_BLOCK_BYTES

    def record(cores: int, blocks: int) -> Any:
        annotations = {
            names.VDEVICE_ANNOTATION: "/dev/nvidia0",
            names.VCORE_RESOURCE: str(cores),
            names.VMEMORY_RESOURCE: str(blocks * block),
        }
        return SimpleNamespace(response=SimpleNamespace(annotations=annotations))

    manifest = gpu_pod("p", [("init", 20, 6), ("main", 30, 2)])
    manifest["metadata"]["uid"] = "u"
    manifest["spec"]["initContainers"] = [manifest["spec"]["containers"].pop(0)]
    run = PodRun(manifest, core={"init": record(20, 6), "main": record(30, 2)})
    assert held([run], {0: 100 * block}) == {0: (30, 6 * block)}
    assert held_own([run], {0: 100 * block}) == {0: (30, 6 * block)}
