"""gpu-manager-extender at scale: filter, prioritize and bind latency, and the process's memory.

100 nodes x 8 GPUs (synthetic ``tencent.com/gpu-inventory`` annotations, no agents) and 2,000
running pods (shares and whole GPUs with gpu-admission's annotations) in the API-server
simulator; the real ``gpu-manager-extender`` process watches them. Each verb is called over HTTP
with a kept-alive connection, as kube-scheduler does: filter and prioritize with the 100 full
Node objects (``nodeCacheCapable: false``) and, for comparison, with node names only; bind of
fresh pending pods one at a time and from 8 threads. Prints median and p99 per verb and the
extender's resident memory (now and peak).

    .venv/bin/python bench/bench_extender.py [--nodes 100] [--pods 2000] [--requests 400]
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gpumanager import names
from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.kube.gpu_inventory import ANNOTATION, encode
from simnode.apiserver import ApiServerSimulator
from simnode.extender_process import ExtenderProcess
from simnode.multinode import pending_pod

GIB = 1 << 30
BLOCKS_PER_GIB = GIB // names.MEMORY_BLOCK_BYTES
GPUS = 8


def inventory(nvlink: bool) -> str:
    gpus = [
        GPUInfo(i, f"GPU-{i:08x}", "NVIDIA A800 80GB PCIe", i, 80 * GIB, f"0000:{i:02x}:00.0", i // 4)
        for i in range(GPUS)
    ]
    levels = tuple(tuple(0 if a == b else (20 if a // 4 == b // 4 else 50) for b in range(GPUS)) for a in range(GPUS))
    links = tuple((a, a + 1, 4) for a in range(0, GPUS, 2)) if nvlink else ()
    return encode(gpus, NodeTopology(levels=levels, nvlink=links), {}, share_mode=True)


def populate(api: ApiServerSimulator, nodes: int, pods: int) -> list[str]:
    """Nodes with inventories and ``pods`` running pods spread over them.

    On each node: 0-2 whole-GPU pods, shares on the next GPUs (up to 88 of their 100 cores), and
    GPUs 6 and 7 free (so bind has room and two whole GPUs fit everywhere).
    """
    node_names = [f"node-{i:03d}" for i in range(nodes)]
    capacity = {names.VCORE_RESOURCE: str(100 * GPUS), names.VMEMORY_RESOURCE: str(GPUS * 80 * BLOCKS_PER_GIB)}
    for i, name in enumerate(node_names):
        api.add_node(name, capacity=capacity, annotations={ANNOTATION: inventory(nvlink=i % 2 == 0)})
    per_node = pods // nodes
    for i, name in enumerate(node_names):
        whole = i % 3
        shares = per_node - whole
        share_gpus = list(range(whole, GPUS - 2))
        per_gpu = -(-shares // len(share_gpus))
        cores = max(1, min(88 // per_gpu, 45))
        slots: list[tuple[int, int | None]] = [(g, None) for g in range(whole)]
        slots += [(share_gpus[k % len(share_gpus)], cores) for k in range(shares)]
        for k, (gpu, share) in enumerate(slots):
            container = (share, 2 * BLOCKS_PER_GIB) if share else (100, 0)
            ann = {
                f"{names.PREDICATE_GPU_IDX_PREFIX}0": str(gpu),
                names.PREDICATE_NODE: name,
                names.PREDICATE_TIME: str(time.time_ns()),
                names.GPU_ASSIGNED: "true",
            }
            pod = pending_pod(f"run-{name}-{k}", [container], node=name, annotations=ann)
            pod["status"] = {"phase": "Running"}
            api.create_pod(pod)
    return node_names


class Client:
    """One kept-alive HTTP connection to the extender."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.conn.connect()
        assert self.conn.sock is not None  # as Go's client: no Nagle delay between headers and body
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def post(self, path: str, body: bytes) -> tuple[float, Any]:
        started = time.perf_counter()
        self.conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        data = resp.read()
        elapsed = time.perf_counter() - started
        if resp.status != 200:
            raise RuntimeError(f"{path}: {resp.status} {data[:200]!r}")
        return elapsed, json.loads(data)


def buckets(ext: ExtenderProcess, verb: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of the extender's own latency histogram for ``verb``."""
    out = []
    for family in text_string_to_metric_families(ext.metrics()):
        if family.name != "gpu_extender_request_duration_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels.get("verb") == verb:
                out.append((float(sample.labels["le"]), sample.value))
    return sorted(out)


def server_side(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> str:
    """Median and p99 (the bucket bound they fall in) of the requests between two readings."""
    previous = dict(before)
    counts = [(le, a - previous.get(le, 0.0)) for le, a in after]
    total = counts[-1][1] if counts else 0
    if not total:
        return ""

    def bound(q: float) -> str:
        le = next(le for le, n in counts if n >= q * total)
        return "> 5 s" if le == float("inf") else f"<= {le * 1e3:g} ms"

    return f"   (in the extender: median {bound(0.5)}, p99 {bound(0.99)})"


def figures(label: str, samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return (
        f"{label:<44} n={len(samples):<4} median {statistics.median(samples) * 1e3:7.2f} ms   p99 {p99 * 1e3:7.2f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=400)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench-extender-"))
    with ApiServerSimulator(history=100_000, bookmark_interval=60.0) as api:
        t0 = time.monotonic()
        node_names = populate(api, args.nodes, args.pods)
        took = time.monotonic() - t0
        print(f"{args.nodes} nodes x {GPUS} GPUs, {len(api.pods())} running pods ({took:.1f} s to create)")
        ext = ExtenderProcess(workdir, api.write_component_kubeconfig(workdir / "kubeconfig", "extender"))
        t0 = time.monotonic()
        ext.start(timeout=120)
        took = time.monotonic() - t0
        print(f"extender ready (listed nodes and pods) in {took:.2f} s; RSS {ext.rss_kib()[0] / 1024:.1f} MiB")
        # The client's own pauses are not the extender's: no garbage collection in this process
        # (it also hosts the API server) while measuring.
        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            run(api, ext, node_names, args.requests)
        finally:
            rss, peak = ext.rss_kib()
            print(f"extender RSS now {rss / 1024:.1f} MiB, peak {peak / 1024:.1f} MiB")
            ext.stop()
    return 0


def run(api: ApiServerSimulator, ext: ExtenderProcess, node_names: list[str], requests: int) -> None:
    client = Client(ext.port)
    nodes = api.nodes()
    shapes = [("share 30 cores / 8 GiB", [(30, 8 * BLOCKS_PER_GIB)]), ("2 whole GPUs", [(200, 0)])]
    for label, containers in shapes:
        pod = pending_pod("probe", containers)
        pod["metadata"]["uid"] = "probe-uid"
        full = json.dumps({"Pod": pod, "Nodes": {"metadata": {}, "items": nodes}, "NodeNames": None}).encode()
        short = json.dumps({"Pod": pod, "Nodes": None, "NodeNames": node_names}).encode()
        sizes = f"{len(full) / 1024:.0f} KiB with Node objects, {len(short) / 1024:.1f} KiB with names"
        print(f"-- {label}: requests of {sizes}")
        for _ in range(20):  # warm up
            client.post("/scheduler/filter", full)
        passed = len(client.post("/scheduler/filter", full)[1]["Nodes"]["items"])
        for verb, body, what in (
            ("filter", full, f"filter, {len(nodes)} Node objects ({passed} pass)"),
            ("filter", short, f"filter, {len(nodes)} node names"),
            ("prioritize", full, f"prioritize, {len(nodes)} Node objects"),
        ):
            before = buckets(ext, verb)
            samples = [client.post(f"/scheduler/{verb}", body)[0] for _ in range(requests)]
            print(figures(what, samples) + server_side(before, buckets(ext, verb)))

    # bind: fresh pending pods, each to the first node filter lets through (filter is not timed here).
    count = min(requests, 300)
    created = [api.create_pod(pending_pod(f"bind-{i}", [(20, 2 * BLOCKS_PER_GIB)])) for i in range(count * 2)]

    def bind_body(c: Client, p: dict[str, Any], i: int) -> bytes:
        md = p["metadata"]
        k = i % len(node_names)
        probe = json.dumps({"Pod": p, "Nodes": None, "NodeNames": node_names[k:] + node_names[:k]}).encode()
        fits = c.post("/scheduler/filter", probe)[1]["NodeNames"] or node_names
        args = {"PodName": md["name"], "PodNamespace": "default", "PodUID": md["uid"], "Node": fits[0]}
        return json.dumps(args).encode()

    samples, errors = [], 0
    before = buckets(ext, "bind")
    for i, p in enumerate(created[:count]):
        elapsed, answer = client.post("/scheduler/bind", bind_body(client, p, i))
        samples.append(elapsed)
        if answer["Error"] and not errors:
            print(f"first refusal: {answer['Error']}")
        errors += bool(answer["Error"])
    print(figures("bind, one at a time", samples) + f"   refused {errors}" + server_side(before, buckets(ext, "bind")))

    lock = threading.Lock()
    parallel: list[float] = []
    failed = [0]
    rest = created[count:]

    def worker(offset: int) -> None:
        c = Client(ext.port)
        for i in range(offset, len(rest), 8):
            body = bind_body(c, rest[i], i)
            elapsed, answer = c.post("/scheduler/bind", body)
            with lock:
                parallel.append(elapsed)
                failed[0] += bool(answer["Error"])

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(figures("bind, 8 at a time (same node may race)", parallel) + f"   refused {failed[0]}")


if __name__ == "__main__":
    sys.exit(main())
