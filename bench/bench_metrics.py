"""Metrics benchmark: GET /metrics on a 16 x H200 node with 250 running GPU containers.

Every container has a process on its GPU (memory used, SM utilisation samples), so each
scrape computes every family the agent exports: per-container usage and limits, per-GPU
allocation and health, call latencies, process metrics. Scrapes two ways: as curl does
(a new connection each, no ``Accept-Encoding``) and as Prometheus does (``Accept-Encoding:
gzip`` on a connection kept open, where the agent keeps it). Prints for each the scrape latency
as the client sees it (median, p99; target p99 < 20 ms), the bytes received and the
connections opened, and the agent's CPU time per scrape (less noisy than wall clock on a
shared machine). Then ``--stuck`` clients send a scrape each and never read the answer, and
the latency of Prometheus-style scrapes meanwhile is measured (and how many were refused).

With ``--before REF`` the agent of git revision REF is measured too, side by side: both agents
run at once and their scrapes alternate (which goes first alternates too), so that load falls on
both alike.

    python bench/bench_metrics.py [--containers 250] [--scrapes 200] [--stuck 64] [--legacy-metrics]
                                  [--before REF]
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import logging
import os
import socket
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from figures import Variant, add_before_arguments, figure, load, variants

from simnode.cluster import SimCluster, gpu_pod
from simnode.gpusim_state import GpuSimState

MIB = 1 << 20


@dataclass
class Way:
    """One way of scraping one agent: latencies, bytes received, connections opened, agent CPU seconds."""

    seconds: list[float] = field(default_factory=list)
    received: int = 0
    connections: int = 0
    refused: int = 0
    cpu: float = 0.0
    samples: int = 0


class Prometheus:
    """Scrapes as Prometheus does: ``Accept-Encoding: gzip``, one connection kept while the agent keeps it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: http.client.HTTPConnection | None = None

    def scrape(self, way: Way) -> bytes:
        if self.conn is None or self.conn.sock is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            self.conn.connect()
            way.connections += 1
        self.conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
        resp = self.conn.getresponse()
        raw = resp.read()
        way.received += len(raw)
        if resp.status != 200:
            way.refused += 1
            return b""
        if resp.will_close:
            self.conn.close()
        return gzip.decompress(raw) if resp.getheader("Content-Encoding") == "gzip" else raw

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def curl(port: int, way: Way) -> bytes:
    """Scrapes as curl does without --compressed: a new connection, no Accept-Encoding."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        body: bytes = resp.read()
    way.connections += 1
    way.received += len(body)
    return body


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fill(cluster: SimCluster, containers: int) -> int:
    """``containers`` running GPU containers with a process each; the number of pods in /usage."""
    pods = (containers + 1) // 2
    for i in range(pods):
        cluster.create(gpu_pod(f"bench-{i:03d}", [("main", 3, 2), ("side", 3, 2)][: containers - 2 * i]))
    time.sleep(1.0)  # the agent's pod cache sees them before the kubelet admits them
    for r in list(cluster.runs.values()):
        cluster.start_containers(cluster.admit(r.manifest, create=False))
    assert cluster.agent is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.agent.query_port}/usage", timeout=30) as resp:
        usage = json.load(resp).get("usage", {})
    by_uid = {r.uid: r for r in cluster.runs.values()}
    with GpuSimState(cluster.agent.state) as state:
        for uid, stat in usage.items():
            for cname, devices in stat["stat"].items():
                pid = by_uid[uid].pids[cname]
                for dev in devices["dev"]:
                    state.set_process(int(dev["card_idx"]), pid, 300 * MIB, sm_util=20)
    return len(usage)


def stuck_clients(port: int, count: int) -> list[socket.socket]:
    """``count`` connections that ask for the page (plain) and never read the answer."""
    out = []
    for _ in range(count):
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.connect(("127.0.0.1", port))
        c.sendall(b"GET /metrics HTTP/1.1\r\nHost: bench\r\n\r\n")
        out.append(c)
    return out


def run(workdir: Path, args: argparse.Namespace, agents: list[Variant]) -> int:
    flags = ["--legacy-metrics"] if args.legacy_metrics else []
    clusters: list[SimCluster] = []
    try:
        pods = 0
        for i, agent in enumerate(agents):
            (workdir / str(i)).mkdir()
            cluster = SimCluster(
                workdir / str(i), "h200-x16", api_process=True, agent_flags=flags, agent_env=agent.env,
                agent_python=agent.python,
            )  # fmt: skip
            clusters.append(cluster)
            cluster.start()
            pods = fill(cluster, args.containers)
        ports = [c.agent.query_port for c in clusters if c.agent is not None]
        pids = [c.agent.pid for c in clusters if c.agent is not None]
        ways = {name: [Way() for _ in agents] for name in ("curl", "prometheus", "stuck")}
        proms = [Prometheus(port) for port in ports]
        body = [b""] * len(agents)
        for i, port in enumerate(ports):  # warm up
            for _ in range(5):
                body[i] = curl(port, Way())
                proms[i].scrape(Way())
            proms[i].close()  # the scrapes measured open their own
        for name in ("curl", "prometheus"):
            for n in range(args.scrapes):
                # Which agent goes first alternates: the second of a pair measured 0.5 ms more CPU a
                # scrape than the first when both ran the same code.
                for i in sorted(range(len(ports)), reverse=n % 2 == 1):
                    port, way = ports[i], ways[name][i]
                    cpu = cpu_seconds(pids[i])
                    started = time.perf_counter()
                    page = curl(port, way) if name == "curl" else proms[i].scrape(way)
                    way.seconds.append(time.perf_counter() - started)
                    way.cpu += cpu_seconds(pids[i]) - cpu
                    way.samples = sum(1 for ln in page.decode().splitlines() if ln and not ln.startswith("#"))
        if args.stuck:
            for i, port in enumerate(ports):
                way = ways["stuck"][i]
                held = stuck_clients(port, args.stuck)
                try:
                    time.sleep(0.5)
                    for _ in range(args.scrapes // 4):
                        started = time.perf_counter()
                        proms[i].scrape(way)
                        way.seconds.append(time.perf_counter() - started)
                finally:
                    for c in held:
                        c.close()
        for p in proms:
            p.close()
    finally:
        for cluster in clusters:
            cluster.stop()
    print(
        f"node: 16 x H200, {args.containers} running GPU containers with a process each ({pods} pods in /usage)"
        + (", --legacy-metrics (upstream's container_* families too)" if args.legacy_metrics else "")
        + f"; {load()}"
    )
    for i, agent in enumerate(agents):
        print(f"{agent.label}: page {len(body[i]) // 1024} KiB, {ways['curl'][i].samples} samples")
        for name, what in (
            ("curl", "curl: new connection, plain"),
            ("prometheus", "Prometheus: gzip, kept-alive connection"),
            ("stuck", f"Prometheus, {args.stuck} clients not reading"),
        ):
            way = ways[name][i]
            if not way.seconds:
                continue
            n = len(way.seconds)
            line = figure(f"  {what}", way.seconds, target_ms=20)
            extra = f"    {way.received / n / 1024:.1f} KiB received a scrape, {way.connections} connections"
            if name != "stuck":
                extra += f", agent CPU {way.cpu / n * 1000:.2f} ms a scrape"
            else:
                extra += f", {way.refused} refused (503)"
            print(line)
            print(extra)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--containers", type=int, default=250)
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--stuck", type=int, default=64, help="clients that never read their answer (0: none)")
    parser.add_argument("--legacy-metrics", action="store_true", help="the agent also exports upstream's families")
    add_before_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    with (
        variants(args.before, args.before_python) as agents,
        tempfile.TemporaryDirectory(prefix="bench-metrics-") as tmp,
    ):
        return run(Path(tmp), args, agents)


if __name__ == "__main__":
    sys.exit(main())
