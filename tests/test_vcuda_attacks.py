"""A tenant of a 1 GiB / 30 % container trying to get more than its share, on paths beyond plain allocation.

Each attack runs tenant programs through NVIDIA's cuda-bindings (or ctypes, where threads must really
run driver calls at once) against the interceptor in front of the simulated driver.  The judge is the
simulated GPU: the most device memory it held at once (all processes), and the GPU time the container's
processes got.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from simnode.gpusim_state import GpuSimState, repo_root
from tests.make_lock import run_make
from tests.vcuda_fixtures import (
    BUILD,
    KEEPING_POOL,
    MIB,
    ONE_KERNEL,
    VCUDA,
    Container,
    FreshProcesses,
    container,
    last_json,
    sim_only_env,
    vcuda_built,
)

__all__ = ["container", "vcuda_built"]  # fixtures

MakeContainer = Callable[..., Container]

PEAK = r"""
from simnode.gpusim_state import GpuSimState
def peak():
    with GpuSimState(os.environ["GPUSIM_STATE"]) as st:
        return st.snapshot(1).gpus[0].used_peak
"""


def run(c: Container, code: str, timeout: float = 120, **env: str | None) -> dict[str, object]:
    done = c.python(PEAK + code, env=c.env(**env) if env else None, timeout=timeout)
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    return out


# ---- compute: the container's processes together -----------------------------------------------------


@pytest.fixture(scope="module")
def launch_loop(vcuda_built: Path) -> Path:
    del vcuda_built
    done = run_make(["make", "-C", str(VCUDA), "bench", f"PYTHON={sys.executable}"], capture_output=True,
                          text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return BUILD / "bench" / "launch_loop"


def share_of(c: Container, pids: set[int], settle: float, measure: float) -> float:
    """The container's share of GPU 0's time over `measure` seconds, after `settle`."""
    time.sleep(settle)
    with GpuSimState(c.state_path) as st:
        a = st.timeline(0)
        time.sleep(measure)
        b = st.timeline(0)
    assert a is not None and b is not None
    return (b.busy_of(pids) - a.busy_of(pids)) / (b.now_ns - a.now_ns)


@pytest.mark.timing  # a share of GPU time against a tight bound (make test runs it apart)
def test_processes_the_agent_has_not_listed_yet_share_one_limit(container: MakeContainer, launch_loop: Path) -> None:
    """Two processes start before the agent wrote them into pids.config (or while it is down): together they
    still get the container's 30 %, not 30 % each."""
    c = container(1024, cores=30)
    procs = [
        subprocess.Popen([str(launch_loop), "kernel", "spin_1ms", "8"], env=c.env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=repo_root())
        for _ in range(2)
    ]  # fmt: skip
    try:
        share = share_of(c, {p.pid for p in procs}, settle=3.0, measure=3.0)
    finally:
        for p in procs:
            p.kill()
            p.communicate(timeout=30)
    # 6 points of room, as for the long kernels below: with each process's NVML sample at its own moment
    # (as the driver stamps them), the pacing of two processes measured up to 34 % on a loaded machine; they
    # got 60 % when each counted the other as a neighbour.
    assert share <= 0.36, f"two unlisted processes of a 30 % container got {share:.1%} of the GPU"
    assert share >= 0.2


CHILD = ONE_KERNEL


def fresh_one_kernel_share(c: Container, env: dict[str, str], measured: float = 16.0) -> tuple[float, int]:
    """Processes of one 400 ms kernel each, started one after another in ``c`` for 3 s of settling then
    ``measured`` seconds measured: the GPU's share over the measured span and how many processes started in all.
    Over 8 s one pair of such kernels more or less in the span was 10 points of the share, so a share within
    bounds read 36.6 % at times; over 16 s it is 5."""
    fresh = FreshProcesses([sys.executable, "-c", CHILD, "spin_400ms"], env, cwd=repo_root())
    try:
        fresh.feed(time.monotonic() + 3.0)  # settling: the first processes find no debt
        with GpuSimState(c.state_path) as st:
            a = st.timeline(0)
        t0 = time.monotonic_ns()
        fresh.feed(time.monotonic() + measured)
        with GpuSimState(c.state_path) as st:
            b = st.timeline(0)
        wall = time.monotonic_ns() - t0
    finally:
        fresh.stop()
    assert a is not None and b is not None
    return (b.busy_ns - a.busy_ns) / wall, fresh.started


@pytest.mark.timing  # a share of GPU time against a tight bound (make test runs it apart)
@pytest.mark.parametrize("limit_mib", [4096, 0], ids=["memory-limit", "no-memory-limit"])
def test_one_long_kernel_per_fresh_process_keeps_the_share(container: MakeContainer, limit_mib: int) -> None:
    """A tenant starts process after process, each launching one 400 ms kernel and exiting once it ran: a new
    process must start with the debt of GPU time the container's processes before it used beyond the share (and
    count what they used after their last measurement), not with a free first launch.  The ledger lives in the
    container's budget file whether or not the container has a memory limit (gpu_memory = 0)."""
    c = container(limit_mib, cores=30)
    share, started = fresh_one_kernel_share(c, c.env())
    assert started >= 6
    assert share <= 0.36, f"processes of one long kernel each got {share:.1%} of the GPU in a 30 % container"


# ---- memory ----------------------------------------------------------------------------------------------

CTYPES = r"""
import ctypes, threading
cu = ctypes.CDLL("libcuda.so.1")
u64 = ctypes.c_uint64
def c_ok(rc, what=""):
    assert rc == 0, f"{what}: {R(rc).name} ({rc})" if what else f"{R(rc).name} ({rc})"
def thread_died(args):  # a worker thread that fails fails the program, never silently
    threading.__excepthook__(args)
    sys.stderr.flush()
    os._exit(1)
threading.excepthook = thread_died
"""


def test_threads_racing_a_memory_pool_at_the_cap(container: MakeContainer) -> None:
    """Stream-ordered allocations from one pool in eight threads at once, right at the cap: two threads must
    not both count on the same spare chunk of the pool while it grows, and every allocation that succeeded must
    be freeable (a worker whose free is refused fails the program, naming the return code)."""
    c = container(1024)
    out = run(
        c,
        CTYPES
        + r"""
import time
"""
        + KEEPING_POOL
        + r"""
streams = [ok(d.cuStreamCreate(0)) for _ in range(8)]
stop = time.monotonic() + 3
counts = []
def worker(i):
    s = ctypes.c_void_p(int(streams[i]))
    c_ok(cu.cuCtxSetCurrent(ctypes.c_void_p(int(ctx))))
    held, n = [], 0
    while time.monotonic() < stop:
        p = u64()
        if cu.cuMemAllocAsync(ctypes.byref(p), ctypes.c_size_t(48 << 20), s) == 0:
            held.append(p.value)
            n += 1
        if len(held) > 2:
            p = held.pop(0)
            c_ok(cu.cuMemFreeAsync(u64(p), s), f"cuMemFreeAsync of {p:#x}, which cuMemAllocAsync returned")
    for p in held:
        c_ok(cu.cuMemFreeAsync(u64(p), s), f"cuMemFreeAsync of {p:#x}, which cuMemAllocAsync returned")
    counts.append(n)
ts = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
[t.start() for t in ts]
[t.join() for t in ts]
print(json.dumps({"peak": peak(), "allocations": sum(counts)}))
""",
    )
    assert out["allocations"] > 0
    assert out["peak"] <= c.limit_bytes, f"the GPU held {out['peak'] >> 20} MiB for a 1024 MiB container"


def test_a_fragmented_pool_grows_for_an_allocation_its_free_memory_cannot_hold(container: MakeContainer) -> None:
    """A pool whose free memory lies in 1 MiB holes between live allocations must grow by the whole size for a
    200 MiB allocation (an allocation is one contiguous range): counting on the free memory it keeps would let
    the GPU hold 250 + 600 + 200 MiB for a 1024 MiB container."""
    c = container(1024)
    out = run(
        c,
        KEEPING_POOL
        + r"""
s = ok(d.cuStreamCreate(0))
def attr(a):
    return int(ok(d.cuMemPoolGetAttribute(pool, a)))
small = [ok(d.cuMemAllocAsync(1 << 20, s)) for _ in range(600)]
for p in small[1::2]:
    ok(d.cuMemFreeAsync(p, s))
ok(d.cuStreamSynchronize(s))
res = {"pool": [attr(A.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), attr(A.CU_MEMPOOL_ATTR_USED_MEM_CURRENT)]}
r = d.cuMemAllocAsync(200 << 20, s)
res["big"] = r[0].name
holes = [d.cuMemAllocAsync(1 << 20, s) for _ in range(100)]  # these fit in the holes: no growth
res["holes"] = sorted({h[0].name for h in holes})
res.update(held=phys_used(), peak=peak())
print(json.dumps(res))
""",
    )
    assert out["pool"] == [600 * MIB, 300 * MIB]
    assert out["big"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert out["holes"] == ["CUDA_SUCCESS"]
    assert out["held"] == c.context_bytes + 600 * MIB
    assert out["peak"] <= c.limit_bytes, f"the GPU held {out['peak'] >> 20} MiB for a 1024 MiB container"


def test_graph_memory_the_device_keeps_for_later_graphs_counts(container: MakeContainer) -> None:
    """The device's graph memory pool keeps what graph allocations gave back until cuDeviceGraphMemTrim: a graph
    of 600 MiB, run and destroyed, leaves 600 MiB on the GPU that later graphs reuse and nothing else may take."""
    c = container(1024)
    out = run(
        c,
        r"""
s = ok(d.cuStreamCreate(0))
def graph_of(size):
    graph = ok(d.cuGraphCreate(0))
    p = d.CUDA_MEM_ALLOC_NODE_PARAMS()
    p.poolProps.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.poolProps.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.poolProps.location.id = 0
    p.bytesize = size
    r = d.cuGraphAddMemAllocNode(graph, None, 0, p)
    if r[0] != R.CUDA_SUCCESS:
        ok(d.cuGraphDestroy(graph))
        return r[0].name
    ok(d.cuGraphAddMemFreeNode(graph, [r[1]], 1, p.dptr))
    x = ok(d.cuGraphInstantiate(graph, 0))
    ok(d.cuGraphLaunch(x, s)); ok(d.cuStreamSynchronize(s))
    ok(d.cuGraphExecDestroy(x)); ok(d.cuGraphDestroy(graph))
    return "CUDA_SUCCESS"
def try_alloc(size):
    r = d.cuMemAlloc(size)
    if r[0] == R.CUDA_SUCCESS:
        ok(d.cuMemFree(r[1]))
    return r[0].name
out = {"first": graph_of(600 << 20), "kept": phys_used()}
out["beside_kept"] = try_alloc(200 << 20)  # 250 + 600 kept + 200 > 1024
out["again"] = [graph_of(600 << 20) for _ in range(3)]  # later graphs reuse the kept memory
out["small"] = try_alloc(150 << 20)
ok(d.cuDeviceGraphMemTrim(dev))
out["trimmed"] = [phys_used(), try_alloc(700 << 20)]
out["peak"] = peak()
print(json.dumps(out))
""",
    )
    cap, ctx = c.limit_bytes, c.context_bytes
    assert out["first"] == "CUDA_SUCCESS" and out["kept"] == ctx + 600 * MIB
    assert out["beside_kept"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert out["again"] == ["CUDA_SUCCESS"] * 3
    assert out["small"] == "CUDA_SUCCESS"
    assert out["trimmed"] == [ctx, "CUDA_SUCCESS"]
    assert out["peak"] <= cap, f"the GPU held {out['peak'] >> 20} MiB for a 1024 MiB container"


def test_many_memory_pools_are_each_charged_what_they_reserve(container: MakeContainer) -> None:
    """A pool reserves whole chunks (2 MiB on the simulated driver) for a 1-byte allocation: 250 pools hold
    500 MiB that a tracker with room for a fixed number of pools would not see (while the container looks
    far from its cap, an allocation is not reconciled with NVML first)."""
    c = container(1024)
    out = run(
        c,
        r"""
props = d.CUmemPoolProps()
props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
props.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
props.location.id = 0
s = ok(d.cuStreamCreate(0))
pools = [ok(d.cuMemPoolCreate(props)) for _ in range(250)]
ptrs = [ok(d.cuMemAllocFromPoolAsync(1, pool, s)) for pool in pools]
held = phys_used()
r = d.cuMemAlloc(380 << 20)
free_b, total = ok(d.cuMemGetInfo())
for p in ptrs:
    ok(d.cuMemFreeAsync(p, s))
ok(d.cuStreamSynchronize(s))
for pool in pools:
    ok(d.cuMemPoolDestroy(pool))
print(json.dumps({"held": held, "alloc": r[0].name, "seen": total - free_b, "peak": peak(),
                  "after": list(ok(d.cuMemGetInfo()))}))
""",
    )
    cap, ctx = c.limit_bytes, c.context_bytes
    assert out["held"] == ctx + 500 * MIB
    assert out["alloc"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert out["seen"] == out["held"]
    assert out["peak"] <= cap, f"the GPU held {out['peak'] >> 20} MiB for a 1024 MiB container"
    assert out["after"] == [cap - ctx, cap]


def test_sparse_and_deferred_mapping_arrays_take_no_memory_beside_the_cap(container: MakeContainer) -> None:
    """Sparse and deferred-mapping arrays get their memory from cuMemCreate (charged there); the GPU must not
    back them beside it.  The simulated GPUs do not support them, and refuse them as such a GPU does."""
    c = container(1024)
    out = run(
        c,
        r"""
desc = d.CUDA_ARRAY3D_DESCRIPTOR()
desc.Width, desc.Height, desc.Depth, desc.NumChannels = 8192, 8192, 4, 4
desc.Format = d.CUarray_format.CU_AD_FORMAT_FLOAT
A = d.CUdevice_attribute
res = {"supported": [ok(d.cuDeviceGetAttribute(a, dev)) for a in (
    A.CU_DEVICE_ATTRIBUTE_SPARSE_CUDA_ARRAY_SUPPORTED, A.CU_DEVICE_ATTRIBUTE_DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED)]}
for name, flag in (("sparse", d.CUDA_ARRAY3D_SPARSE), ("deferred", d.CUDA_ARRAY3D_DEFERRED_MAPPING)):
    desc.Flags = flag
    res[name] = [d.cuArray3DCreate(desc)[0].name, d.cuMipmappedArrayCreate(desc, 4)[0].name]
print(json.dumps({**res, "peak": peak()}))
""",
    )
    assert out["supported"] == [0, 0]
    assert out["sparse"] == out["deferred"] == ["CUDA_ERROR_NOT_SUPPORTED"] * 2
    assert out["peak"] <= c.limit_bytes, f"the GPU held {out['peak'] >> 20} MiB for a 1024 MiB container"


def test_a_handle_released_while_another_thread_maps_it_stays_charged(container: MakeContainer) -> None:
    """cuMemRelease in one thread while cuMemMap of the same handle is under way in another: once mapped, the
    memory lives on (cuda.h: freed with its last mapping), so it must stay charged."""
    c = container(1024)
    out = run(
        c,
        CTYPES
        + r"""
import time
prop = d.CUmemAllocationProp()
prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 0
size = 512 << 20
h = ok(d.cuMemCreate(size, prop, 0))
va = ok(d.cuMemAddressReserve(size, 0, 0, 0))
res = {}
def mapper():  # the simulated cuMemMap returns 300 ms after it mapped (GPUSIM_MAP_RETURN_DELAY_US)
    c_ok(cu.cuCtxSetCurrent(ctypes.c_void_p(int(ctx))))
    res["map"] = cu.cuMemMap(u64(int(va)), ctypes.c_size_t(size), ctypes.c_size_t(0), u64(int(h)), u64(0))
t = threading.Thread(target=mapper)
t.start()
time.sleep(0.1)
res["release"] = cu.cuMemRelease(u64(int(h)))
t.join()
res["mapped"] = phys_used()
r = d.cuMemAlloc(400 << 20)  # 250 MiB of context + 512 mapped + 400 > 1024
res.update(alloc=r[0].name, peak=peak())
print(json.dumps(res))
""",
        GPUSIM_MAP_RETURN_DELAY_US="300000",
    )
    assert out["map"] == 0 and out["release"] == 0
    assert out["mapped"] == c.context_bytes + 512 * MIB
    assert out["alloc"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert out["peak"] <= c.limit_bytes, f"the GPU held {out['peak'] >> 20} MiB for a 1024 MiB container"


def test_every_version_and_flag_of_cu_get_proc_address_hands_out_the_hooks(container: MakeContainer) -> None:
    """Every hooked function asked for through cuGetProcAddress and _v2, under every CUDA version a program may
    name and every flag value (legacy and per-thread default stream), comes back as a hook, never the driver's."""
    hooked = sorted(
        {m for src in (VCUDA / "src").glob("*.c") for m in re.findall(r"VC_EXPORT CUresult (cu\w+)\(", src.read_text())}
    )
    c = container(1024)
    out = run(
        c,
        CTYPES
        + r"""
import re
names = NAMES
hooks = {ctypes.cast(getattr(cu, n), ctypes.c_void_p).value for n in names}
bases = sorted({re.sub(r"(_v\d+)?(_ptsz|_ptds)?$", "", n) for n in names} | {re.sub(r"_v\d+$", "", n) for n in names})
v2, v1 = cu.cuGetProcAddress_v2, cu.cuGetProcAddress
v2.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, u64, ctypes.POINTER(ctypes.c_int)]
v1.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, u64]
answers, escapes = 0, []
for base in bases:
    for version in (2000, 3020, 4000, 10000, 11020, 11030, 11070, 12000, 12020, 12040, 12050, 12080, 13000, 99999):
        for flags in (0, 1, 2, 3):
            for which in ("v1", "v2"):
                p, status = ctypes.c_void_p(), ctypes.c_int()
                rc = (v2(base.encode(), ctypes.byref(p), version, flags, ctypes.byref(status)) if which == "v2"
                      else v1(base.encode(), ctypes.byref(p), version, flags))
                if rc == 0 and p.value:
                    answers += 1
                    if p.value not in hooks:
                        escapes.append([base, version, flags, which])
p = ctypes.c_void_p()
c_ok(v1(b"cuDriverGetVersion", ctypes.byref(p), 12000, 0))  # not hooked: the driver's own, which the check tells apart
print(json.dumps({"bases": len(bases), "answers": answers, "escapes": escapes, "unhooked_told": p.value not in hooks}))
""".replace("NAMES", json.dumps(hooked)),
    )
    assert out["unhooked_told"] is True
    assert out["escapes"] == []
    assert out["bases"] >= 60 and out["answers"] > 4000


def test_a_free_while_nvml_is_read_is_not_taken_for_memory_no_hook_sees(container: MakeContainer) -> None:
    """A reconciliation reads NVML under the budget lock; a free in another thread returns its bytes without it.
    A free landing between the NVML read and the slots' sum must not come back as phantom memory: the container
    would see 512 MiB less than it has until the next reconciliation."""
    c = container(1024)
    out = run(
        c,
        CTYPES
        + r"""
import time
cu.cuMemGetInfo_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
def used():
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    c_ok(cu.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)))
    return t.value - f.value
h = u64()
c_ok(cu.cuMemAlloc_v2(ctypes.byref(h), ctypes.c_size_t(512 << 20)))
time.sleep(0.15)  # the next memory view reconciles (at most every 100 ms)
res = {}
def view():  # NVML's process list returns 50 ms after it was read (GPUSIM_PROCS_RETURN_DELAY_US)
    c_ok(cu.cuCtxSetCurrent(ctypes.c_void_p(int(ctx))))
    res["during"] = used()
t = threading.Thread(target=view)
t.start()
time.sleep(0.02)
c_ok(cu.cuMemFree_v2(h))
t.join()
res["after"] = used()  # within 100 ms of that reconciliation: its result stands
print(json.dumps(res))
""",
        GPUSIM_PROCS_RETURN_DELAY_US="50000",
    )
    assert out["after"] == c.context_bytes, f"{(out['after'] - c.context_bytes) >> 20} MiB of phantom memory"


def test_a_process_whose_main_thread_exited_keeps_its_charge(container: MakeContainer) -> None:
    """The main thread allocates and calls pthread_exit; another thread goes on.  /proc shows the thread-group
    leader as a zombie while the process lives on with its memory: its budget slot must not be reaped (which
    would return its bytes to the container, and make everything it allocates afterwards invisible)."""
    c = container(1024)
    out = run(
        c,
        CTYPES
        + r"""
import time
cu.cuMemGetInfo_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
held = u64()
c_ok(cu.cuMemAlloc_v2(ctypes.byref(held), ctypes.c_size_t(600 << 20)))
def worker():
    time.sleep(0.3)  # the main thread is gone by now
    c_ok(cu.cuCtxSetCurrent(ctypes.c_void_p(int(ctx))))
    state = open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[0]
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    c_ok(cu.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)))  # a usage query reaps the slots of gone processes
    p = u64()
    rc = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(600 << 20))
    print(json.dumps({"leader": state, "seen": t.value - f.value, "alloc": rc, "held": phys_used(), "peak": peak()}),
          flush=True)
    os._exit(0)
threading.Thread(target=worker).start()
ctypes.CDLL(None).pthread_exit(None)
""",
    )
    assert out["leader"] == "Z"
    assert out["seen"] == c.context_bytes + 600 * MIB
    assert out["alloc"] == 2, "a 600 MiB allocation beside 250 + 600 MiB held in a 1024 MiB container"  # OOM
    assert out["held"] == c.context_bytes + 600 * MIB
    assert out["peak"] <= c.limit_bytes, f"the GPU held {out['peak'] >> 20} MiB for a 1024 MiB container"


# ---- memory: the container's processes that bypass the interceptor ----------------------------------


HOLDER = r"""
p = ok(d.cuMemAlloc(300 << 20))
print("held", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("others", [0, 3000])
def test_memory_of_a_process_that_bypasses_the_interceptor_counts_behind_thousands_of_listed_pids(
    container: MakeContainer, others: int
) -> None:
    """A process of the container that loads the driver without the interceptor is found through the
    agent's pids.config and its memory counted; a tenant forking thousands of idle processes first
    (listed before it) must not push it out of what the interceptor reads."""
    c = container(1024)
    holder = c.popen(HOLDER, env=sim_only_env("t4-x1", c.state_path))  # the driver, no interceptor
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held", holder.stderr
        pids = [*range(700000, 700000 + others), holder.pid]
        (c.config_path.parent / "pids.config").write_bytes(b"".join(p.to_bytes(4, "little") for p in pids))
        out = run(
            c,
            r"""
r = d.cuMemAlloc(300 << 20)
print(json.dumps({"alloc": r[0].name, "peak": peak()}))
""",
        )
    finally:
        holder.communicate(input="\n", timeout=30)
    assert out["alloc"] == "CUDA_ERROR_OUT_OF_MEMORY", f"{out}: the bypassing process's 550 MiB went uncounted"
