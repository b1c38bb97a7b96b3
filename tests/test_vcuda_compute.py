"""Simulated GPU time and the interceptor's SM limit (vcuda-core), on the simulated node.

The simulated driver runs kernels on a shared per-GPU timeline (vcuda/sim/README.md, "Simulated
GPU time"); the limiter in libcuda-control.so must hold each container to its share through every
launch path.  Workloads are ``vcuda/build/bench/launch_loop`` processes (continuously fed,
unsynchronised); shares are read from the timeline.  Bounds are wide (direction and rough size),
so the tests stay deterministic on a loaded machine; bench/bench_compute.py prints the precise
figures.
"""

from __future__ import annotations

import itertools
import json
import re
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from simnode import gpusim_state as sim_state
from simnode.gpusim_state import GpuSimState, repo_root
from tests.make_lock import run_make
from tests.vcuda_fixtures import (
    BUILD,
    DRIVER_VERSION,
    ONE_KERNEL,
    VCUDA,
    FreshProcesses,
    ctypes_kernel_program,
    last_json,
    make_mirror,
    run_python,
    vcuda_built,
)

__all__ = ["vcuda_built"]  # fixture

# Shares of GPU time measured against tight bounds: make test runs these apart from the CPU-heavy rest.
pytestmark = pytest.mark.timing

LOOP = BUILD / "bench" / "launch_loop"
PATHS = ("kernel", "kernel_ptsz", "ex", "ex_ptsz", "coop", "coop_ptsz", "multi", "graph", "graph_ptsz", "proc",
         "proc_ptsz", "launch", "grid", "grid_async")  # fmt: skip
# A context-less CUkernel (or a graph of one) launched on a created stream while no context is current.
NOCTX_PATHS = ("kernel_noctx", "ex_noctx", "graph_noctx")
# In a green context (CUDA 12.4's SM partitions): its CUcontext current, on a stream of cuGreenCtxStreamCreate.
GREEN_PATHS = ("kernel_green", "ex_green", "graph_green")


def core_config(share: int, *, hard: bool = True, ceiling: int = 0, enable: int = 1) -> bytes:
    """vcuda.config with no memory limit and an SM share (resource_data_t, 8240 bytes)."""
    buf = bytearray(8240)
    struct.pack_into("48s", buf, 0, b"compute-pod")
    struct.pack_into("<i", buf, 48, ceiling)
    struct.pack_into("4096s", buf, 4096, b"main")
    struct.pack_into("<QiiiiI", buf, 8208, 0, share, 1 if hard else 0, 550, 0, enable)
    return bytes(buf)


@dataclass
class Node:
    """A 16-GPU simulated node (GPUs 0-7: 16 SMs, 8-15: 132 SMs) with a driver mirror."""

    root: Path

    @property
    def spec(self) -> Path:
        return self.root / "node.json"

    @property
    def state(self) -> Path:
        return self.root / "node.state"

    @property
    def mirror(self) -> Path:
        return self.root / "lib64"

    def env(self, name: str, config: bytes | None, pids: list[int] | None = None, **extra: str) -> dict[str, str]:
        cfg = self.root / name / "vcuda.config"
        cfg.parent.mkdir(parents=True, exist_ok=True)
        if config is not None:
            cfg.write_bytes(config)
        if pids is not None:  # the agent's list of the container's host PIDs
            (cfg.parent / "pids.config").write_bytes(struct.pack(f"<{len(pids)}i", *pids))
        env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(self.mirror), "GPUSIM_SPEC": str(self.spec),
               "GPUSIM_STATE": str(self.state), "VCUDA_CONFIG_PATH": str(cfg), "VCUDA_CONFIG_ROOT": str(cfg.parent),
               "VCUDA_BUDGET_DIR": str(self.root / f"shm-{name}"), "PYTHONPATH": str(repo_root())}  # fmt: skip
        env.update(extra)
        return env

    def loop(self, name: str, gpu: int, seconds: float, config: bytes | None, *, path: str = "kernel",
             kernel: str = "spin_1ms", pids: list[int] | None = None,
             **extra: str) -> subprocess.Popen[str]:  # fmt: skip
        blocks = 64 if gpu < 8 else 528
        cmd = [str(LOOP), path, kernel, f"{seconds:.2f}", str(blocks), "256", str(gpu)]
        return subprocess.Popen(cmd, env=self.env(name, config, pids, **extra), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip


@pytest.fixture(scope="module")
def loop_built(vcuda_built: Path) -> Path:
    done = run_make(["make", "-C", str(VCUDA), "bench", f"PYTHON={sys.executable}"], capture_output=True,
                          text=True, timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return LOOP


@pytest.fixture
def node(loop_built: Path, vcuda_built: Path, tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    sms = [16] * 8 + [132] * 8
    gpus = [{"uuid": f"GPU-{i:08x}-0000-4000-8000-{0xC0DE00000000 + i:012x}",
             "name": "NVIDIA H100 80GB HBM3" if sm == 132 else "NVIDIA A2", "minor": i, "memory_mib": 16384,
             "pci_bus_id": f"00000000:{0x20 + i:02X}:00.0", "numa_node": 0, "sm_count": sm, "multi_gpu_board": False}
            for i, sm in enumerate(sms)]  # fmt: skip
    topo = [[0 if i == j else 50 for j in range(16)] for i in range(16)]
    n.spec.write_text(json.dumps({"driver_version": DRIVER_VERSION, "cuda_driver_version": 12040, "gpus": gpus,
                                  "topology": topo}))  # fmt: skip
    make_mirror(n.mirror, vcuda_built)
    yield n


def shares(
    node: Node, procs: dict[str, tuple[int, subprocess.Popen[str]]], settle: float, measure: float
) -> dict[str, float]:
    """Share (percent) of each process of its GPU's time over [settle, settle + measure]."""
    time.sleep(settle)
    gpus = {g for g, _p in procs.values()}
    with GpuSimState(node.state) as st:
        before = {g: st.timeline(g) for g in gpus}
        time.sleep(measure)
        after = {g: st.timeline(g) for g in gpus}
    out = {}
    for name, (g, p) in procs.items():
        b0, b1 = before[g], after[g]
        assert b0 is not None and b1 is not None
        out[name] = 100.0 * (b1.busy_of({p.pid}) - b0.busy_of({p.pid})) / (b1.now_ns - b0.now_ns)
    for name, (_g, p) in procs.items():
        _out, err = p.communicate(timeout=60)
        assert p.returncode == 0, f"{name}: {err}"
    return out


# ---- the simulated GPU time --------------------------------------------------------------------


def test_kernels_take_simulated_time_and_sync_waits(node: Node) -> None:
    env = node.env("sim", None)
    env["LD_LIBRARY_PATH"] = str(BUILD / "sim")  # the simulated driver alone
    done = run_python(
        r"""
import time, pynvml
mod = ok(d.cuModuleLoadData(b"x"))
f = ok(d.cuModuleGetFunction(mod, b"spin_2ms"))
model = ok(d.cuModuleGetFunction(mod, b"plain"))
head = ok(d.cuModuleGetFunction(mod, b"spin_200ms"))
s = ok(d.cuStreamCreate(0))
e0, e1 = ok(d.cuEventCreate(0)), ok(d.cuEventCreate(0))
t0 = time.monotonic()
# A head start: the 50 launches queue while the GPU runs this one, so that a host slowed by load
# launching them cannot leave the GPU idle between them (the events would measure the gaps too).
ok(d.cuLaunchKernel(head, 1, 1, 1, 32, 1, 1, 0, s, 0, 0))
ok(d.cuEventRecord(e0, s))
for _ in range(50):
    ok(d.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, 0, 0))
ok(d.cuEventRecord(e1, s))
queued = time.monotonic() - t0
busy = d.cuStreamQuery(s)[0].name, d.cuEventQuery(e1)[0].name
ok(d.cuStreamSynchronize(s))
waited = time.monotonic() - t0
after = d.cuStreamQuery(s)[0].name, d.cuEventQuery(e1)[0].name
ms = ok(d.cuEventElapsedTime(e0, e1))
# the cost model: 16 SMs x 1024 threads/us: 64 blocks x 256 threads = 1 us ... 1024 blocks x 1024 = 64 us
t1 = time.monotonic()
for _ in range(100):
    ok(d.cuLaunchKernel(model, 1024, 1, 1, 1024, 1, 1, 0, s, 0, 0))
ok(d.cuCtxSynchronize())
model_s = time.monotonic() - t1
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
rate = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
procs = {p.pid: p.smUtil for p in pynvml.nvmlDeviceGetProcessUtilization(h, 0)}
samples = pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0)[1]
print(json.dumps({"queued": queued, "waited": waited, "busy": busy, "after": after, "ms": ms,
                  "model_s": model_s, "rate": rate, "procs": procs, "pid": os.getpid(),
                  "samples": [s.sampleValue.uiVal for s in samples]}))
""",
        env,
    )
    assert done.returncode == 0, done.stderr
    r = last_json(done.stdout)
    assert isinstance(r, dict)
    assert r["queued"] < 0.05  # launches are asynchronous
    assert r["busy"] == ["CUDA_ERROR_NOT_READY", "CUDA_ERROR_NOT_READY"]
    assert r["after"] == ["CUDA_SUCCESS", "CUDA_SUCCESS"]
    assert 0.295 <= r["waited"] < 1.2  # 200 ms, then 50 x 2 ms
    assert 99.0 <= r["ms"] <= 101.0  # event timestamps come from the timeline
    assert 0.0063 <= r["model_s"] < 0.5  # 100 x 64 us
    assert r["rate"] > 0  # the GPU ran kernels in the last 1/6 s
    assert str(r["pid"]) in {str(k) for k in r["procs"]} and max(r["procs"].values()) >= 5
    assert max(r["samples"]) >= 90  # 10 ms samples while the 2 ms kernels ran back to back


def test_processes_share_a_gpu_by_time_slices(node: Node, tmp_path: Path) -> None:
    sim = {"LD_LIBRARY_PATH": str(BUILD / "sim")}
    procs = {f"p{i}": (3, node.loop(f"p{i}", 3, 3.0, None, **sim)) for i in range(2)}
    got = shares(node, procs, 1.0, 1.5)
    assert 40 <= got["p0"] <= 60 and 40 <= got["p1"] <= 60, got
    assert 95 <= got["p0"] + got["p1"] <= 100.5, got
    # NVML per-process utilisation and the Python reader agree on who ran.
    with GpuSimState(node.state) as st:
        tl = st.timeline(3)
    assert tl is not None and tl.active and tl.kernels_done > 1000


def test_state_file_reader_reports_the_timeline(node: Node) -> None:
    p = node.loop("solo", 1, 1.0, None, kernel="spin_100us", LD_LIBRARY_PATH=str(BUILD / "sim"))
    got = shares(node, {"solo": (1, p)}, 0.3, 0.5)
    assert got["solo"] >= 90
    with GpuSimState(node.state) as st:
        assert st.timeline(0) is not None and not st.timeline(0).active  # type: ignore[union-attr]


# ---- the limiter -------------------------------------------------------------------------------


def test_hard_limit_holds_on_small_and_large_gpus(node: Node) -> None:
    procs = {
        "16sm-30": (0, node.loop("a", 0, 4.0, core_config(30))),
        "132sm-30": (8, node.loop("b", 8, 4.0, core_config(30))),
        "132sm-70": (9, node.loop("c", 9, 4.0, core_config(70))),
        "16sm-10us": (1, node.loop("d", 1, 4.0, core_config(50), kernel="spin_10us")),
        "off": (10, node.loop("e", 10, 4.0, core_config(0))),
        "enable0": (11, node.loop("f", 11, 4.0, core_config(30, enable=0))),
    }
    got = shares(node, procs, 2.0, 1.5)
    assert 22 <= got["16sm-30"] <= 38, got
    assert 22 <= got["132sm-30"] <= 38, got
    assert 60 <= got["132sm-70"] <= 80, got
    assert 40 <= got["16sm-10us"] <= 60, got
    assert got["off"] >= 90 and got["enable0"] >= 90, got


def test_no_launch_path_escapes(node: Node) -> None:
    procs = {path: (i, node.loop(path, i, 3.5, core_config(30), path=path)) for i, path in enumerate(PATHS)}
    got = shares(node, procs, 1.5, 1.5)
    for path in PATHS:
        assert 15 <= got[path] <= 42, (path, got)


def test_launches_without_a_current_context_are_gated(node: Node) -> None:
    """cuda.h: a CUkernel (and a graph) runs in its stream's context, current or not; the gate follows the stream."""
    procs = {path: (i, node.loop(path, i, 3.5, core_config(30), path=path)) for i, path in enumerate(NOCTX_PATHS)}
    got = shares(node, procs, 1.5, 1.5)
    for path in NOCTX_PATHS:
        assert 15 <= got[path] <= 42, (path, got)


def test_launches_in_green_contexts_are_gated(node: Node) -> None:
    """A green context's streams run in its own context: the gate finds their device and holds the share."""
    procs = {path: (i, node.loop(path, i, 3.5, core_config(30), path=path)) for i, path in enumerate(GREEN_PATHS)}
    got = shares(node, procs, 1.5, 1.5)
    for path in GREEN_PATHS:
        assert 15 <= got[path] <= 42, (path, got)


def test_a_process_missing_from_pids_config_is_limited(node: Node) -> None:
    """The agent's pids.config lags behind a new process (or lists only others): its own time still counts."""
    procs = {
        "listed-other": (2, node.loop("a", 2, 3.5, core_config(30), pids=[1])),
        "empty": (3, node.loop("b", 3, 3.5, core_config(30), pids=[])),
    }
    got = shares(node, procs, 1.5, 1.5)
    for name in procs:
        assert 15 <= got[name] <= 42, (name, got)


#: Where NVML names only the busiest process of each period (the simulator's default, as an H200 with driver 580.159
#: answers), the 30 % container of a 30/70 pair is rarely named: see tests/test_vcuda_sm_window_h200.py.
PAIR_UNDER_WINDOW_SAMPLING = pytest.mark.xfail(
    strict=False,
    reason="known: NVML naming only the busiest process of each period, a 30/70 pair splits about 15/62 (the H200: "
    "9.7-30.1 / 69.9-90.3 % of the pair)",
)


@pytest.mark.parametrize(
    "sampling", ["gpu", pytest.param("window", marks=PAIR_UNDER_WINDOW_SAMPLING)], ids=["gpu", "window"]
)
def test_two_containers_split_30_70(node: Node, sampling: str) -> None:
    mode = {"GPUSIM_PROCESS_SAMPLE_MODE": sampling}
    procs = {
        "30": (8, node.loop("a", 8, 4.0, core_config(30), **mode)),
        "70": (8, node.loop("b", 8, 4.0, core_config(70), **mode)),
    }
    got = shares(node, procs, 2.0, 1.5)
    assert 22 <= got["30"] <= 38 and 60 <= got["70"] <= 80, got
    assert got["70"] > got["30"] + 25, got


def test_soft_limit_takes_idle_capacity_and_gives_it_back(node: Node) -> None:
    soft = core_config(30, hard=False, ceiling=80)
    p = node.loop("soft", 8, 6.0, soft)
    with GpuSimState(node.state) as st:
        time.sleep(1.5)
        t0 = st.timeline(8)
        time.sleep(1.0)
        t1 = st.timeline(8)
        assert t0 is not None and t1 is not None
        alone = 100.0 * (t1.busy_of({p.pid}) - t0.busy_of({p.pid})) / (t1.now_ns - t0.now_ns)
        greedy = node.loop("greedy", 8, 3.4, None)
        time.sleep(1.8)
        t2 = st.timeline(8)
        time.sleep(1.2)
        t3 = st.timeline(8)
        assert t2 is not None and t3 is not None
        shared = 100.0 * (t3.busy_of({p.pid}) - t2.busy_of({p.pid})) / (t3.now_ns - t2.now_ns)
        other = 100.0 * (t3.busy_of({greedy.pid}) - t2.busy_of({greedy.pid})) / (t3.now_ns - t2.now_ns)
    for proc in (p, greedy):
        proc.communicate(timeout=60)
        assert proc.returncode == 0
    assert 65 <= alone <= 85, alone
    assert 20 <= shared <= 42 and other >= 55, (shared, other)


def test_upstream_baseline_is_selectable(node: Node) -> None:
    procs = {
        "up-graph": (8, node.loop("a", 8, 3.0, core_config(30), path="graph", VCUDA_CORE_ALGORITHM="upstream")),
        "up-kernel": (1, node.loop("b", 1, 3.0, core_config(30), VCUDA_CORE_ALGORITHM="upstream")),
    }
    got = shares(node, procs, 1.5, 1.0)
    assert got["up-graph"] >= 90, got  # upstream never gated graph launches
    assert got["up-kernel"] < 90, got  # ... but it does gate cuLaunchKernel


# ---- what NVML reports of other processes ---------------------------------------------------------


#: The simulated NVML's other sampling (GPUSIM_PROCESS_SAMPLE_MODE; its default answers as an H200's driver does, naming
#: the busiest process of each period): each process at its own moment.  The neighbours below stand for processes
#: sampled so.
PER_PROCESS = "process"


@contextmanager
def neighbours(state: Path, gpu: int, count: int, period: float) -> Iterator[None]:
    """`count` processes outside the container (PIDs 700000..) that NVML reports a fresh 1 % utilisation sample
    for every `period` seconds, as NVML does each sampling period: entries of the simulator's process table, all
    rewritten at once under its lock (timestamped with the wall clock, so newer than the timeline's checkpoints)."""
    pids = range(700000, 700000 + count)
    stop = threading.Event()

    def refresh() -> None:
        with GpuSimState(state) as st:
            while not stop.is_set():
                with st._locked() as m:
                    now, k = sim_state._now_us(), 0
                    for off, (pid, _gpu, _used, flags, *_rest) in st._proc_slots(m):
                        if k < count and (not flags & sim_state.PROC_IN_USE or pid in pids):
                            sim_state._PROC.pack_into(m, off, pids[k], gpu, 1 << 20, sim_state.PROC_IN_USE, 1, 0, 0,
                                                      now, 0)  # fmt: skip
                            k += 1
                    st._touch(m)
                stop.wait(period)

    t = threading.Thread(target=refresh, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=30)
        with GpuSimState(state) as st:
            for pid in pids:
                st.remove_process(pid)


def test_more_processes_than_the_first_sample_buffer_holds(node: Node) -> None:
    """300 other processes on the GPU, each with a sample: nvmlDeviceGetProcessUtilization answers
    NVML_ERROR_INSUFFICIENT_SIZE for a 256-entry buffer.  The buffer grows to what NVML asks for, and the
    container's GPU time is still charged (it was not: every launch passed)."""
    p = node.loop("a", 2, 4.5, core_config(30))
    with neighbours(node.state, 2, 300, period=0.05):
        got = shares(node, {"30": (2, p)}, 2.0, 1.5)
    assert 15 <= got["30"] <= 42, got


def test_a_neighbours_newer_sample_times_do_not_shorten_the_containers_spans(node: Node) -> None:
    """A process outside the container whose samples are stamped later than the container's (here: every 5 ms, by the
    wall clock, while the timeline's samples carry their 10 ms checkpoint): each PID's sample spans from that PID's
    previous sample, not from the newest of anyone's (which credited the container part of its GPU time back).
    Samples per process: a driver that samples the whole GPU names no process between its periods."""
    p = node.loop("a", 4, 4.5, core_config(30), GPUSIM_PROCESS_SAMPLE_MODE=PER_PROCESS)
    with neighbours(node.state, 4, 1, period=0.005):
        got = shares(node, {"30": (4, p)}, 2.0, 1.5)
    assert 15 <= got["30"] <= 40, got


def test_a_soft_limit_never_goes_above_its_annotation(node: Node) -> None:
    """hard_limit = 0 (the agent writes it for any tencent.com/vcuda-core-limit annotation): alone on the GPU the
    container climbs to the annotation, never beyond; an annotation at or below the share (or 0) leaves the share
    (it made the ceiling 100 %)."""
    procs = {
        "ceiling-50": (5, node.loop("a", 5, 4.5, core_config(30, hard=False, ceiling=50))),
        "ceiling-30": (6, node.loop("b", 6, 4.5, core_config(30, hard=False, ceiling=30))),
        "ceiling-20": (7, node.loop("c", 7, 4.5, core_config(30, hard=False, ceiling=20))),
        "ceiling-0": (12, node.loop("d", 12, 4.5, core_config(30, hard=False, ceiling=0))),
    }
    got = shares(node, procs, 2.0, 1.5)
    assert 40 <= got["ceiling-50"] <= 58, got
    for name in ("ceiling-30", "ceiling-20", "ceiling-0"):
        assert 20 <= got[name] <= 38, (name, got)


# ---- GPU time charged over the window NVML averaged it over ----------------------------------------

PIN_BURST = ctypes_kernel_program(
    "int(sys.argv[6])",
    'b"spin_1ms"',
    r"""import time
stream = ctypes.c_void_p()
ok(cu.cuStreamCreate(ctypes.byref(stream), 1))
mode = sys.argv[1]
seconds, period, off, tail = (float(a) for a in sys.argv[2:6])
def launch():
    ok(cu.cuLaunchKernel(fn, 1, 1, 1, 128, 1, 1, 0, stream, args, None))
end = time.time() + seconds
while time.time() < end:
    now = time.time()
    start = now - now % period  # periods of the wall clock (NVML's sample times)
    if mode == "pin":  # one 1 ms kernel as each period starts: this PID's newest sample stays up to a period old
        launch()
        ok(cu.cuStreamSynchronize(stream))
        time.sleep(max(0.0, start + period + 0.002 - time.time()))
    else:  # idle for `off` after each period starts, then as many kernels as the limiter lets through
        time.sleep(max(0.0, start + off - now))
        while time.time() < start + period + tail:
            launch()
        ok(cu.cuStreamSynchronize(stream))
""",
)


def test_a_late_burst_beside_a_rarely_sampled_process_keeps_the_share(node: Node) -> None:
    """NVML's sample of a PID averages its use over the query's window (from lastSeenTimeStamp to the sample's
    time).  A second process of the container runs one tiny kernel per period, so its newest sample (and the
    oldest start the container's PIDs need) stays up to a period old, while the busy process idles at the start of
    each period and bursts late: its sample averaged over the long window (mostly idle) was multiplied by the short
    span since its own previous sample, and most of its GPU time went uncharged (40-54 % in a 30 % container).
    Each PID is now charged over the window its average was taken over."""
    cfg = core_config(30)
    env = node.env("a", cfg)
    seconds, period = 8.0, 0.95
    pin = subprocess.Popen([sys.executable, "-c", PIN_BURST, "pin", f"{seconds}", f"{period}", "0", "0", "4"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    burst = subprocess.Popen([sys.executable, "-c", PIN_BURST, "burst", f"{seconds}", f"{period}", "0.45", "0.03", "4"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    got = shares(node, {"pin": (4, pin), "burst": (4, burst)}, 1.9, 5 * period)
    assert got["pin"] + got["burst"] <= 38, got


# ---- NVML cannot tell the processes' utilisation --------------------------------------------------


def test_blind_processes_pay_for_each_other(node: Node) -> None:
    """NVML cannot answer the per-process utilisation query (the simulated NVML answers NVML_ERROR_UNKNOWN every
    time): the limit fails closed, charging the wall time launches are outstanding.  That time goes into the
    container's ledger, so its processes pay for each other's (each paid only its own, and nothing reached the
    ledger: a tenant starting process after process, each launching one 400 ms kernel, had every first launch free
    and took the whole GPU)."""
    gpu = 5
    env = node.env("a", core_config(30), GPUSIM_PROCESS_UTIL_ERROR="999")
    fresh = FreshProcesses([sys.executable, "-c", ONE_KERNEL, "spin_400ms", str(gpu)], env)
    try:
        fresh.feed(time.monotonic() + 2.0)
        with GpuSimState(node.state) as st:
            a = st.timeline(gpu)
        fresh.feed(time.monotonic() + 6.0)
        with GpuSimState(node.state) as st:
            b = st.timeline(gpu)
    finally:
        fresh.stop()
    assert a is not None and b is not None
    share = 100.0 * (b.busy_ns - a.busy_ns) / (b.now_ns - a.now_ns)
    assert fresh.started >= 4
    assert share <= 38, f"blind processes of one long kernel each got {share:.1f} % of the GPU in a 30 % container"


# ---- each process sampled at its own moment ---------------------------------------------------------------------

#: One 1 ms kernel every argv[2] seconds for argv[1] seconds on GPU argv[3]: a steady, known load (1 ms / 20 ms = 5 %).
PACED = ctypes_kernel_program(
    "int(sys.argv[3])",
    'b"spin_1ms"',
    r"""import time
stream = ctypes.c_void_p()
ok(cu.cuStreamCreate(ctypes.byref(stream), 1))
seconds, period = float(sys.argv[1]), float(sys.argv[2])
end = next_at = time.time()
end += seconds
while time.time() < end:
    ok(cu.cuLaunchKernel(fn, 1, 1, 1, 128, 1, 1, 0, stream, args, None))
    ok(cu.cuStreamSynchronize(stream))
    next_at += period
    time.sleep(max(0.0, next_at - time.time()))
""",
)


def test_nvml_stamps_each_process_sample_with_its_own_time(node: Node) -> None:
    """Sampling per process, the simulated NVML samples each process at its own moment of the sampling period: the
    processes of one answer carry different timestamps (GPUSIM_PROCESS_SAMPLE_SPREAD_US=0: all the same)."""
    sim = {"LD_LIBRARY_PATH": str(BUILD / "sim"), "GPUSIM_PROCESS_SAMPLE_MODE": PER_PROCESS}
    program = r"""
import pynvml, time
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(13)
time.sleep(0.5)
got = pynvml.nvmlDeviceGetProcessUtilization(h, 0)
print(json.dumps({str(p.pid): [p.timeStamp, p.smUtil] for p in got}))
"""
    for spread, distinct in ((None, True), ("0", False)):
        extra = dict(sim, GPUSIM_PROCESS_SAMPLE_SPREAD_US=spread) if spread is not None else sim
        loops = [subprocess.Popen([sys.executable, "-c", PACED, "1.5", "0.004", "13"], env=node.env("s", None, **extra))
                 for _ in range(4)]  # fmt: skip
        try:
            time.sleep(0.3)
            env = node.env("s", None, **extra)
            done = run_python(program, env)
        finally:
            for p in loops:
                p.wait(timeout=60)
        assert done.returncode == 0, done.stderr
        got = last_json(done.stdout)
        assert isinstance(got, dict)
        mine = {pid: v for pid, v in got.items() if int(pid) in {p.pid for p in loops}}
        assert len(mine) == 4 and all(util > 0 for _ts, util in mine.values()), got
        stamps = {ts for ts, _util in mine.values()}
        assert (len(stamps) > 1) == distinct, got
        assert max(stamps) - min(stamps) < 10000, got  # within one 10 ms sampling period


def interceptor_mirror(root: Path, defines: str) -> Path:
    """A driver mirror whose interceptor is built with the test-only ``defines`` (under vcuda/build/)."""
    name = "t" + "".join(c if c.isalnum() else "_" for c in defines)
    command = ["make", "-C", str(VCUDA), f"BUILD=build/{name}", f"CFLAGS=-O2 -g {defines}", "interceptor"]
    done = run_make([*command, f"PYTHON={sys.executable}"], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    mirror = root / name
    make_mirror(mirror, VCUDA / "build" / name / "libcuda-control.so")
    return mirror


def measured_vs_used(node: Node, mirror: Path, processes: int, gpu: int) -> tuple[list[float], float]:
    """``processes`` paced processes of one container (5 % each, under its 99 % cap: never held back), the first
    logging the limiter's state: the container's GPU time it measured per second (percent), and the container's
    share of the GPU read from the timeline meanwhile."""
    node.env("a", core_config(99))  # written once, before any process reads it
    procs = [subprocess.Popen([sys.executable, "-c", PACED, "5.0", "0.02", str(gpu)], stderr=subprocess.PIPE, text=True,
                              env=node.env("a", None, LD_LIBRARY_PATH=str(mirror), LOGGER_LEVEL="5" if i == 0 else "3"))
             for i in range(processes)]  # fmt: skip
    time.sleep(2.0)
    with GpuSimState(node.state) as st:
        a = st.timeline(gpu)
        time.sleep(2.0)
        b = st.timeline(gpu)
    errs = []
    for p in procs:
        _out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        errs.append(err)
    assert a is not None and b is not None
    used = 100.0 * (b.busy_ns - a.busy_ns) / (b.now_ns - a.now_ns)
    total = [float(x) for x in re.findall(r"measured ([0-9.]+) s", errs[0])]
    return [100.0 * (y - x) for x, y in itertools.pairwise(total[1:])], used  # the debug line comes once a second


def test_every_process_of_a_container_sampled_at_its_own_time_is_charged(node: Node) -> None:
    """Each process of the container has its own sample time, so every one but the newest-sampled needs an entry
    in the limiter's per-device table of PIDs counted up to their own time.  A process without one was charged up
    to its sample time while the next query started at the container's newest: the time between was lost at every
    measurement (the table held 64; in a build holding 1, 7 processes using 35 % of the GPU were measured at 22-25 %,
    so a 30 % container would get about 45 %).  The table grows as needed (here from 1)."""
    measured, used = measured_vs_used(node, interceptor_mirror(node.root, "-DVC_OWN_PIDS=1"), 7, 13)
    assert 30 <= used <= 36, used
    assert len(measured) >= 2 and min(measured) >= 0.9 * used, (measured, used)


def test_a_pid_table_that_cannot_grow_counts_twice_rather_than_never(node: Node) -> None:
    """Where the table cannot grow (here: a build whose table stops at 1 entry; in production, memory that cannot
    be had), the next query starts at the oldest sample time of the processes left without an entry: their time is
    asked for again, and some is counted twice, none missed."""
    measured, used = measured_vs_used(
        node, interceptor_mirror(node.root, "-DVC_OWN_PIDS=1 -DVC_OWN_PIDS_LIMIT=1"), 7, 14
    )
    assert 30 <= used <= 36, used
    assert len(measured) >= 2 and min(measured) >= 0.95 * used, (measured, used)


def test_a_pid_list_longer_than_4096_still_counts_every_process(node: Node) -> None:
    """pids.config lists every process of the container (the agent writes them all): with more than 4096 (e.g.
    many idle workers), the limiter kept the first 4096 and counted the container's GPU processes beyond them as
    neighbours, free: two busy processes of a 30 % container took 30 % each.  The list is read whole."""
    node.env("a", core_config(30))
    procs = {f"p{i}": (6, node.loop("a", 6, 4.0, None)) for i in range(2)}
    busy = [p.pid for _gpu, p in procs.values()]
    idle = [pid for pid in range(2, 5000) if pid not in busy][:4600]
    node.env("a", None, pids=idle + busy)  # the busy ones after the 4096th entry
    got = shares(node, procs, 2.0, 1.5)
    assert sum(got.values()) <= 38, got


def test_processes_without_a_budget_slot_are_not_free(node: Node) -> None:
    """Every process of the container takes a slot of its budget file, whose host PID makes it the container's for
    the others before the agent lists it.  Processes that found every slot taken (1024; here a build with 2)
    counted each other as neighbours, free, until the agent listed them (never while the agent is down): with the
    slots held by two processes on another GPU, two busy processes of a 30 % container took 30 % each.  While such
    a process runs, the container's processes count every process on the GPU as the container's."""
    mirror = interceptor_mirror(node.root, "-DVC_BUDGET_SLOTS=2")
    node.env("a", core_config(30))
    holders = [node.loop("a", 6, 4.5, None, LD_LIBRARY_PATH=str(mirror)) for _ in range(2)]
    time.sleep(0.5)
    procs = {f"p{i}": (7, node.loop("a", 7, 4.0, None, LD_LIBRARY_PATH=str(mirror))) for i in range(2)}
    got = shares(node, procs, 2.0, 1.5)
    for p in holders:
        p.communicate(timeout=60)
    # 60 % before the fix; 39.0 % once under a loaded parallel suite (the simulated GPU's timing).
    assert sum(got.values()) <= 41, got


def test_a_soft_limit_holds_its_share_while_a_process_runs_without_a_budget_slot(node: Node) -> None:
    """While a process of the container holds no budget slot, every process on its GPUs counts as the container's
    (above). A soft limit must not read that as neighbours gone idle and rise to its ceiling: it holds at its share
    while then it cannot tell them (two slotless processes of a 30 %-soft, 100 %-ceiling container took the GPU
    from a busy neighbour)."""
    mirror = interceptor_mirror(node.root, "-DVC_BUDGET_SLOTS=2")
    node.env("soft", core_config(30, hard=False, ceiling=100))
    holders = [node.loop("soft", 6, 5.0, None, LD_LIBRARY_PATH=str(mirror)) for _ in range(2)]
    time.sleep(0.5)
    procs = {
        "soft0": (7, node.loop("soft", 7, 4.5, None, LD_LIBRARY_PATH=str(mirror))),
        "soft1": (7, node.loop("soft", 7, 4.5, None, LD_LIBRARY_PATH=str(mirror))),
        "neighbour": (7, node.loop("neighbour", 7, 4.5, None)),
    }
    got = shares(node, procs, 2.0, 1.5)
    for p in holders:
        p.communicate(timeout=60)
    assert got["soft0"] + got["soft1"] <= 42 and got["neighbour"] >= 50, got
