"""SM-limit benchmark: achieved GPU share per container under libcuda-control.so, on the simulated node.

Every workload is ``vcuda/build/bench/launch_loop`` (C): a continuously fed, unsynchronised
launch loop through one launch path, in its own process ("container": its own vcuda.config),
loading the interceptor from a gpu-manager-style driver mirror in front of the simulated
driver.  The simulated GPUs keep one shared timeline per GPU (vcuda/sim/README.md, "Simulated
GPU time"); the achieved share of a container is its processes' GPU time over the measurement
window, read from that timeline after ``--settle`` seconds.  Each scenario runs once with our
algorithm ("budget") and once with the upstream gpu-manager token bucket
(``VCUDA_CORE_ALGORITHM=upstream``, reference/interceptors.md 1.7), side by side on separate
simulated GPUs of one node.

    python bench/bench_compute.py [--settle 3] [--measure 3] [--only limits,pairs,soft,kernels,procs,overhead]
                                  [--before PATH] [--sample-period-us US] [--sample-spread-us US]

Scenarios: limits 10..90 % on a 16-SM and a 132-SM GPU (1 ms kernels); 30/70 and 4 x 25 on one
GPU; a soft limit (30 %, ceiling 80 %) alone and then with a greedy neighbour; 10 us and 50 ms
kernels, graph launches and a context-less CUkernel launched with no current context at 30 %;
three processes in each of 10/30/50/70 % containers; the cost per launch (simulated driver alone,
interceptor with the limit off, with the limit on and never binding; with ``--before PATH`` also
another interceptor build).  ``--sample-period-us`` and ``--sample-spread-us`` set how the simulated
NVML samples each process (its default: every 10 ms; real drivers: about every 1/6 s).  Target: every share
within 3 points of its limit; limit-off overhead < 5 ns per launch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simnode.gpusim_state import GpuSimState  # noqa: E402

VCUDA = ROOT / "vcuda"
BUILD = VCUDA / "build"
LOOP = BUILD / "bench" / "launch_loop"
DRIVER_VERSION = "550.54.15"
ALGORITHMS = ("budget", "upstream")
SMALL_SM, BIG_SM = 16, 132
TARGET_PP = 3.0
TARGET_OFF_NS = 5.0


def config_bytes(
    share: int, *, hard: bool = True, ceiling: int = 0, enable: int = 1, name: str = "c", memory_mib: int = 0
) -> bytes:
    """vcuda.config (resource_data_t, 8240 bytes): the given SM share, and a memory limit (0: none)."""
    buf = bytearray(8240)
    struct.pack_into("48s", buf, 0, b"bench-pod")
    struct.pack_into("<i", buf, 48, ceiling)
    struct.pack_into("4096s", buf, 4096, name.encode())
    struct.pack_into("<QiiiiI", buf, 8208, memory_mib << 20, share, 1 if hard else 0, 550, 0, enable)
    return bytes(buf)


def node_spec(path: Path) -> list[int]:
    """A node of 8 x 16-SM and 8 x 132-SM GPUs; returns the SM count of each GPU."""
    sms = [SMALL_SM] * 8 + [BIG_SM] * 8
    gpus = [
        {
            "uuid": f"GPU-{i:08x}-0000-4000-8000-{0xBEC000000000 + i:012x}",
            "name": "NVIDIA H100 80GB HBM3" if sm == BIG_SM else "NVIDIA A2",
            "minor": i,
            "memory_mib": 16384,
            "pci_bus_id": f"00000000:{0x10 + i:02X}:00.0",
            "numa_node": 0,
            "sm_count": sm,
            "multi_gpu_board": False,
        }
        for i, sm in enumerate(sms)
    ]
    n = len(gpus)
    topo = [[0 if i == j else 50 for j in range(n)] for i in range(n)]
    path.write_text(json.dumps({"driver_version": DRIVER_VERSION, "cuda_driver_version": 12040, "gpus": gpus,
                                "topology": topo}))  # fmt: skip
    return sms


@dataclass
class Workload:
    """One container: a launch loop on one GPU."""

    name: str
    gpu: int
    share: int  # the limit to compare with (percent); 0 = unlimited
    kernel: str = "spin_1ms"
    path: str = "kernel"
    config: bytes | None = None
    algorithm: str = "budget"
    blocks: int = 0  # 0: 4 blocks per SM
    start_after: float = 0.0
    processes: int = 1  # launch loops in the container
    proc: subprocess.Popen[str] | None = field(default=None, repr=False)
    more: list[subprocess.Popen[str]] = field(default_factory=list, repr=False)  # its other processes

    def pids(self) -> set[int]:
        """The container's process IDs."""
        return {p.pid for p in ([self.proc] if self.proc is not None else []) + self.more}


# The simulated NVML's per-process sampling (--sample-period-us, --sample-spread-us), for every launch loop.
SIM_ENV: dict[str, str] = {}


class Node:
    """The simulated node: spec, state file, mirror, per-container configs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.spec = root / "node.json"
        self.state = root / "node.state"
        self.sms = node_spec(self.spec)
        self.mirror = root / "lib64"
        self.mirror.mkdir()
        for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
            (self.mirror / name).symlink_to(BUILD / "libcuda-control.so")
        for lib in ("libcuda.so", "libnvidia-ml.so"):
            (self.mirror / f"{lib}.{DRIVER_VERSION}").symlink_to(BUILD / "sim" / f"{lib}.{DRIVER_VERSION}")
        self.count = 0

    def env(self, lib: Path, config: bytes | None, algorithm: str) -> dict[str, str]:
        self.count += 1
        env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(lib), "GPUSIM_SPEC": str(self.spec),
               "GPUSIM_STATE": str(self.state), "VCUDA_CORE_ALGORITHM": algorithm,
               "VCUDA_BUDGET_DIR": str(self.root / f"shm-c{self.count}")}  # fmt: skip
        env.update(SIM_ENV)
        cfg = self.root / f"c{self.count}" / "vcuda.config"
        cfg.parent.mkdir()
        if config is not None:
            cfg.write_bytes(config)
        env["VCUDA_CONFIG_PATH"] = str(cfg)
        env["VCUDA_CONFIG_ROOT"] = str(cfg.parent)
        return env

    def start(self, w: Workload, seconds: float) -> None:
        blocks = w.blocks or 4 * self.sms[w.gpu]
        cmd = [str(LOOP), w.path, w.kernel, f"{seconds:.2f}", str(blocks), "256", str(w.gpu)]
        env = self.env(self.mirror, w.config, w.algorithm)  # one container: its processes share it
        w.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        w.more = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                  for _ in range(w.processes - 1)]  # fmt: skip


def shares(node: Node, workloads: list[Workload], settle: float, measure: float) -> dict[str, float]:
    """Runs the workloads together; the share (percent) of each over [settle, settle + measure]."""
    total = settle + measure + 0.5
    with GpuSimState(node.state) as state:
        t_start = time.monotonic()
        for w in sorted(workloads, key=lambda w: w.start_after):
            delay = w.start_after - (time.monotonic() - t_start)
            if delay > 0:
                time.sleep(delay)
            node.start(w, total - w.start_after)
        time.sleep(max(0.0, settle - (time.monotonic() - t_start)))
        before = {g: state.timeline(g) for g in {w.gpu for w in workloads}}
        time.sleep(measure)
        after = {g: state.timeline(g) for g in {w.gpu for w in workloads}}
    out = {}
    for w in workloads:
        assert w.proc is not None
        b0, b1 = before[w.gpu], after[w.gpu]
        assert b0 is not None and b1 is not None
        out[w.name] = 100.0 * (b1.busy_of(w.pids()) - b0.busy_of(w.pids())) / max(1, b1.now_ns - b0.now_ns)
    for w in workloads:
        assert w.proc is not None
        for p in [w.proc, *w.more]:
            _out, err = p.communicate(timeout=120)
            if p.returncode != 0:
                sys.exit(f"launch_loop {w.name} failed ({p.returncode}):\n{err}")
    return out


def row(label: str, limit: float, got: dict[str, float], key: str) -> str:
    ours, up = got[f"budget:{key}"], got[f"upstream:{key}"]
    mark = "ok" if abs(ours - limit) <= TARGET_PP else "MISS"
    return (f"  {label:<38} {limit:6.1f} {ours:8.1f} {ours - limit:+7.1f} {mark:>4}   "
            f"{up:8.1f} {up - limit:+7.1f}")  # fmt: skip


HEADER = f"  {'scenario':<38} {'limit':>6} {'ours':>8} {'error':>7} {'':>4}   {'upstream':>8} {'error':>7}"


def both(ws: list[Workload]) -> list[Workload]:
    """The workloads once per algorithm, upstream on the GPU 4 places further."""
    out = []
    for algo in ALGORITHMS:
        for w in ws:
            out.append(Workload(f"{algo}:{w.name}", w.gpu + (4 if algo == "upstream" else 0), w.share, w.kernel,
                                w.path, w.config, algo, w.blocks, w.start_after, w.processes))  # fmt: skip
    return out


def scenario_limits(node: Node, args: argparse.Namespace) -> list[tuple[str, float, float, float]]:
    print(f"\nLimits, 1 ms kernels (grid 4 x SMs x 256 threads), after {args.settle:g} s, over {args.measure:g} s")
    print(HEADER)
    results: list[tuple[str, float, float, float]] = []
    for sm, base in ((SMALL_SM, 0), (BIG_SM, 8)):
        for half in ((10, 30), (50, 70, 90)):
            ws = [Workload(f"{sm}sm-{lim}", base + i, lim, config=config_bytes(lim)) for i, lim in enumerate(half)]
            got = shares(node, both(ws), args.settle, args.measure)
            for w in ws:
                print(row(f"{sm}-SM GPU, limit {w.share}%", w.share, got, w.name))
                results.append((f"{sm}sm-{w.share}", w.share, got[f"budget:{w.name}"], got[f"upstream:{w.name}"]))
    return results


def scenario_pairs(node: Node, args: argparse.Namespace) -> list[tuple[str, float, float, float]]:
    print("\nContainers sharing one GPU (132 SMs, 1 ms kernels)")
    print(HEADER)
    ws = [Workload("pair-30", 8, 30, config=config_bytes(30)), Workload("pair-70", 8, 70, config=config_bytes(70))]
    ws += [Workload(f"quad-{i}", 9, 25, config=config_bytes(25)) for i in range(4)]
    got = shares(node, both(ws), args.settle, args.measure)
    results: list[tuple[str, float, float, float]] = []
    for w in ws:
        print(row(f"{'30/70' if w.name.startswith('pair') else '4 x 25'}: {w.name}", w.share, got, w.name))
        results.append((w.name, w.share, got[f"budget:{w.name}"], got[f"upstream:{w.name}"]))
    return results


def scenario_soft(node: Node, args: argparse.Namespace) -> list[tuple[str, float, float, float]]:
    print("\nSoft limit: vcuda-core 30, vcuda-core-limit 80 (132 SMs, 1 ms kernels)")
    print(HEADER)
    soft = config_bytes(30, hard=False, ceiling=80)
    alone = shares(node, both([Workload("soft-alone", 10, 80, config=soft)]), args.settle, args.measure)
    print(row("alone (rises to its ceiling)", 80, alone, "soft-alone"))
    # Then a greedy neighbour (no limit) joins after the soft container has settled alone.
    ws = [Workload("soft-shared", 10, 30, config=soft),
          Workload("neighbour", 10, 70, config=None, start_after=args.settle)]  # fmt: skip
    shared = shares(node, both(ws), 2 * args.settle, args.measure)
    print(row("with a greedy neighbour (falls back)", 30, shared, "soft-shared"))
    print(row("  the neighbour (no limit)", 70, shared, "neighbour"))
    return [("soft-alone", 80, alone["budget:soft-alone"], alone["upstream:soft-alone"]),
            ("soft-shared", 30, shared["budget:soft-shared"], shared["upstream:soft-shared"])]  # fmt: skip


def scenario_kernels(node: Node, args: argparse.Namespace) -> list[tuple[str, float, float, float]]:
    print("\nKernel lengths and launch paths at 30 % (132 SMs)")
    print(HEADER)
    cfg = config_bytes(30)
    ws = [Workload("short-10us", 8, 30, "spin_10us", config=cfg),
          Workload("long-50ms", 9, 30, "spin_50ms", config=cfg),
          Workload("graph-1ms", 10, 30, "spin_1ms", "graph", config=cfg),
          Workload("noctx-1ms", 11, 30, "spin_1ms", "kernel_noctx", config=cfg)]  # fmt: skip
    # long kernels need a longer window: a 50 ms kernel is 1/6 of a 300 ms slice at 30 %.
    got = shares(node, both(ws), args.settle, max(args.measure, 3.0))
    labels = ("10 us kernels", "50 ms kernels", "graph launches (1 ms kernel node)", "CUkernel, no current context")
    for w, label in zip(ws, labels, strict=True):
        print(row(label, 30, got, w.name))
    return [(w.name, 30, got[f"budget:{w.name}"], got[f"upstream:{w.name}"]) for w in ws]


def scenario_procs(node: Node, args: argparse.Namespace) -> list[tuple[str, float, float, float]]:
    print("\nThree processes per container (132 SMs, 1 ms kernels)")
    print(HEADER)
    ws = [Workload(f"3procs-{lim}", 8 + i, lim, config=config_bytes(lim), processes=3)
          for i, lim in enumerate((10, 30, 50, 70))]  # fmt: skip
    got = shares(node, both(ws), args.settle, args.measure)
    for w in ws:
        print(row(f"3 processes, limit {w.share}%", w.share, got, w.name))
    return [(w.name, w.share, got[f"budget:{w.name}"], got[f"upstream:{w.name}"]) for w in ws]


def launch_cost(node: Node, lib: Path, config: bytes | None, algorithm: str, seconds: float) -> float:
    cmd = [str(LOOP), "kernel", "spin_1ns", f"{seconds:.2f}", "1", "32", "15"]
    done = subprocess.run(cmd, env=node.env(lib, config, algorithm), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"launch_loop failed:\n{done.stderr}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["per_launch_ns"])


def scenario_overhead(node: Node, args: argparse.Namespace) -> dict[str, float]:
    print("\nCost per cuLaunchKernel (1 ns kernels: the limit never binds), median of batches, best of 3 runs")
    sim = BUILD / "sim"
    runs: dict[str, list[float]] = {"sim": [], "off": [], "on": [], "upstream": [], "mem": []}
    mem = config_bytes(0, memory_mib=8192)  # the memory cap alone: each launch looks at its kernel's local frame
    before = None
    if args.before is not None:
        before = node.root / "before-lib64"
        before.mkdir()
        for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
            (before / name).symlink_to(args.before.resolve())
        for lib in ("libcuda.so", "libnvidia-ml.so"):
            (before / f"{lib}.{DRIVER_VERSION}").symlink_to(BUILD / "sim" / f"{lib}.{DRIVER_VERSION}")
        runs.update({"before-off": [], "before-on": [], "before-mem": []})
    for _ in range(3):  # interleaved, so that drifting machine load hits every variant alike
        runs["sim"].append(launch_cost(node, sim, None, "budget", args.overhead_seconds))
        runs["off"].append(launch_cost(node, node.mirror, config_bytes(0), "budget", args.overhead_seconds))
        runs["on"].append(launch_cost(node, node.mirror, config_bytes(90), "budget", args.overhead_seconds))
        runs["upstream"].append(launch_cost(node, node.mirror, config_bytes(90), "upstream", args.overhead_seconds))
        runs["mem"].append(launch_cost(node, node.mirror, mem, "budget", args.overhead_seconds))
        if before is not None:
            runs["before-off"].append(launch_cost(node, before, config_bytes(0), "budget", args.overhead_seconds))
            runs["before-on"].append(launch_cost(node, before, config_bytes(90), "budget", args.overhead_seconds))
            runs["before-mem"].append(launch_cost(node, before, mem, "budget", args.overhead_seconds))
    best = {k: min(v) for k, v in runs.items()}
    print(f"  simulated driver alone        {best['sim']:8.1f} ns")
    off = best["off"] - best["sim"]
    print(f"  interceptor, limit off        {best['off']:8.1f} ns   ({off:+.1f} ns; target < {TARGET_OFF_NS:g})")
    print(f"  interceptor, limit on (ours)  {best['on']:8.1f} ns   ({best['on'] - best['sim']:+.1f} ns)")
    print(f"  interceptor, upstream         {best['upstream']:8.1f} ns   ({best['upstream'] - best['sim']:+.1f} ns)")
    print(f"  interceptor, memory cap only  {best['mem']:8.1f} ns   ({best['mem'] - best['sim']:+.1f} ns)")
    if before is not None:
        for key, label in (
            ("before-off", "--before, limit off"),
            ("before-on", "--before, limit on"),
            ("before-mem", "--before, memory cap only"),
        ):
            print(f"  {label:<29} {best[key]:8.1f} ns   ({best[key] - best['sim']:+.1f} ns)")
    return {"sim_ns": best["sim"], "off_extra_ns": off, "on_extra_ns": best["on"] - best["sim"],
            "upstream_extra_ns": best["upstream"] - best["sim"], "mem_extra_ns": best["mem"] - best["sim"]}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settle", type=float, default=3.0, help="seconds before measuring (default 3)")
    ap.add_argument("--measure", type=float, default=3.0, help="seconds measured (default 3)")
    ap.add_argument("--overhead-seconds", type=float, default=1.0, help="per launch-cost run (default 1)")
    ap.add_argument("--only", default="limits,pairs,soft,kernels,procs,overhead", help="comma-separated scenarios")
    ap.add_argument(
        "--sample-period-us",
        type=int,
        default=None,
        help="the simulated NVML's per-process sampling period (GPUSIM_PROCESS_SAMPLE_PERIOD_US; its default: "
        "0, 10 ms; an H200's: 200000)",
    )
    ap.add_argument(
        "--sample-spread-us",
        type=int,
        default=None,
        help="how far before the period's end each process is sampled (GPUSIM_PROCESS_SAMPLE_SPREAD_US)",
    )
    ap.add_argument(
        "--sample-delay-us",
        type=int,
        default=None,
        help="how late each per-process sample is shown (GPUSIM_PROCESS_SAMPLE_DELAY_US; real drivers: 0.7 s or more)",
    )
    ap.add_argument(
        "--sample-mode",
        choices=("window", "gpu", "process"),
        default=None,
        help="how the simulated NVML samples (GPUSIM_PROCESS_SAMPLE_MODE): window (its default, as an H200's driver "
        "answers: the busiest process of each period named with the GPU's busy percent, one averaged sample per "
        "process named), gpu (every period's sample, its process drawn by GPU time) or process (each process's own "
        "share)",
    )
    ap.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    ap.add_argument("--before", type=Path, default=None,
                    help="another libcuda-control.so whose launch cost is measured beside this one")  # fmt: skip
    args = ap.parse_args()
    if args.sample_period_us is not None:
        SIM_ENV["GPUSIM_PROCESS_SAMPLE_PERIOD_US"] = str(args.sample_period_us)
    if args.sample_spread_us is not None:
        SIM_ENV["GPUSIM_PROCESS_SAMPLE_SPREAD_US"] = str(args.sample_spread_us)
    if args.sample_delay_us is not None:
        SIM_ENV["GPUSIM_PROCESS_SAMPLE_DELAY_US"] = str(args.sample_delay_us)
    if args.sample_mode is not None:
        SIM_ENV["GPUSIM_PROCESS_SAMPLE_MODE"] = args.sample_mode
    done = subprocess.run(["make", "-C", str(VCUDA), "bench", f"PYTHON={sys.executable}"], capture_output=True,
                          text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"make -C vcuda bench failed:\n{done.stdout}{done.stderr}")
    only = set(args.only.split(","))
    print(f"bench_compute: shares in % of the GPU's time; ours = budget algorithm, upstream = gpu-manager 1.7; "
          f"target |error| <= {TARGET_PP:g} points")  # fmt: skip
    sampling = {k: v for k, v in SIM_ENV.items() if k.startswith("GPUSIM_PROCESS_SAMPLE_")}
    defaults = "the defaults (as an H200 names processes: the busiest of each period, every 10 ms here)"
    print(f"simulated NVML sampling: {sampling or defaults}")
    t0 = time.monotonic()
    results: list[tuple[str, float, float, float]] = []
    overhead: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-compute-") as tmp:
        node = Node(Path(tmp))
        for name, fn in (("limits", scenario_limits), ("pairs", scenario_pairs), ("soft", scenario_soft),
                         ("kernels", scenario_kernels), ("procs", scenario_procs)):  # fmt: skip
            if name in only:
                results.extend(fn(node, args))
        if "overhead" in only:
            overhead = scenario_overhead(node, args)
    if results:
        ours = [abs(r[2] - r[1]) for r in results]
        up = [abs(r[3] - r[1]) for r in results]
        print(f"\nSummary over {len(results)} shares: ours max |error| {max(ours):.1f} points "
              f"(mean {statistics.mean(ours):.1f}), {sum(e <= TARGET_PP for e in ours)}/{len(ours)} within "
              f"{TARGET_PP:g}; upstream max {max(up):.1f} (mean {statistics.mean(up):.1f}), "
              f"{sum(e <= TARGET_PP for e in up)}/{len(up)} within")  # fmt: skip
    print(f"bench_compute: {time.monotonic() - t0:.0f} s")
    if args.json:
        print(json.dumps({"shares": [{"name": n, "limit": lim, "ours": o, "upstream": u} for n, lim, o, u in results],
                          "overhead": overhead}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
