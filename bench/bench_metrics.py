"""Metrics benchmark: GET /metrics on a 16 x H200 node with 250 running GPU containers.

Every container has a process on its GPU (memory used, SM utilisation samples), so each
scrape computes every family the agent exports: per-container usage and limits, per-GPU
allocation and health, call latencies, process metrics. Prints the scrape latency as the
client sees it (median, p99; target p99 < 20 ms), the body size and its number of samples.

    python bench/bench_metrics.py [--containers 250] [--scrapes 200] [--legacy-metrics]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from simnode.cluster import SimCluster, gpu_pod
from simnode.gpusim_state import GpuSimState

MIB = 1 << 20


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def run(workdir: Path, containers: int, scrapes: int, legacy: bool = False) -> int:
    cluster = SimCluster(workdir, "h200-x16", api_process=True, agent_flags=["--legacy-metrics"] if legacy else [])
    cluster.start()
    timings: list[float] = []
    try:
        pods = (containers + 1) // 2
        for i in range(pods):
            cluster.create(gpu_pod(f"bench-{i:03d}", [("main", 3, 2), ("side", 3, 2)][: containers - 2 * i]))
        time.sleep(1.0)  # the agent's pod cache sees them before the kubelet admits them
        for r in list(cluster.runs.values()):
            cluster.start_containers(cluster.admit(r.manifest, create=False))
        assert cluster.agent is not None
        base = f"http://127.0.0.1:{cluster.agent.query_port}"
        with urllib.request.urlopen(f"{base}/usage", timeout=30) as resp:
            usage = json.load(resp).get("usage", {})
        by_uid = {r.uid: r for r in cluster.runs.values()}
        with GpuSimState(cluster.agent.state) as state:
            for uid, stat in usage.items():
                for cname, devices in stat["stat"].items():
                    pid = by_uid[uid].pids[cname]
                    for dev in devices["dev"]:
                        state.set_process(int(dev["card_idx"]), pid, 300 * MIB, sm_util=20)
        url = f"{base}/metrics"
        body = b""
        for _ in range(5):  # warm up
            with urllib.request.urlopen(url, timeout=30) as resp:
                body = resp.read()
        for _ in range(scrapes):
            started = time.perf_counter()
            with urllib.request.urlopen(url, timeout=30) as resp:
                body = resp.read()
            timings.append(time.perf_counter() - started)
    finally:
        cluster.stop()
    samples = sum(1 for ln in body.decode().splitlines() if ln and not ln.startswith("#"))
    ms = [t * 1000 for t in timings]
    p99 = percentile(ms, 99)
    print(
        f"node: 16 x H200, {containers} running GPU containers with a process each ({len(usage)} pods in /usage)"
        + (", --legacy-metrics (upstream's container_* families too)" if legacy else "")
    )
    print(
        f"GET /metrics ({len(body) // 1024} KiB, {samples} samples) n={len(ms)} "
        f"median={statistics.median(ms):.2f} ms p99={p99:.2f} ms max={max(ms):.2f} ms "
        f"(target p99 < 20 ms: {'ok' if p99 < 20 else 'OVER TARGET'})"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--containers", type=int, default=250)
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--legacy-metrics", action="store_true", help="the agent also exports upstream's families")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as tmp:
        return run(Path(tmp), args.containers, args.scrapes, args.legacy_metrics)


if __name__ == "__main__":
    sys.exit(main())
