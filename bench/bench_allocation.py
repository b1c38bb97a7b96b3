"""Allocation benchmark: nodes filled with running shared pods, and bursts of concurrent admissions.

For each node spec (8 x H100 and 16 x H200 by default) it prints, as the kubelet simulator
sees them, median and p99:

  Allocate (vcuda-core) while the node fills up to --pods running pods   (target p50 < 1 ms, p99 < 3 ms)
  PreStartContainer (vcuda-core) for the same pods
  --burst concurrent Allocate and PreStart (each from its own thread)    (target p99 < 50 ms)
  GET /metrics with those pods running, and the agent's RSS

Every Allocate answer is durable before it leaves the agent (the checkpoint journal).

    python bench/bench_allocation.py [--pods 200] [--burst 50] [--scrapes 30] [--spec ...]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from gpumanager import names
from simnode.agent_process import SPEC_DIR
from simnode.cluster import PodRun, SimCluster, gpu_pod

CORE = names.VCORE_RESOURCE
MEM = names.VMEMORY_RESOURCE


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def line(name: str, seconds: list[float], target: str, ok: bool) -> str:
    """One line: n, median, p99, max in ms, and the verdict."""
    ms = [s * 1000 for s in seconds]
    return (
        f"{name:44s} n={len(ms):4d} median={statistics.median(ms):7.2f} ms p99={percentile(ms, 99):7.2f} ms "
        f"max={max(ms):7.2f} ms (target {target}: {'ok' if ok else 'OVER TARGET'})"
    )


def burst(cluster: SimCluster, count: int, offset: int) -> tuple[list[float], list[float]]:
    """``count`` pods admitted and started at once, each from its own thread."""
    runs = [cluster.create(gpu_pod(f"burst-{offset + i:03d}", [("main", 3, 2)])) for i in range(count)]
    time.sleep(1.0)  # the agent's pod cache sees them, as it would before the kubelet admits them
    allocate: list[float] = []
    prestart: list[float] = []
    lock = threading.Lock()
    go = threading.Event()

    def one(manifest: dict[str, object]) -> None:
        go.wait()
        run: PodRun = cluster.admit(manifest, create=False)
        started = time.perf_counter()
        cluster.kubelet.pre_start(CORE, pod_uid=run.uid, container_name="main")
        took = time.perf_counter() - started
        with lock:
            allocate.append(run.core["main"].timings.allocate_seconds or 0.0)
            prestart.append(took)

    threads = [threading.Thread(target=one, args=(m,)) for m in runs]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(120)
    return allocate, prestart


def run(spec: Path, workdir: Path, args: argparse.Namespace) -> None:
    cluster = SimCluster(workdir, spec, agent_flags=["--allocation-check-period=30"], api_process=True)
    cluster.start()
    allocate: list[float] = []
    prestart: list[float] = []
    scrape: list[float] = []
    try:
        manifests = [gpu_pod(f"bench-{i:03d}", [("main", 3, 2)]) for i in range(args.pods)]
        for m in manifests:
            cluster.create(m)
        time.sleep(1.0)  # let the agent's pod cache see them, as it would before the kubelet admits them
        for run_ in list(cluster.runs.values()):
            run_ = cluster.admit(run_.manifest, create=False)
            allocate.append(run_.core["main"].timings.allocate_seconds or 0.0)
            started = time.perf_counter()
            cluster.kubelet.pre_start(CORE, pod_uid=run_.uid, container_name="main")
            prestart.append(time.perf_counter() - started)
            cluster.start_containers(run_)
        burst_allocate, burst_prestart = burst(cluster, args.burst, args.pods)
        assert cluster.agent is not None
        url = f"http://127.0.0.1:{cluster.agent.query_port}/metrics"
        size = 0
        for _ in range(args.scrapes):
            started = time.perf_counter()
            with urllib.request.urlopen(url, timeout=10) as resp:
                size = len(resp.read())
            scrape.append(time.perf_counter() - started)
        rss = cluster.agent.peak_rss_kib()
    finally:
        cluster.stop()
    ms = [a * 1000 for a in allocate]
    print(f"node: {spec.name}, {args.pods} shared pods (3 vcuda-core, 512 MiB each), then a burst of {args.burst}")
    print(line("Allocate (vcuda-core), node filling up", allocate, "p50 < 1 ms, p99 < 3 ms",
               statistics.median(ms) < 1 and percentile(ms, 99) < 3))  # fmt: skip
    print(line("PreStartContainer (vcuda-core)", prestart, "p99 < 20 ms", percentile(prestart, 99) < 0.02))
    both = burst_allocate + burst_prestart
    print(line(f"{args.burst} concurrent Allocate", burst_allocate, "p99 < 50 ms", percentile(both, 99) < 0.05))
    print(
        line(f"{args.burst} concurrent PreStartContainer", burst_prestart, "p99 < 50 ms", percentile(both, 99) < 0.05)
    )
    print(line(f"GET /metrics ({size // 1024} KiB)", scrape, "p99 < 50 ms", percentile(scrape, 99) < 0.05))
    print(f"{'agent peak RSS (VmHWM)':44s} {rss / 1024:.1f} MiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", type=Path, action="append", default=None, help="node spec (repeatable)")
    parser.add_argument("--pods", type=int, default=200)
    parser.add_argument("--burst", type=int, default=50)
    parser.add_argument("--scrapes", type=int, default=30)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    specs = args.spec or [SPEC_DIR / "h100-nvlink-x8.json", SPEC_DIR / "h200-x16.json"]
    for spec in specs:
        with tempfile.TemporaryDirectory(prefix="bench-allocation-") as tmp:
            run(spec, Path(tmp), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
