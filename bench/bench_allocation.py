"""Allocation benchmark: nodes filled with running shared pods, and bursts of concurrent admissions.

For each node spec (8 x H100 and 16 x H200 by default) it prints, as the kubelet simulator
sees them, median and p99:

  Allocate (vcuda-core) of whole-GPU pods on the empty node (--whole-rounds times over its GPUs)
  Allocate (vcuda-core) while the node fills up to --pods running pods   (target p50 < 1 ms, p99 < 3 ms)
  PreStartContainer (vcuda-core) for the same pods
  --burst concurrent Allocate and PreStart (each from its own thread)    (target p99 < 50 ms)
  --burst concurrent Allocate calls whose requests were made before the burst: the calls alone, without
          the simulated kubelet's own admission work (in Python, on the same two cores) inside the figure
  --burst concurrent vcuda-memory Allocate (validation only): what gRPC and this client cost a burst
  the same pods, one at a time and in a burst, through the kubelet simulator for a plugin that does nothing
          (bench/floor_plugin.py, in its own process): what the simulator, gRPC and this machine cost, beside
          what ours costs
  GET /metrics with those pods running                                  (target p99 < 20 ms)
  the agent's RSS with every pod running                                (target < 80 MiB)
  GetPreferredAllocation, and what one O_DSYNC journal write costs on this disk (back to back, and 5 ms
  after the last one, as between two Allocate calls: an idle virtual disk can take several times longer)

Every Allocate answer is durable before it leaves the agent (the checkpoint journal), so one flush
of the disk is the floor of an Allocate. With ``--before REF`` the agent of git revision REF runs the
same steps too (the order alternates between node specs); each block carries the load average. This
process (the kubelet simulator's) runs each agent's block with its garbage collector off
(:func:`figures.no_collector_pauses`): a Go kubelet's collector does not stop it mid-call. With
``--before-python PATH`` that agent (or this checkout's, without ``--before``) runs on another interpreter
(one with the agent's dependencies, e.g. another venv's python).

    python bench/bench_allocation.py [--pods 200] [--burst 50] [--scrapes 30] [--spec ...] [--before REF]
                                     [--before-python PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from figures import (
    Variant,
    add_before_arguments,
    dsync_write_seconds,
    figure,
    histogram,
    histogram_quantile,
    load,
    no_collector_pauses,
    percentile,
    prompt_threads,
    spec_arg,
    variants,
)

from gpumanager import names
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from simnode.agent_process import SPEC_DIR
from simnode.cluster import PodRun, SimCluster, gpu_pod

CORE = names.VCORE_RESOURCE
MEM = names.VMEMORY_RESOURCE
FLOOR_CORE = "example.com/floor-core"  # bench/floor_plugin.py's resources
FLOOR_MEMORY = "example.com/floor-memory"


def burst(cluster: SimCluster, count: int, offset: int) -> tuple[list[float], list[float], list[PodRun]]:
    """``count`` pods admitted and started at once, each from its own thread; their timings and runs."""
    runs = [cluster.create(gpu_pod(f"burst-{offset + i:03d}", [("main", 3, 2)])) for i in range(count)]
    time.sleep(1.0)  # the agent's pod cache sees them, as it would before the kubelet admits them
    allocate: list[float] = []
    prestart: list[float] = []
    admitted: list[PodRun] = []
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
            admitted.append(run)

    threads = [threading.Thread(target=one, args=(m,)) for m in runs]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(120)
    return allocate, prestart, admitted


def burst_floor(cluster: SimCluster, count: int) -> list[float]:
    """``count`` vcuda-memory Allocate calls at once, each from its own thread, on the kubelet's kind of
    channel: validation only, no state, nothing written. What gRPC and this client cost a burst by
    themselves, the floor the concurrent Allocate figures stand on."""
    endpoint = next(r.endpoint for r in reversed(cluster.kubelet.registrations) if r.resource == MEM)
    one_id = sorted(cluster.kubelet.healthy_ids(MEM))[0]
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[one_id])])
    took: list[float] = []
    lock = threading.Lock()
    with grpc.insecure_channel(f"unix://{cluster.kubelet.socket_path.parent / endpoint}") as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        stub.Allocate(request, timeout=10)  # connected before the burst, as the kubelet's channel is
        go = threading.Event()

        def one() -> None:
            go.wait()
            started = time.perf_counter()
            stub.Allocate(request, timeout=30)
            with lock:
                took.append(time.perf_counter() - started)

        threads = [threading.Thread(target=one) for _ in range(count)]
        for t in threads:
            t.start()
        go.set()
        for t in threads:
            t.join(60)
    return took


def burst_calls(cluster: SimCluster, count: int, offset: int) -> list[float]:
    """``count`` vcuda-core Allocate calls at once, each from its own thread on the kubelet's kind of channel,
    for ``count`` waiting pods: the requests (three free device IDs each) are made before the burst, so the
    figure holds the calls alone and none of the kubelet simulator's admission work (device picking,
    GetPreferredAllocation, its checkpoint), which the real kubelet does in Go on its own cores. The
    kubelet simulator records none of these allocations: run it last."""
    runs = [cluster.create(gpu_pod(f"calls-{offset + i:03d}", [("main", 3, 2)])) for i in range(count)]
    time.sleep(1.0)  # the agent's pod cache sees them, as it would before the kubelet admits them
    free = sorted(cluster.kubelet.healthy_ids(CORE).difference(*(a.device_ids for a in cluster.kubelet.allocations())))
    if len(free) < 3 * len(runs):
        raise RuntimeError(f"{len(free)} free vcuda-core devices, {3 * len(runs)} needed")
    requests = [
        pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=free[3 * i : 3 * i + 3])])
        for i in range(len(runs))
    ]
    endpoint = next(r.endpoint for r in reversed(cluster.kubelet.registrations) if r.resource == CORE)
    took: list[float] = []
    lock = threading.Lock()
    with grpc.insecure_channel(f"unix://{cluster.kubelet.socket_path.parent / endpoint}") as channel:
        grpc.channel_ready_future(channel).result(timeout=10)  # connected before the burst
        stub = pb_grpc.DevicePluginStub(channel)
        go = threading.Event()

        def one(request: pb.AllocateRequest) -> None:
            go.wait()
            started = time.perf_counter()
            stub.Allocate(request, timeout=30)
            with lock:
                took.append(time.perf_counter() - started)

        threads = [threading.Thread(target=one, args=(r,)) for r in requests]
        for t in threads:
            t.start()
        go.set()
        for t in threads:
            t.join(60)
    if len(took) != len(requests):
        raise RuntimeError(f"{len(requests) - len(took)} of {len(requests)} Allocate calls failed")
    return took


@dataclass
class FloorFigures:
    """What a plugin that does nothing costs through the kubelet simulator: one pod at a time (each
    right after one of ours in the fill, so both meet the same machine) and in a burst."""

    seq_allocate: list[float] = field(default_factory=list)
    seq_prestart: list[float] = field(default_factory=list)
    burst_allocate: list[float] = field(default_factory=list)
    burst_prestart: list[float] = field(default_factory=list)


@contextlib.contextmanager
def floor_plugin(cluster: SimCluster) -> Iterator[None]:
    """``bench/floor_plugin.py`` (a plugin that answers every call at once) in its own process, registered
    with the kubelet simulator beside the agent, for as long as the block runs."""
    plugin = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("floor_plugin.py")),
            "--kubelet-socket",
            str(cluster.kubelet.socket_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert plugin.stdout is not None
        if plugin.stdout.readline().strip() != "registered":
            raise RuntimeError(f"bench/floor_plugin.py did not register (exit status {plugin.poll()})")
        for resource in (FLOOR_CORE, FLOOR_MEMORY):
            cluster.kubelet.wait_for_registration(resource, timeout=30, with_devices=True)
        yield
    finally:
        plugin.terminate()
        plugin.wait(30)


def floor_pod(cluster: SimCluster, uid: str) -> tuple[float, float]:
    """The fill's calls for one pod (Allocate of 3 with GetPreferredAllocation, Allocate of 2 without,
    then PreStartContainer) through the kubelet simulator for the floor plugin's resources: the seconds
    its Allocate and PreStartContainer took."""
    core = cluster.kubelet.allocate(FLOOR_CORE, 3, pod_uid=uid, container_name="main")
    cluster.kubelet.allocate(FLOOR_MEMORY, 2, pod_uid=uid, container_name="main")
    started = time.perf_counter()
    cluster.kubelet.pre_start(FLOOR_CORE, pod_uid=uid, container_name="main")
    return core.timings.allocate_seconds or 0.0, time.perf_counter() - started


def floor_burst(cluster: SimCluster, count: int, got: FloorFigures) -> None:
    """:func:`burst`'s calls for ``count`` pods, each from its own thread, for the floor plugin."""
    lock = threading.Lock()
    go = threading.Event()

    def one(i: int) -> None:
        go.wait()
        allocate, prestart = floor_pod(cluster, f"floor-burst-{i:03d}")
        with lock:
            got.burst_allocate.append(allocate)
            got.burst_prestart.append(prestart)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(120)
    if len(got.burst_prestart) != count:
        raise RuntimeError(f"{count - len(got.burst_prestart)} of {count} pods failed against bench/floor_plugin.py")


def whole_gpus(cluster: SimCluster, rounds: int) -> list[float]:
    """Allocate (vcuda-core) of pods that each take one whole GPU, on the node before it fills: every GPU
    taken in turn, then the pods deleted, ``rounds`` times."""
    gpus = len(cluster.kubelet.devices(CORE)) // 100
    taken: list[float] = []
    for r in range(rounds):
        runs = [cluster.create(gpu_pod(f"whole-{r}-{i}", [("main", 100, 0)])) for i in range(gpus)]
        time.sleep(1.0)  # the agent's pod cache sees them
        started = []
        for manifest in runs:
            run_ = cluster.admit(manifest, create=False)
            taken.append(run_.core["main"].timings.allocate_seconds or 0.0)
            cluster.kubelet.pre_start(CORE, pod_uid=run_.uid, container_name="main")
            cluster.start_containers(run_)
            started.append(run_)
        for run_ in started:
            cluster.delete(run_, wait=True)
    return taken


CALL_SECONDS = "gpu_manager_kubelet_call_duration_seconds"
WRITE_SECONDS = "gpu_manager_checkpoint_write_duration_seconds"


def scrape(url: str) -> str:
    """The agent's /metrics page."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def rss_kib(pid: int, field: str) -> int:
    """VmRSS or VmHWM of a process, KiB."""
    for text in Path(f"/proc/{pid}/status").read_text().splitlines():
        if text.startswith(field + ":"):
            return int(text.split()[1])
    raise RuntimeError(f"{field} missing")


@dataclass
class Figures:
    """One agent's figures on one node."""

    load: str = ""
    allocate: list[float] = field(default_factory=list)
    whole: list[float] = field(default_factory=list)
    allocate_memory: list[float] = field(default_factory=list)
    preferred: list[float] = field(default_factory=list)
    prestart: list[float] = field(default_factory=list)
    burst_allocate: list[float] = field(default_factory=list)
    burst_prestart: list[float] = field(default_factory=list)
    burst_floor: list[float] = field(default_factory=list)
    burst_calls: list[float] = field(default_factory=list)
    floor: FloorFigures = field(default_factory=lambda: FloorFigures())
    scrape: list[float] = field(default_factory=list)
    scrape_kib: int = 0
    dsync: list[float] = field(default_factory=list)
    dsync_idle: list[float] = field(default_factory=list)
    # The agent's own time in Allocate / PreStartContainer (its histogram): (p50, p99) seconds.
    inside: dict[str, tuple[float, float]] = field(default_factory=dict)
    rss_kib: int = 0
    hwm_kib: int = 0
    pods: int = 0


def measure(spec: Path, workdir: Path, args: argparse.Namespace, variant: Variant) -> Figures:
    got = Figures(load=load())
    cluster = SimCluster(
        workdir,
        spec,
        agent_flags=["--allocation-check-period=30"],
        agent_env=variant.env,
        agent_python=variant.python,
        api_process=True,
    )
    floor = contextlib.ExitStack()
    cluster.start()
    try:
        got.dsync = dsync_write_seconds(cluster.checkpoint_dir)
        got.dsync_idle = dsync_write_seconds(cluster.checkpoint_dir, count=100, pause=0.005)
        assert cluster.agent is not None
        url = f"http://127.0.0.1:{cluster.agent.query_port}/metrics"
        before_whole = scrape(url)
        got.whole = whole_gpus(cluster, args.whole_rounds)
        scrapes = [scrape(url)]
        for key, family, labels in (
            ("whole Allocate", CALL_SECONDS, {"resource": CORE, "call": "Allocate"}),
            ("whole journal write", WRITE_SECONDS, {"kind": "journal"}),
        ):
            b, a = histogram(before_whole, family, labels), histogram(scrapes[0], family, labels)
            got.inside[key] = (histogram_quantile(0.5, b, a), histogram_quantile(0.99, b, a))
        manifests = [gpu_pod(f"bench-{i:03d}", [("main", 3, 2)]) for i in range(args.pods)]
        created = [cluster.create(m) for m in manifests]
        time.sleep(1.0)  # let the agent's pod cache see them, as it would before the kubelet admits them
        floor.enter_context(floor_plugin(cluster))
        for i, manifest in enumerate(created):
            allocate, prestart = floor_pod(cluster, f"floor-seq-{i:03d}")
            got.floor.seq_allocate.append(allocate)
            got.floor.seq_prestart.append(prestart)
            run_ = cluster.admit(manifest, create=False)
            got.allocate.append(run_.core["main"].timings.allocate_seconds or 0.0)
            got.allocate_memory.append(run_.memory["main"].timings.allocate_seconds or 0.0)
            got.preferred.append(run_.core["main"].timings.preferred_seconds or 0.0)
            started = time.perf_counter()
            cluster.kubelet.pre_start(CORE, pod_uid=run_.uid, container_name="main")
            got.prestart.append(time.perf_counter() - started)
            cluster.start_containers(run_)
        scrapes.append(scrape(url))
        got.burst_allocate, got.burst_prestart, burst_runs = burst(cluster, args.burst, args.pods)
        got.burst_floor = burst_floor(cluster, args.burst)
        scrapes.append(scrape(url))
        for phase, (before, after) in (("fill", scrapes[0:2]), ("burst", scrapes[1:3])):
            for call in ("Allocate", "PreStartContainer"):
                labels = {"resource": CORE, "call": call}
                b, a = histogram(before, CALL_SECONDS, labels), histogram(after, CALL_SECONDS, labels)
                got.inside[f"{phase} {call}"] = (histogram_quantile(0.5, b, a), histogram_quantile(0.99, b, a))
            journal = {"kind": "journal"}
            b, a = histogram(before, WRITE_SECONDS, journal), histogram(after, WRITE_SECONDS, journal)
            got.inside[f"{phase} journal write"] = (histogram_quantile(0.5, b, a), histogram_quantile(0.99, b, a))
        got.pods = len(created) + args.burst
        for _ in range(args.scrapes):
            started = time.perf_counter()
            with urllib.request.urlopen(url, timeout=10) as resp:
                got.scrape_kib = len(resp.read()) // 1024
            got.scrape.append(time.perf_counter() - started)
        time.sleep(2.0)  # steady: the burst's garbage collected, the loops at rest
        got.rss_kib = rss_kib(cluster.agent.pid, "VmRSS")
        got.hwm_kib = rss_kib(cluster.agent.pid, "VmHWM")
        for run_ in burst_runs:  # their devices free again for the calls below (a full 8-GPU node has 50 left)
            cluster.delete(run_, wait=True)
        got.burst_calls = burst_calls(cluster, args.burst, args.pods + args.burst)
        floor_burst(cluster, args.burst, got.floor)
    finally:
        floor.close()
        cluster.stop()
    return got


def _verdict(seconds: list[float], pct: float, target_ms: float) -> str:
    if not seconds:
        return ""
    value = percentile([s * 1000 for s in seconds], pct)
    return f" (target p{pct:g} < {target_ms:g} ms: {'ok' if value < target_ms else 'OVER TARGET'})"


def _above(ours: list[float], floor: list[float]) -> str:
    if not ours or not floor:
        return "no samples"
    a, b = [s * 1000 for s in ours], [s * 1000 for s in floor]
    return f"+{statistics.median(a) - statistics.median(b):.2f} ms, +{percentile(a, 99) - percentile(b, 99):.2f} ms"


def run(spec: Path, args: argparse.Namespace, agents: list[Variant]) -> None:
    print(f"== node {spec.name}: {args.pods} shared pods (3 vcuda-core, 512 MiB each), then a burst of {args.burst}")
    got: dict[str, Figures] = {}
    for variant in agents:
        with tempfile.TemporaryDirectory(prefix="bench-allocation-") as tmp, no_collector_pauses():
            got[variant.label] = measure(spec, Path(tmp), args, variant)
    width = max(len(v.label) for v in agents)

    def each(title: str, pick: Callable[[Figures], str]) -> None:
        print(title)
        for v in agents:
            print(f"    {v.label:{width}s} {pick(got[v.label])}")

    each("measured under", lambda f: f.load)
    each("one O_DSYNC journal write on this disk, back to back", lambda f: figure("", f.dsync))
    each(
        "one O_DSYNC journal write 5 ms after the last (as an Allocate pays it: what durability costs)",
        lambda f: figure("", f.dsync_idle),
    )
    each(
        f"Allocate (vcuda-core), node filling up to {args.pods} pods (p50 < 1 ms, p99 < 3 ms)",
        lambda f: figure("", f.allocate, target_ms=3) + _verdict(f.allocate, 50, 1),
    )
    each(
        f"Allocate, {args.pods} pods one at a time, for a plugin that does nothing (the fill's floor: "
        "this client, gRPC and this machine)",
        lambda f: figure("", f.floor.seq_allocate),
    )
    each("  the fill's Allocate above that floor (median, p99)", lambda f: _above(f.allocate, f.floor.seq_allocate))
    each(
        f"Allocate (vcuda-core), one whole GPU each, on the empty node ({args.whole_rounds} rounds over its GPUs)",
        lambda f: figure("", f.whole),
    )
    each(
        "Allocate (vcuda-memory), same pods: validation only, no state, nothing written (a call's floor)",
        lambda f: figure("", f.allocate_memory),
    )
    each("GetPreferredAllocation (vcuda-core), same pods", lambda f: figure("", f.preferred))
    each("PreStartContainer (vcuda-core), same pods", lambda f: figure("", f.prestart, target_ms=20))
    each("PreStartContainer, same pods, for a plugin that does nothing", lambda f: figure("", f.floor.seq_prestart))
    each(f"{args.burst} concurrent Allocate", lambda f: figure("", f.burst_allocate, target_ms=50))
    each(f"{args.burst} concurrent PreStartContainer", lambda f: figure("", f.burst_prestart, target_ms=50))
    each(
        f"{args.burst} concurrent Allocate, the same burst for a plugin that does nothing (the simulator's floor)",
        lambda f: figure("", f.floor.burst_allocate),
    )
    each(
        f"{args.burst} concurrent PreStartContainer, the same burst for a plugin that does nothing",
        lambda f: figure("", f.floor.burst_prestart),
    )
    each(
        f"{args.burst} concurrent Allocate calls, requests made before the burst (no kubelet work inside)",
        lambda f: figure("", f.burst_calls, target_ms=50),
    )
    each(
        f"{args.burst} concurrent Allocate (vcuda-memory) from this client: validation only (a burst's floor)",
        lambda f: figure("", f.burst_floor),
    )

    def inside(key: str) -> Callable[[Figures], str]:
        return lambda f: f"p50 ~{f.inside[key][0] * 1000:.2f} ms, p99 ~{f.inside[key][1] * 1000:.2f} ms"

    print("the agent's own time in the call (from its latency histogram, interpolated within buckets):")
    for key in (
        "whole Allocate",
        "fill Allocate",
        "fill PreStartContainer",
        "burst Allocate",
        "burst PreStartContainer",
    ):
        each(f"  {key}", inside(key))
    print("  of which the journal write each waited for (the agent's own figure of its disk; nan: not exported)")
    for key in ("whole journal write", "fill journal write", "burst journal write"):
        each(f"  {key}", inside(key))
    each(
        f"GET /metrics with {args.pods + args.burst} containers",
        lambda f: figure("", f.scrape, target_ms=20) + f" ({f.scrape_kib} KiB)",
    )
    each(
        f"agent RSS with {args.pods + args.burst} running pods (target < 80 MiB)",
        lambda f: (
            f"VmRSS {f.rss_kib / 1024:.1f} MiB ({'ok' if f.rss_kib < 80 * 1024 else 'OVER TARGET'}), "
            f"peak VmHWM {f.hwm_kib / 1024:.1f} MiB"
        ),
    )
    print(f"   done; {load()}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", type=spec_arg, action="append", default=None, help="node spec (repeatable)")
    parser.add_argument("--pods", type=int, default=200)
    parser.add_argument("--burst", type=int, default=50)
    parser.add_argument("--scrapes", type=int, default=30)
    parser.add_argument("--whole-rounds", type=int, default=4, help="rounds of whole-GPU pods before the fill")
    add_before_arguments(parser)
    args = parser.parse_args()
    prompt_threads()
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    specs = args.spec or [SPEC_DIR / "h100-nvlink-x8.json", SPEC_DIR / "h200-x16.json"]
    with variants(args.before, args.before_python) as agents:
        for i, spec in enumerate(specs):
            run(spec, args, agents if i % 2 == 0 else agents[::-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
