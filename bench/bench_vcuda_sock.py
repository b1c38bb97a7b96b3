"""What the per-pod vcuda.sock costs: agent RSS and threads with 0 and N running shared pods.

Runs the agent on a simulated 8 x H100 node, measures its resident set (VmRSS, sampled
several times after it settles: median and max) and thread count with no pod, then with
N running shared pods (each serving its vcuda.sock), and the RegisterVDevice round trip of
vcuda/build/gpu-client (fork + exec + connect + call, as upstream's library does it) against
those pods (median, p99). Target: < 80 MiB with 250 running pods.

    python bench/bench_vcuda_sock.py [--pods 250] [--calls 100]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from simnode.cluster import SimCluster, gpu_pod
from simnode.gpusim_state import repo_root

GPU_CLIENT = repo_root() / "vcuda" / "build" / "gpu-client"
RSS_TARGET_MIB = 80


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def status_field(pid: int, field: str) -> int:
    """A number of /proc/<pid>/status (VmRSS in KiB, Threads)."""
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith(field + ":"):
            return int(row.split()[1])
    raise RuntimeError(f"{field} missing from /proc/{pid}/status")


def settle_and_sample(pid: int, samples: int = 10, pause: float = 0.3) -> tuple[list[float], int]:
    """RSS samples in MiB after a short settling time, and the thread count."""
    time.sleep(2.0)
    rss = []
    for _ in range(samples):
        rss.append(status_field(pid, "VmRSS") / 1024)
        time.sleep(pause)
    return rss, status_field(pid, "Threads")


def register_calls(cluster: SimCluster, calls: int) -> list[float]:
    """Round trips of gpu-client against random running pods, seconds."""
    runs = list(cluster.runs.values())
    rng = random.Random(7)
    took = []
    for _ in range(calls):
        run = rng.choice(runs)
        cid = f"{run.uid[:8]}main".replace("-", "")
        args = [str(GPU_CLIENT), "--addr", str(cluster.vm_path / run.uid / "vcuda.sock"), "--bus-id", ""]
        args += ["--pod-uid", run.uid, "--cont-id", cid, "--timeout", "10"]
        started = time.perf_counter()
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        took.append(time.perf_counter() - started)
        if done.returncode != 0:
            raise RuntimeError(f"gpu-client failed: {done.stderr.strip()}")
    return took


def run(workdir: Path, pods: int, calls: int) -> int:
    cluster = SimCluster(workdir, "h100-nvlink-x8", agent_flags=["--allocation-check-period=30"], api_process=True)
    cluster.start()
    try:
        assert cluster.agent is not None
        pid = cluster.agent.pid
        idle_rss, idle_threads = settle_and_sample(pid)
        for i in range(pods):
            cluster.run_pod(gpu_pod(f"share-{i:03d}", [("main", 3, 1)]))
        served = sum(1 for r in cluster.runs.values() if (cluster.vm_path / r.uid / "vcuda.sock").exists())
        busy_rss, busy_threads = settle_and_sample(pid)
        took = register_calls(cluster, calls) if calls and GPU_CLIENT.exists() else []
    finally:
        cluster.stop()
    print(f"node: 8 x H100 (h100-nvlink-x8.json); {pods} running shared pods, {served} vcuda.sock served")
    for label, rss, threads in (("0 pods", idle_rss, idle_threads), (f"{pods} pods", busy_rss, busy_threads)):
        print(
            f"agent RSS with {label:9s} median={statistics.median(rss):6.1f} MiB max={max(rss):6.1f} MiB "
            f"threads={threads}"
        )
    added = statistics.median(busy_rss) - statistics.median(idle_rss)
    verdict = "ok" if statistics.median(busy_rss) < RSS_TARGET_MIB else "OVER TARGET"
    print(
        f"added by {pods} pods: {added:.1f} MiB ({added * 1024 / max(pods, 1):.0f} KiB per pod), "
        f"{busy_threads - idle_threads} threads (target < {RSS_TARGET_MIB} MiB in all: {verdict})"
    )
    if took:
        ms = [t * 1000 for t in took]
        print(
            f"gpu-client RegisterVDevice round trip n={len(ms)} median={statistics.median(ms):.2f} ms "
            f"p99={percentile(ms, 99):.2f} ms"
        )
    elif calls:
        print(f"gpu-client round trip: skipped ({GPU_CLIENT} is not built)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=250)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench-vcuda-sock-") as tmp:
        return run(Path(tmp), args.pods, args.calls)


if __name__ == "__main__":
    sys.exit(main())
