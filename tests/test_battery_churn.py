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
