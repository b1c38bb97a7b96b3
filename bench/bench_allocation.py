"""Allocation benchmark: a 16 x H200 node filled with 200 running shared pods.

Prints, as the kubelet simulator sees them, the Allocate and PreStartContainer
latencies of the vcuda-core plugin (median, p99; targets p99 < 10 ms and
< 20 ms), the time to scrape /metrics with those pods running (target < 50 ms)
and the agent's peak RSS.

    python bench/bench_allocation.py [--pods 200] [--scrapes 30]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from gpumanager import names
from simnode.cluster import SimCluster, gpu_pod

CORE = names.VCORE_RESOURCE


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def line(name: str, seconds: list[float], target_ms: float) -> str:
    ms = [s * 1000 for s in seconds]
    p99 = percentile(ms, 99)
    verdict = "ok" if p99 < target_ms else "OVER TARGET"
    return (
        f"{name:36s} n={len(ms):4d} median={statistics.median(ms):7.2f} ms p99={p99:7.2f} ms "
        f"max={max(ms):7.2f} ms (target p99 < {target_ms:g} ms: {verdict})"
    )


def run(workdir: Path, pods: int, scrapes: int) -> int:
    cluster = SimCluster(workdir, "h200-x16", agent_flags=["--allocation-check-period=30"], api_process=True)
    cluster.start()
    allocate: list[float] = []
    prestart: list[float] = []
    scrape: list[float] = []
    try:
        manifests = [gpu_pod(f"bench-{i:03d}", [("main", 5, 2)]) for i in range(pods)]
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
        assert cluster.agent is not None
        url = f"http://127.0.0.1:{cluster.agent.query_port}/metrics"
        size = 0
        for _ in range(scrapes):
            started = time.perf_counter()
            with urllib.request.urlopen(url, timeout=10) as resp:
                size = len(resp.read())
            scrape.append(time.perf_counter() - started)
        rss = cluster.agent.peak_rss_kib()
    finally:
        cluster.stop()
    print(f"node: 16 x H200 (h200-x16.json), {pods} shared pods (5 vcuda-core, 512 MiB each)")
    print(line("Allocate (vcuda-core)", allocate, 10))
    print(line("PreStartContainer (vcuda-core)", prestart, 20))
    print(line(f"GET /metrics ({size // 1024} KiB)", scrape, 50))
    print(f"{'agent peak RSS (VmHWM)':36s} {rss / 1024:.1f} MiB")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=200)
    parser.add_argument("--scrapes", type=int, default=30)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="bench-allocation-") as tmp:
        return run(Path(tmp), args.pods, args.scrapes)


if __name__ == "__main__":
    sys.exit(main())
