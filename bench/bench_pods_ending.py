"""Pods that end together: what the agent spends then, and what admissions meanwhile wait for.

A node runs --running shared pods (3 vcuda-core, 512 MiB each). Then --ending of them end at once, as the
pods of a finished Job do: their containers exit and their cgroups go at once, while their last status (the
phase Succeeded, which frees their allocations) reaches the API server --status-lag seconds later, as the
kubelet's status manager writes it. Meanwhile --admit new pods are admitted and started one at a time.
Printed, for each variant:

  the agent's CPU time over the --window seconds from the end (every thread), and per ended pod
  Allocate and PreStartContainer (vcuda-core) of the admissions meanwhile, median and p99, as the kubelet
          simulator sees them

Until the pods' statuses come, the agent still counts their allocations, and each second it looks for their
containers' PIDs (pids.config) and finds no cgroup: what that costs is the first figure. With ``--before REF``
the agent of git revision REF runs the same steps, in a cluster of its own.

    python bench/bench_pods_ending.py [--running 200] [--ending 100] [--admit 40] [--spec ...] [--before REF]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from figures import Variant, add_before_arguments, figure, load, no_collector_pauses, prompt_threads, spec_arg, variants

from gpumanager import names
from simnode.agent_process import SPEC_DIR
from simnode.cluster import SimCluster, gpu_pod

CORE = names.VCORE_RESOURCE


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of a process so far (scheduler statistics: nanoseconds, not clock ticks)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total / 1e9


@dataclass
class Figures:
    """One agent's figures."""

    load: str = ""
    cpu: float = 0.0
    window: float = 0.0
    ended: int = 0
    allocate: list[float] = field(default_factory=list)
    prestart: list[float] = field(default_factory=list)


def measure(spec: Path, workdir: Path, args: argparse.Namespace, variant: Variant) -> Figures:
    got = Figures(load=load())
    cluster = SimCluster(
        workdir,
        spec,
        status_lag=args.status_lag,
        agent_flags=["--allocation-check-period=30"],
        agent_env=variant.env,
        agent_python=variant.python,
        api_process=True,
    )
    with cluster:
        assert cluster.agent is not None
        manifests = [cluster.create(gpu_pod(f"run-{i:03d}", [("main", 3, 2)])) for i in range(args.running)]
        time.sleep(1.0)  # the agent's pod cache sees them, as it would before the kubelet admits them
        runs = []
        for manifest in manifests:
            run = cluster.admit(manifest, create=False)
            cluster.start_containers(run)
            runs.append(run)
        fresh = [cluster.create(gpu_pod(f"new-{i:03d}", [("main", 3, 2)])) for i in range(args.admit)]
        time.sleep(2.0)  # steady: the starts' work done, the new pods in the agent's cache
        pid = cluster.agent.pid
        began_cpu, began = cpu_seconds(pid), time.perf_counter()
        for run in runs[: args.ending]:
            cluster.end_pod(run)
        got.ended = min(args.ending, len(runs))
        pause = args.window / max(1, len(fresh))
        for manifest in fresh:
            run = cluster.admit(manifest, create=False)
            got.allocate.append(run.core["main"].timings.allocate_seconds or 0.0)
            started = time.perf_counter()
            cluster.kubelet.pre_start(CORE, pod_uid=run.uid, container_name="main")
            got.prestart.append(time.perf_counter() - started)
            cluster.start_containers(run)
            time.sleep(max(0.0, began + pause * len(got.allocate) - time.perf_counter()))
        time.sleep(max(0.0, began + args.window - time.perf_counter()))
        got.cpu = cpu_seconds(pid) - began_cpu
        got.window = time.perf_counter() - began
    return got


def run(spec: Path, args: argparse.Namespace, agents: list[Variant]) -> None:
    print(
        f"== node {spec.name}: {args.running} shared pods running, {args.ending} of them end at once (statuses "
        f"{args.status_lag:g} s later), {args.admit} pods admitted over the next {args.window:g} s"
    )
    got: dict[str, Figures] = {}
    for variant in agents:
        with tempfile.TemporaryDirectory(prefix="bench-ending-") as tmp, no_collector_pauses():
            got[variant.label] = measure(spec, Path(tmp), args, variant)
    width = max(len(v.label) for v in agents)

    def each(title: str, line: str | None = None, pick: str = "") -> None:
        print(title)
        for v in agents:
            f = got[v.label]
            text = {
                "load": f.load,
                "cpu": f"{f.cpu * 1000:8.1f} ms over {f.window:.1f} s ({f.cpu / f.window * 100:.1f} % of a core)"
                + (f", {f.cpu * 1000 / f.ended:.2f} ms per ended pod" if f.ended else ""),
                "allocate": figure("", f.allocate, target_ms=3),
                "prestart": figure("", f.prestart),
            }[pick]
            print(f"    {v.label:{width}s} {text}")

    each("measured under", pick="load")
    each("the agent's CPU time from the end on (every thread)", pick="cpu")
    each("Allocate (vcuda-core) of the pods admitted meanwhile", pick="allocate")
    each("PreStartContainer (vcuda-core) of the pods admitted meanwhile", pick="prestart")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", type=spec_arg, action="append", default=None, help="node spec (repeatable)")
    parser.add_argument("--running", type=int, default=200)
    parser.add_argument("--ending", type=int, default=100)
    parser.add_argument("--admit", type=int, default=40)
    parser.add_argument("--status-lag", type=float, default=4.0, help="seconds until the ended pods' statuses come")
    parser.add_argument("--window", type=float, default=4.0, help="seconds measured from the end")
    add_before_arguments(parser)
    args = parser.parse_args()
    if args.ending > args.running:
        parser.error(f"--ending {args.ending} is more than --running {args.running}")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    prompt_threads()
    specs = args.spec or [SPEC_DIR / "h100-nvlink-x8.json"]
    with variants(args.before, args.before_python) as agents:
        for spec in specs:
            run(spec, args, agents)
    print(f"   done; {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
