"""DRA mode benchmark on the simulated node (agent in --mode=dra, kubelet DRA stand-in, API-server simulator).

Prints (a) NodePrepareResources of one claim over real gRPC (the agent GETs the claim from the API
server, checks it, records and checkpoints it, writes vcuda.config and the CDI spec), median and
p99; (b) agent process start -> its ResourceSlice in the API server; (c) on 16 x H200 with 200
prepared claims: the agent's RSS and the p99 of one more Prepare. Targets: (a) p99 < 20 ms,
(b) < 1 s, (c) reported.

    python bench/bench_dra.py [--prepares 200] [--starts 5] [--before REF] [--only a|b|c ...]

With ``--before REF`` the start (b) of the agent of git revision REF is measured too, the starts
of the two alternating.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from figures import Variant, load, prompt_threads, variants

from simnode.dra_cluster import DRIVER, NODE, DRACluster
from simnode.gpusim_state import ensure_sim_built


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def summary(name: str, values_s: list[float], target_ms: float | None, stat: str) -> str:
    ms = [v * 1000 for v in values_s]
    med, p99 = statistics.median(ms), percentile(ms, 99)
    line = f"{name:52s} n={len(ms):3d} median={med:8.2f} ms p99={p99:8.2f} ms max={max(ms):8.2f} ms"
    if target_ms is not None:
        verdict = "ok" if (p99 if stat == "p99" else med) < target_ms else "OVER TARGET"
        line += f" (target {stat} < {target_ms:g} ms: {verdict})"
    return line


def allocated_claim(c: DRACluster, name: str, device: str, cores: int, memory: str) -> str:
    """An allocated share claim on ``device`` (as the scheduler writes it); returns its UID."""
    body = {
        "metadata": {"name": name, "namespace": "bench"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
    }
    created = json.loads(c.resource.create_namespaced_resource_claim("bench", body, _preload_content=False).data)
    result = {
        "request": "gpu",
        "driver": DRIVER,
        "pool": NODE,
        "device": device,
        "shareID": f"5e1ec7ed-0000-4000-8000-{len(name):04d}{abs(hash(name)) % 10**8:08d}",
        "consumedCapacity": {"cores": str(cores), "memory": memory},
    }
    c.resource.patch_namespaced_resource_claim_status(
        name, "bench", {"status": {"allocation": {"devices": {"results": [result]}}}}, _preload_content=False
    )
    return str(created["metadata"]["uid"])


def timed_prepare(c: DRACluster, name: str, uid: str) -> float:
    assert c.kubelet is not None
    start = time.perf_counter()
    answer = c.kubelet.prepare(DRIVER, [("bench", name, uid)])
    elapsed = time.perf_counter() - start
    if answer[uid]["error"]:
        raise RuntimeError(answer[uid]["error"])
    return elapsed


def bench_prepare(workdir: Path, n: int) -> None:
    with DRACluster(workdir, "h100-nvlink-x8", api_process=True) as c:
        assert c.kubelet is not None
        times = []
        for i in range(n + 10):
            name = f"one-{i}"
            uid = allocated_claim(c, name, "gpu-0", 30, "4Gi")
            elapsed = timed_prepare(c, name, uid)
            c.kubelet.unprepare(DRIVER, [("bench", name, uid)])
            if i >= 10:  # the first calls warm the channel and the agent's caches
                times.append(elapsed)
        print(summary("(a) NodePrepareResources, one claim", times, 20.0, "p99"), flush=True)


def bench_start(workdir: Path, starts: int, agents: list[Variant]) -> None:
    with DRACluster(workdir, "h200-x16", api_process=True) as c:
        assert c.agent is not None
        times: dict[str, list[float]] = {v.label: [] for v in agents}
        inside: dict[str, list[float]] = {v.label: [] for v in agents}
        for i in range(starts):
            # Alternated, so that load falls on each agent alike.
            for variant in agents if i % 2 == 0 else agents[::-1]:
                c.agent.stop()
                c.resource.delete_collection_resource_slice(field_selector=f"spec.nodeName={NODE}")
                start = time.monotonic()
                published_before = c.agent.log_text().count("published ResourceSlice") if c.agent else 0
                c.start_agent(wait=False, env=variant.env)
                while c.slice() is None:
                    if time.monotonic() - start > 30:
                        raise RuntimeError("no ResourceSlice within 30 s")
                    time.sleep(0.005)
                times[variant.label].append(time.monotonic() - start)
                deadline = time.monotonic() + 10
                while c.agent.log_text().count("published ResourceSlice") <= published_before:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the agent did not log its published ResourceSlice")
                    time.sleep(0.01)
                inside[variant.label].append(
                    _log_span(c.agent.log_text(), "starting on node", "published ResourceSlice")
                )
        for variant in agents:
            print(
                summary(
                    f"(b) exec -> ResourceSlice in the API server, {variant.label}",
                    times[variant.label],
                    1000.0,
                    "median",
                ),
                flush=True,
            )
            print(
                summary(
                    f"(b) first log line -> slice published, {variant.label}", inside[variant.label], None, "median"
                ),
                flush=True,
            )
        print(f"    {load()}", flush=True)


def _log_span(text: str, first: str, last: str) -> float:
    """Seconds between the last line containing ``first`` and the next line containing ``last``."""
    lines = text.splitlines()
    begin = max(i for i, line in enumerate(lines) if first in line)
    end = next(i for i in range(begin, len(lines)) if last in lines[i])

    def stamp(line: str) -> float:
        day, clock = line.split()[:2]
        t = datetime.datetime.strptime(f"{day} {clock}", "%Y-%m-%d %H:%M:%S,%f")
        return t.timestamp()

    return stamp(lines[end]) - stamp(lines[begin])


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing")


def bench_many(workdir: Path, claims: int) -> None:
    with DRACluster(workdir, "h200-x16", api_process=True) as c:
        assert c.agent is not None
        for i in range(claims):
            name = f"c-{i}"
            uid = allocated_claim(c, name, f"gpu-{i % 16}", 7, "4Gi")
            timed_prepare(c, name, uid)
        before = rss_kib(c.agent.pid, "VmRSS")
        times = []
        for i in range(100):
            name = f"extra-{i}"
            uid = allocated_claim(c, name, f"gpu-{i % 16}", 1, "256Mi")
            times.append(timed_prepare(c, name, uid))
            assert c.kubelet is not None
            c.kubelet.unprepare(DRIVER, [("bench", name, uid)])
        print(summary(f"(c) NodePrepareResources with {claims} claims prepared", times, None, "p99"), flush=True)
        print(
            f"{'(c) agent RSS with ' + str(claims) + ' claims (16 x H200)':52s} "
            f"VmRSS={before / 1024:.1f} MiB VmHWM={rss_kib(c.agent.pid, 'VmHWM') / 1024:.1f} MiB",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prepares", type=int, default=200)
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--claims", type=int, default=200)
    parser.add_argument(
        "--before", metavar="REF", help="also measure (b) with the agent of git revision REF, alternating starts"
    )
    parser.add_argument("--only", choices=["a", "b", "c"], action="append", help="run only these parts")
    args = parser.parse_args(argv)
    prompt_threads()
    parts = set(args.only or ["a", "b", "c"])
    logging.basicConfig(level=logging.ERROR)
    ensure_sim_built()
    with tempfile.TemporaryDirectory(prefix="bench-dra-") as tmp:
        if "a" in parts:
            bench_prepare(Path(tmp) / "a", args.prepares)
        if "b" in parts:
            with variants(args.before) as agents:
                bench_start(Path(tmp) / "b", args.starts, agents)
        if "c" in parts:
            bench_many(Path(tmp) / "c", args.claims)
    return 0


if __name__ == "__main__":
    sys.exit(main())
