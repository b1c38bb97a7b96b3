"""Churn: 500 pods of mixed shares and whole GPUs arrive and end on 4 simulated nodes x 8 GPUs.

The same workload (same seed) runs twice on a fresh cluster: with gpu-manager-extender (the
kube-scheduler stand-in calls it as configured by deploy/scheduler/default-scheduler.yaml) and
without it (node totals only). Each node runs the real agent with a kubelet simulator; pods are
created at a steady rate, each runs for a random time once Running and is then deleted; a pod the
node refuses at admission (the agent refused Allocate: ``UnexpectedAdmissionError``) is counted
and deleted. Over-committed GPUs (more cores or memory than the GPU has, by the live pods'
``predicate-gpu-idx`` annotations) are sampled every 0.5 s. Prints, per run: Allocate refusals,
over-committed GPUs, pods run, pods never placed, and creation-to-Running latency.

    .venv/bin/python bench/bench_churn.py [--pods 500] [--rate 8] [--seed 7]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpumanager import names
from simnode.gpusim_state import ensure_sim_built
from simnode.multinode import MultiNodeCluster, pending_pod

GIB_BLOCKS = (1 << 30) // names.MEMORY_BLOCK_BYTES
NODES = [
    ("h100-a", "h100-nvlink-x8"),
    ("h100-b", "h100-nvlink-x8"),
    ("a800-a", "a800-nvlink-pairs-x8"),
    ("a800-b", "a800-nvlink-pairs-x8"),
]


@dataclass
class Job:
    """One pod of the workload."""

    name: str
    containers: list[tuple[int, int]]
    lifetime: float
    at: float  # seconds after the start


def workload(count: int, rate: float, seed: int) -> list[Job]:
    """Shares (70%: 10-90 cores, 1-24 GiB) and whole GPUs (1, 2 or 4), arriving at ``rate`` per second."""
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        roll = rng.random()
        if roll < 0.70:
            containers = [(rng.choice(range(10, 91, 5)), rng.randint(1, 24) * GIB_BLOCKS)]
        elif roll < 0.90:
            containers = [(100, 0)]
        elif roll < 0.98:
            containers = [(200, 0)]
        else:
            containers = [(400, 0)]
        jobs.append(Job(f"job-{i:03d}", containers, rng.uniform(3.0, 12.0), i / rate))
    return jobs


@dataclass
class Result:
    """What one run saw."""

    label: str
    refusals: int = 0
    refusal_examples: list[str] = field(default_factory=list)
    over_committed_max: int = 0
    ran: int = 0
    never_placed: int = 0
    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0


def run(label: str, jobs: list[Job], *, extender: bool, workdir: Path) -> Result:
    result = Result(label)
    cluster = MultiNodeCluster(
        workdir,
        NODES,
        extender=extender,
        node_status_period=1.0,
        scheduler_backoff=(0.5, 5.0),
        seed=1,
    )
    cluster.start()
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            try:
                found = cluster.over_committed()
            except Exception:
                continue
            result.over_committed_max = max(result.over_committed_max, sum(len(v) for v in found.values()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    created: dict[str, float] = {}
    running_since: dict[str, float] = {}
    done: set[str] = set()
    by_name = {j.name: j for j in jobs}
    started = time.monotonic()
    pending = list(jobs)
    deadline = started + jobs[-1].at + 120.0  # time for the last pods to run and end
    try:
        while len(done) < len(jobs) and time.monotonic() < deadline:
            now = time.monotonic() - started
            while pending and pending[0].at <= now:
                job = pending.pop(0)
                cluster.create(pending_pod(job.name, job.containers))
                created[job.name] = time.monotonic()
            for pod in cluster.api.pods():
                name = pod["metadata"]["name"]
                if name in done or name not in by_name:
                    continue
                phase = (pod.get("status") or {}).get("phase")
                if phase == "Running" and name not in running_since:
                    running_since[name] = time.monotonic()
                    result.latencies.append(running_since[name] - created[name])
                    result.ran += 1
                elif phase == "Failed":
                    result.refusals += pod["status"].get("reason") == "UnexpectedAdmissionError"
                    if len(result.refusal_examples) < 3:
                        result.refusal_examples.append(f"{name}: {pod['status'].get('message', '')[:160]}")
                    cluster.delete(name)
                    done.add(name)
                if name in running_since and time.monotonic() - running_since[name] >= by_name[name].lifetime:
                    cluster.delete(name)  # graceful: the node stops it, reports it, then it is gone
                    done.add(name)
            time.sleep(0.1)
        result.never_placed = len(jobs) - len(done)
        result.wall = time.monotonic() - started
    finally:
        stop.set()
        sampler.join(timeout=5)
        cluster.stop()
    return result


def report(r: Result) -> None:
    lat = sorted(r.latencies)
    p99 = lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))] if lat else 0.0
    median = statistics.median(lat) if lat else 0.0
    print(
        f"{r.label:<18} Allocate refusals {r.refusals:4d}   over-committed GPUs {r.over_committed_max:3d}   "
        f"ran {r.ran:4d}   never placed {r.never_placed:3d}   "
        f"create->Running median {median:5.2f} s p99 {p99:5.2f} s   ({r.wall:.0f} s)"
    )
    for example in r.refusal_examples:
        print(f"{'':<18}   refused: {example}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pods", type=int, default=500)
    parser.add_argument("--rate", type=float, default=8.0, help="pods created per second")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--only", choices=("with", "without"), help="run one of the two")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    ensure_sim_built()
    jobs = workload(args.pods, args.rate, args.seed)
    shares = sum(1 for j in jobs if j.containers[0][0] < 100)
    print(
        f"{len(NODES)} nodes x 8 GPUs ({', '.join(s for _, s in NODES)}); {len(jobs)} pods: {shares} shares, "
        f"{len(jobs) - shares} whole-GPU pods, {args.rate:g} per second, each running 3-12 s"
    )
    results = []
    for label, extender in (("with extender", True), ("without extender", False)):
        if args.only and label != f"{args.only} extender":
            continue
        with tempfile.TemporaryDirectory(prefix="bench-churn-") as tmp:
            results.append(run(label, jobs, extender=extender, workdir=Path(tmp)))
        report(results[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
