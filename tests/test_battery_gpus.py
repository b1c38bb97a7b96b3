"""Battery: GPUs that are lost when the agent starts, and lost and back (XID 79) under pods.

A lost GPU costs only itself: the agent serves the others, lists the lost one's devices as
Unhealthy (IDs kept), places no new pod on it, keeps the allocations it holds, and offers it
again once it answers.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from gpumanager import names
from simnode.cluster import SimCluster, admission_annotations, gpu_pod
from simnode.gpusim_state import GpuSimState
from simnode.kubelet import KubeletSimError, PluginRPCError
from tests.battery_fixtures import (
    SPECS,
    answered,
    assert_no_overcommit,
    memory_of,
    readyz,
    spec_islands,
    spec_odd_mixed,
    wait_agent_matches,
    write_spec,
)

FAST_HEALTH = ("--health-quiet-period=1s", "--health-probe-period=200ms")


def _unhealthy_cores(cluster: SimCluster) -> int:
    return sum(1 for d in cluster.kubelet.devices(names.VCORE_RESOURCE).values() if not d.healthy)


def test_gpu_lost_at_start_costs_only_itself(tmp_path: Path) -> None:
    spec = spec_odd_mixed(tmp_path / "spec.json")  # minors 2, 0, 1 at NVML indices 0, 1, 2
    cluster = SimCluster(tmp_path / "node", spec, fill="random", agent_flags=FAST_HEALTH)
    with cluster:  # started with every GPU; restarted below with one lost
        assert cluster.agent is not None
        cluster.agent.stop()
        with GpuSimState(cluster.agent.state) as state:
            state.set_lost(1)  # NVML index 1: minor 0
        cluster.start_agent()
        cluster.kubelet.wait_for_devices(names.VCORE_RESOURCE, lambda d: len(d) == 300, timeout=30)
        cluster.kubelet.wait_for_devices(
            names.VCORE_RESOURCE, lambda d: sum(1 for x in d.values() if not x.healthy) == 100, timeout=30
        )
        runs = [cluster.run_pod(gpu_pod(f"whole-{i}", [("main", 100, 0)])) for i in range(2)]
        for run in runs:
            assert 0 not in answered(run)["main"][0], answered(run)
        status, body = readyz(cluster)
        assert status == 200, body  # the healthy GPUs are served
        with GpuSimState(cluster.agent.state) as state:
            state.set_lost(1, False)
        cluster.kubelet.wait_for_devices(names.VCORE_RESOURCE, 300, timeout=60)
        back = cluster.run_pod(gpu_pod("on-the-returned-gpu", [("main", 100, 0)]))
        assert answered(back)["main"][0] == (0,)
        assert_no_overcommit([*runs, back], memory_of(cluster))
        wait_agent_matches(cluster, [*runs, back])


def test_xid_79_under_pods_then_back(tmp_path: Path) -> None:
    spec = spec_islands(tmp_path / "spec.json")  # minors 10..16
    cluster = SimCluster(tmp_path / "node", spec, fill="random", agent_flags=FAST_HEALTH)
    with cluster:
        assert cluster.agent is not None
        live = [cluster.run_pod(gpu_pod(f"share-{i}", [("main", 40, 8)])) for i in range(4)]
        victim_minor = answered(live[0])["main"][0][0]
        index = victim_minor - 10
        with GpuSimState(cluster.agent.state) as state:
            state.queue_xid(index, 79)
            state.set_lost(index)
        cluster.kubelet.wait_for_devices(
            names.VCORE_RESOURCE, lambda d: sum(1 for x in d.values() if not x.healthy) >= 100, timeout=30
        )
        # New pods go elsewhere; what the lost GPU holds stays held (its containers still exist).
        for i in range(5):
            run = cluster.run_pod(gpu_pod(f"during-{i}", [("main", 40, 8)]))
            assert victim_minor not in answered(run)["main"][0]
            live.append(run)
        wait_agent_matches(cluster, live)
        cluster.delete(live.pop(0))  # a pod on the lost GPU ends meanwhile
        with GpuSimState(cluster.agent.state) as state:
            state.set_lost(index, False)
        cluster.kubelet.wait_for_devices(names.VCORE_RESOURCE, 700, timeout=60)
        live.append(cluster.run_pod(gpu_pod("after", [("main", 100, 0)])))
        assert_no_overcommit(live, memory_of(cluster))
        wait_agent_matches(cluster, live)
        assert cluster.agent.proc is not None and cluster.agent.proc.poll() is None


def test_gpu_lost_while_the_agent_was_down_keeps_its_pods(tmp_path: Path) -> None:
    """Pods hold a GPU; the agent dies; the GPU is lost; the agent starts; the GPU comes back."""
    spec = spec_odd_mixed(tmp_path / "spec.json")  # minors 2, 0, 1 at NVML indices 0, 1, 2
    cluster = SimCluster(tmp_path / "node", spec, fill="random", agent_flags=FAST_HEALTH)
    with cluster:
        assert cluster.agent is not None
        live = [
            cluster.run_pod(gpu_pod(f"held-{i}", [("main", 40, 4)], annotations=admission_annotations([[0]], i + 1)))
            for i in range(2)
        ]
        live.append(cluster.run_pod(gpu_pod("whole", [("main", 100, 0)], annotations=admission_annotations([[2]], 9))))
        cluster.agent.signal(signal.SIGKILL)
        cluster.agent.wait()
        with GpuSimState(cluster.agent.state) as state:
            state.set_lost(1)  # minor 0
            state.set_lost(0)  # minor 2
        cluster.start_agent()
        wait_agent_matches(cluster, live)
        with GpuSimState(cluster.agent.state) as state:
            state.set_lost(1, False)
            state.set_lost(0, False)
        cluster.kubelet.wait_for_devices(names.VCORE_RESOURCE, 300, timeout=60)
        wait_agent_matches(cluster, live)
        for i in range(4):
            try:
                live.append(cluster.run_pod(gpu_pod(f"new-{i}", [("main", 40, 4)])))
            except PluginRPCError:
                cluster.delete(next(r for r in cluster.runs.values() if r.name == f"new-{i}"))
            assert_no_overcommit(live, memory_of(cluster), f"new-{i}")
        wait_agent_matches(cluster, live)


def test_node_whose_driver_sees_no_gpu_serves_nothing_and_never_crashes(tmp_path: Path) -> None:
    """Every GPU fell off the bus before boot: the driver loads and reports none."""
    spec = write_spec(tmp_path / "none.json", [], lambda i, j: "SYS")
    cluster = SimCluster(tmp_path / "node", spec)
    with cluster:
        assert cluster.agent is not None and cluster.agent.proc is not None
        assert cluster.kubelet.devices(names.VCORE_RESOURCE) == {}
        with pytest.raises(KubeletSimError):
            cluster.admit(gpu_pod("nowhere", [("main", 100, 0)]))
        assert cluster.agent.proc.poll() is None
        assert "Traceback" not in cluster.agent.log_text()


def test_gpu_gone_from_the_bus_across_a_restart(tmp_path: Path) -> None:
    """The driver no longer enumerates one GPU at all: the later ones move up an NVML index."""
    spec = spec_odd_mixed(tmp_path / "spec.json")  # minors 2, 0, 1 at NVML indices 0, 1, 2
    cluster = SimCluster(tmp_path / "node", spec, fill="random")
    with cluster:
        assert cluster.agent is not None
        annotated = [[2], [0], [1], [1]]
        live = [
            cluster.run_pod(gpu_pod(f"p{i}", [("main", 30, 4)], annotations=admission_annotations([g], i + 1)))
            for i, g in enumerate(annotated)
        ]
        cluster.agent.signal(signal.SIGKILL)
        cluster.agent.wait()
        doc = json.loads(spec.read_text())
        del doc["gpus"][1]  # minor 0 is gone
        doc["topology"] = [[0, 50], [50, 0]]
        cluster.spec = tmp_path / "two.json"
        cluster.spec.write_text(json.dumps(doc))
        gone = next(r for r in live if r.name == "p1")
        cluster.delete(gone)  # its containers died with the GPU
        live.remove(gone)
        cluster.start_agent()
        for i in range(6):
            try:
                live.append(cluster.run_pod(gpu_pod(f"new-{i}", [("main", 30, 4)])))
            except (PluginRPCError, KubeletSimError):
                cluster.delete(next(r for r in cluster.runs.values() if r.name == f"new-{i}"))
            assert_no_overcommit(live, memory_of(cluster), f"new-{i}")
        wait_agent_matches(cluster, live)
        assert cluster.agent.proc is not None and cluster.agent.proc.poll() is None


def test_xid_storm_marks_only_what_it_should_and_everything_comes_back(tmp_path: Path) -> None:
    """Hundreds of XID events at once on every GPU: application XIDs change nothing, others take the GPU
    out of service until the quiet period passes; odd values never stop the health loop."""
    spec = spec_islands(tmp_path / "spec.json")
    cluster = SimCluster(tmp_path / "node", spec, fill="random", agent_flags=FAST_HEALTH)
    with cluster:
        assert cluster.agent is not None
        live = [cluster.run_pod(gpu_pod("before", [("main", 30, 4)]))]
        with GpuSimState(cluster.agent.state) as state:
            for _ in range(40):
                for gpu in range(7):
                    state.queue_xid(gpu, 13 if gpu % 2 else 31)  # application errors: ignored by default
        time.sleep(1.0)
        assert _unhealthy_cores(cluster) == 0
        with GpuSimState(cluster.agent.state) as state:
            for xid in (48, 2**32 + 48, 0, 2**63):
                state.queue_xid(2, xid)
            state.queue_xid(5, 79)
        cluster.kubelet.wait_for_devices(
            names.VCORE_RESOURCE, lambda d: sum(1 for x in d.values() if not x.healthy) >= 200, timeout=30
        )
        cluster.kubelet.wait_for_devices(names.VCORE_RESOURCE, 700, timeout=60)
        cluster.delete(live.pop())
        live.append(cluster.run_pod(gpu_pod("every-gpu", [("main", 700, 0)])))  # all seven are back
        wait_agent_matches(cluster, live)
        assert cluster.agent.proc is not None and cluster.agent.proc.poll() is None


def test_gpu_lost_on_a_fresh_node_then_back_is_used_as_it_really_is(tmp_path: Path) -> None:
    """A new node (no saved inventory) whose 40 GB GPU among 80 GB ones is lost from the first start,
    then answers again: it must be used with its own minor and memory, not the stand-in's guesses."""
    spec = SPECS["a800-small-one-x8"](tmp_path / "spec.json")  # NVML index 3: minor 4, 40 GB
    cluster = SimCluster(tmp_path / "node", spec, agent_flags=FAST_HEALTH)
    cluster.start(agent=False)
    try:
        with GpuSimState(cluster.workdir / "gpusim.state") as state:
            state.set_lost(3)
        cluster.start_agent()
        cluster.kubelet.wait_for_devices(
            names.VCORE_RESOURCE, lambda d: sum(1 for x in d.values() if not x.healthy) == 100, timeout=30
        )
        with GpuSimState(cluster.workdir / "gpusim.state") as state:
            state.set_lost(3, False)
        cluster.kubelet.wait_for_devices(names.VCORE_RESOURCE, 800, timeout=60)
        mem = memory_of(cluster)
        live = []
        # Fill the returned GPU through gpu-admission's annotation: 4 x 12 GB fit 40 GB only 3 times.
        for i in range(4):
            try:
                live.append(
                    cluster.run_pod(
                        gpu_pod(f"on-4-{i}", [("main", 20, 48)], annotations=admission_annotations([[4]], i + 1))
                    )
                )
            except PluginRPCError as exc:
                assert "GPU 4" in exc.details, exc.details
                cluster.delete(next(r for r in cluster.runs.values() if r.name == f"on-4-{i}"))
        assert len(live) == 3, [answered(r) for r in live]
        for run in live:
            minors, _, _ = answered(run)["main"]
            assert set(minors) <= set(mem), minors
            envs = dict(run.core["main"].response.envs)
            assert "GPU-lost" not in envs["NVIDIA_VISIBLE_DEVICES"], envs
        assert_no_overcommit(live, mem)
        wait_agent_matches(cluster, live)
    finally:
        cluster.stop()
