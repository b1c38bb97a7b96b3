"""Battery: pod churn on node specs no other test uses, with SIGKILLs at random moments.

Each run drives the real agent through the kubelet simulator (random fill order, freed device
IDs handed out again first) and the API-server simulator: pods of random shapes (shares, whole
GPUs, several GPUs, several containers) arrive and end; every few steps the agent is killed
with SIGKILL, some pods end while it is down, and it is started again. After every step no GPU
is over-committed by the containers alive; at the end the agent's figures equal theirs; every
refusal names the pod or the device IDs.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from pathlib import Path

import pytest

from gpumanager import names
from simnode.cluster import PodRun, SimCluster, gpu_pod
from simnode.kubelet import KubeletSimError, PluginRPCError
from tests.battery_fixtures import SPECS, assert_no_overcommit, memory_of, readyz, wait_agent_matches


def _shape(rng: random.Random, gpus: int, smallest_blocks: int) -> list[tuple[str, int, int]]:
    kind = rng.random()
    if kind < 0.5:
        return [("main", rng.choice((10, 25, 30, 50, 75)), rng.randint(1, max(1, smallest_blocks // 3)))]
    if kind < 0.7:
        return [("main", 100, 0)]
    if kind < 0.8 and gpus > 1:
        return [("main", 100 * rng.randint(2, gpus), 0)]
    return [
        ("first", rng.choice((20, 40)), rng.randint(1, 8)),
        ("sidecar", 0, 0),
        ("second", rng.choice((20, 30)), rng.randint(1, 8)),
    ]


def _admit(cluster: SimCluster, run_name: str, shape: list[tuple[str, int, int]], killing: bool) -> PodRun | None:
    manifest = gpu_pod(run_name, shape)
    try:
        run = cluster.admit(manifest)
        cluster.start_containers(run)
        return run
    except PluginRPCError as exc:
        # A refusal names the pod or the device IDs, never just "error" (unless the agent was killed).
        assert killing or run_name in exc.details or names.VCORE_ID_PREFIX in exc.details, exc.details
    except KubeletSimError:
        pass  # the kubelet had too few device IDs: nothing reached the agent
    uid = next(u for u, r in cluster.runs.items() if r.name == run_name)
    cluster.delete(cluster.runs[uid])
    return None


@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_churn_with_sigkills_never_overcommits_nor_leaks(tmp_path: Path, spec_name: str) -> None:
    spec = SPECS[spec_name](tmp_path / f"{spec_name}.json")
    rng = random.Random(f"battery-{spec_name}")
    cluster = SimCluster(tmp_path / "node", spec, fill="random")
    cluster.kubelet._rng.seed(spec_name)  # reproducible picks
    with cluster:
        mem = memory_of(cluster)
        smallest = min(mem.values()) // names.MEMORY_BLOCK_BYTES
        live: list[PodRun] = []
        for step in range(40):
            killer = None
            if step % 10 == 9:  # SIGKILL somewhere in this step's Allocate, PreStart or in between
                assert cluster.agent is not None
                killer = threading.Timer(rng.uniform(0.0, 0.08), cluster.agent.signal, args=(signal.SIGKILL,))
                killer.start()
            if live and rng.random() < 0.3:
                victim = live.pop(rng.randrange(len(live)))
                cluster.delete(victim)
            else:
                run = _admit(cluster, f"p{step}", _shape(rng, len(mem), smallest), killer is not None)
                if run is not None:
                    live.append(run)
            assert_no_overcommit(live, mem, f"step {step}")
            if killer is not None:
                assert cluster.agent is not None
                killer.join()
                cluster.agent.wait()
                for _ in range(rng.randint(0, 2)):
                    if live:  # ends while the agent is down
                        cluster.delete(live.pop(rng.randrange(len(live))))
                cluster.start_agent()
        wait_agent_matches(cluster, live)
        status, body = readyz(cluster)
        assert status == 200, body


@pytest.mark.parametrize("spec_name", ["odd-mixed", "islands-x7"])
def test_prestart_retried_after_the_agent_died_between_allocate_and_prestart(tmp_path: Path, spec_name: str) -> None:
    """The kubelet retries a failed container start, PreStart included, once the agent is back."""
    spec = SPECS[spec_name](tmp_path / f"{spec_name}.json")
    cluster = SimCluster(tmp_path / "node", spec, fill="random")
    with cluster:
        assert cluster.agent is not None
        runs = [cluster.admit(gpu_pod(f"p{i}", shape)) for i, shape in enumerate(_SHAPES)]
        cluster.agent.signal(signal.SIGKILL)
        cluster.agent.wait()
        with pytest.raises(KubeletSimError):
            cluster.start_containers(runs[0])
        cluster.start_agent()
        for run in runs:
            cluster.start_containers(run)
        assert_no_overcommit(runs, memory_of(cluster))
        wait_agent_matches(cluster, runs)
        for run in runs:
            for name in run.core:
                config = cluster.vm_path / "configs" / run.uid / name / "vcuda.config"
                assert config.is_file(), config


_SHAPES = [
    [("main", 30, 4)],
    [("main", 100, 0)],
    [("a", 20, 2), ("b", 20, 2)],
]


def test_killed_again_and_again_while_starting(tmp_path: Path) -> None:
    """A crash loop with no pause: SIGKILL at random moments of the start (registration, recovery, journal)."""
    spec = SPECS["islands-x7"](tmp_path / "spec.json")
    cluster = SimCluster(tmp_path / "node", spec, fill="random")
    rng = random.Random("crash-loop")
    with cluster:
        assert cluster.agent is not None
        live = [cluster.run_pod(gpu_pod(f"p{i}", shape)) for i, shape in enumerate(_SHAPES)]
        for _ in range(8):
            cluster.agent.signal(signal.SIGKILL)
            cluster.agent.wait()
            cluster.start_agent(wait=False)
            time.sleep(rng.uniform(0.0, 1.5))
        cluster.agent.signal(signal.SIGKILL)
        cluster.agent.wait()
        cluster.delete(live.pop())  # ends while the agent is down
        cluster.start_agent()
        live.append(cluster.run_pod(gpu_pod("after", [("main", 200, 0)])))
        assert_no_overcommit(live, memory_of(cluster))
        wait_agent_matches(cluster, live)
