"""Admissions behind a lagging pod watch: what the kubelet waits for when its watch shows a pod before ours.

A node runs --known pods the agent's pod cache has seen; then the API server's watches are held (events kept
back, reads current: a loaded API server's watch cache) and --pods more pods are admitted one at a time.
The agent finds each in a list of the node's pods asked of the API server. Printed, median and p99, as the
kubelet simulator sees them: GetPreferredAllocation, Allocate and PreStartContainer (vcuda-core), and how
many pod lists the API server answered per admission. The API-server simulator runs in this process (holding
watches is a call on it), so its lists compete with the kubelet simulator for this interpreter: compare the
variants of one run (``--before REF``), not the figures with other benchmarks'.

    python bench/bench_lagging_watch.py [--known 40] [--pods 40] [--spec ...] [--before REF]
"""

from __future__ import annotations

import argparse
import logging
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


@dataclass
class Figures:
    """One agent's figures."""

    load: str = ""
    preferred: list[float] = field(default_factory=list)
    allocate: list[float] = field(default_factory=list)
    prestart: list[float] = field(default_factory=list)
    lists: int = 0


def measure(spec: Path, workdir: Path, args: argparse.Namespace, variant: Variant) -> Figures:
    got = Figures(load=load())
    with SimCluster(workdir, spec, status_lag=0, agent_env=variant.env, agent_python=variant.python) as cluster:
        for i in range(args.known):
            cluster.run_pod(gpu_pod(f"known-{i:03d}", [("main", 3, 2)]))
        cluster.api.hold_watches(True)
        try:
            cluster.api.clear_requests()
            for i in range(args.pods):
                run = cluster.admit(gpu_pod(f"late-{i:03d}", [("main", 3, 2)]))
                got.preferred.append(run.core["main"].timings.preferred_seconds or 0.0)
                got.allocate.append(run.core["main"].timings.allocate_seconds or 0.0)
                started = time.perf_counter()
                cluster.kubelet.pre_start(CORE, pod_uid=run.uid, container_name="main")
                got.prestart.append(time.perf_counter() - started)
                cluster.start_containers(run)
            got.lists = sum(
                1
                for r in cluster.api.requests
                if r.method == "GET" and r.path == "/api/v1/pods" and r.query.get("watch") not in ("true", "1")
            )
        finally:
            cluster.api.hold_watches(False)
    return got


def run(spec: Path, args: argparse.Namespace, agents: list[Variant]) -> None:
    print(f"== node {spec.name}: {args.known} pods known to the agent, then {args.pods} its pod watch has not shown")
    got: dict[str, Figures] = {}
    for variant in agents:
        with tempfile.TemporaryDirectory(prefix="bench-lagging-") as tmp, no_collector_pauses():
            got[variant.label] = measure(spec, Path(tmp), args, variant)
    width = max(len(v.label) for v in agents)
    rows = [
        ("measured under", lambda f: f.load),
        ("GetPreferredAllocation (vcuda-core)", lambda f: figure("", f.preferred)),
        ("Allocate (vcuda-core)", lambda f: figure("", f.allocate)),
        ("PreStartContainer (vcuda-core)", lambda f: figure("", f.prestart)),
        ("pod lists per admission", lambda f: f"{f.lists / max(1, args.pods):.2f} ({f.lists} for {args.pods})"),
    ]
    for title, pick in rows:
        print(title)
        for v in agents:
            print(f"    {v.label:{width}s} {pick(got[v.label])}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", type=spec_arg, action="append", default=None, help="node spec (repeatable)")
    parser.add_argument("--known", type=int, default=40, help="pods the agent's cache has seen")
    parser.add_argument("--pods", type=int, default=40, help="pods admitted behind the held watch")
    add_before_arguments(parser)
    args = parser.parse_args()
    prompt_threads()
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    specs = args.spec or [SPEC_DIR / "h100-nvlink-x8.json"]
    with variants(args.before, args.before_python) as agents:
        for i, spec in enumerate(specs):
            run(spec, args, agents if i % 2 == 0 else agents[::-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
