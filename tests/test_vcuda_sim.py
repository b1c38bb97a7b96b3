"""The simulated libcuda.so.1 on its own, driven by cuda-bindings and pynvml in subprocesses."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from simnode.gpusim_state import GpuSimState, load_spec, spec_dir
from tests.vcuda_fixtures import (
    BUILD,
    DRIVER_VERSION,
    KEEPING_POOL,
    MIB,
    last_json,
    run_python,
    sim_only_env,
    vcuda_built,
)

__all__ = ["vcuda_built"]  # fixtures

STREAM = 544 << 10  # device memory a created stream takes (SIM_STREAM_BYTES: an H200's, driver 580)


def test_driver_files_carry_the_real_names(vcuda_built: Path) -> None:
    del vcuda_built
    for lib in ("libcuda.so", "libnvidia-ml.so"):
        real = BUILD / "sim" / f"{lib}.{DRIVER_VERSION}"
        assert real.is_file()
        assert real.samefile(BUILD / "sim" / f"{lib}.1")


def test_devices_come_from_the_spec(vcuda_built: Path, tmp_path: Path) -> None:
    del vcuda_built
    spec = load_spec(spec_dir() / "h100-nvlink-x8.json")
    done = run_python(
        r"""
A = d.CUdevice_attribute
out = {"version": ok(d.cuDriverGetVersion()), "count": ok(d.cuDeviceGetCount()), "gpus": []}
for i in range(out["count"]):
    g = ok(d.cuDeviceGet(i))
    out["gpus"].append({
        "name": ok(d.cuDeviceGetName(96, g)).split(b"\0")[0].decode(),
        "uuid": bytes(ok(d.cuDeviceGetUuid(g)).bytes).hex(),
        "total": ok(d.cuDeviceTotalMem(g)),
        "sms": ok(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, g)),
        "cc": [ok(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, g)),
               ok(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, g))],
        "pci": [ok(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, g)),
                ok(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, g)),
                ok(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, g))],
        "bus_id": ok(d.cuDeviceGetPCIBusId(32, g)).split(b"\0")[0].decode(),
    })
print(json.dumps(out))
""",
        sim_only_env("h100-nvlink-x8", tmp_path / "node.state"),
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    assert out["version"] == spec.cuda_driver_version
    assert out["count"] == len(spec.gpus)
    for g, s in zip(out["gpus"], spec.gpus, strict=True):
        assert g["name"] == s.name
        assert g["uuid"] == s.uuid[4:].replace("-", "").lower()
        assert g["total"] == s.memory_bytes
        assert g["sms"] == s.sm_count
        assert g["cc"] == [9, 0]
        domain, bus, device = (int(x, 16) for x in s.pci_bus_id.replace(".", ":").split(":")[:3])
        assert g["pci"] == [domain, bus, device]
        assert g["bus_id"] == f"{domain:04X}:{bus:02X}:{device:02X}.0"


HOLD = r"""
p = ok(d.cuMemAlloc(int(sys.argv[1]) << 20))
print(os.getpid(), flush=True)
sys.stdin.readline()
"""

NVML = r"""
import pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
m = pynvml.nvmlDeviceGetMemoryInfo(h)
print(json.dumps({"used": m.used, "free": m.free, "total": m.total,
                  "procs": sorted([p.pid, p.usedGpuMemory] for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)),
                  "cuda_free": ok(d.cuMemGetInfo())[0]}))
"""


def test_memory_in_use_is_per_process_and_dead_processes_are_reaped(vcuda_built: Path, tmp_path: Path) -> None:
    del vcuda_built
    import subprocess
    import sys

    from simnode.gpusim_state import repo_root
    from tests.vcuda_fixtures import PRELUDE

    env = sim_only_env("t4-x1", tmp_path / "node.state")
    holders = [
        subprocess.Popen(
            [sys.executable, "-c", PRELUDE + HOLD, str(mib)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=repo_root(),
        )
        for mib in (1024, 3072)
    ]
    try:
        pids = []
        for h in holders:
            assert h.stdout is not None
            line = h.stdout.readline()
            assert line, h.stderr.read() if h.stderr else ""
            pids.append(int(line))
        gpu = load_spec(spec_dir() / "t4-x1.json").gpus[0]
        total, ctx = gpu.memory_bytes, gpu.context_bytes  # every process's context takes memory too
        both = run_python(NVML, env)
        assert both.returncode == 0, both.stderr
        out = last_json(both.stdout)
        assert isinstance(out, dict)
        me = [p for p in out["procs"] if p[0] not in pids]  # the querying process: its context only
        used = 4096 * MIB + 3 * ctx
        assert out == {
            "used": used,
            "free": total - used,
            "total": total,
            "procs": sorted([[pids[0], ctx + 1024 * MIB], [pids[1], ctx + 3072 * MIB], *me]),
            "cuda_free": total - used,
        }
        assert [p[1] for p in me] == [ctx]
        with GpuSimState(tmp_path / "node.state") as st:
            assert all(p.cuda for p in st.snapshot().processes)
        holders[1].send_signal(signal.SIGKILL)
        holders[1].wait(timeout=30)
        one = run_python(NVML, env)
        procs = last_json(one.stdout)["procs"]  # type: ignore[index]
        assert [p for p in procs if p[0] in pids] == [[pids[0], ctx + 1024 * MIB]]
    finally:
        for h in holders:
            if h.poll() is None:
                h.communicate(input="\n", timeout=30)


def test_the_gpu_runs_out_for_everyone(vcuda_built: Path, tmp_path: Path) -> None:
    del vcuda_built
    done = run_python(
        r"""
free, total = ok(d.cuMemGetInfo())  # the context already holds some of it
a = ok(d.cuMemAlloc(free - (1 << 20)))
print(json.dumps([d.cuMemAlloc(2 << 20)[0].name, d.cuMemAlloc(1 << 20)[0].name, ok(d.cuMemGetInfo())[0]]))
""",
        sim_only_env("t4-x1", tmp_path / "node.state"),
    )
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout) == ["CUDA_ERROR_OUT_OF_MEMORY", "CUDA_SUCCESS", 0]


def test_cu_get_proc_address_follows_versions_and_flags(vcuda_built: Path, tmp_path: Path) -> None:
    del vcuda_built
    done = run_python(
        r"""
lib = ctypes.CDLL("libcuda.so.1")
addr = lambda n: ctypes.cast(getattr(lib, n), ctypes.c_void_p).value
PT = d.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
DEF = d.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
gpa = lib.cuGetProcAddress_v2
gpa.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                ctypes.POINTER(ctypes.c_int)]
def which(name, version, flags=DEF):
    pp, st = ctypes.c_void_p(), ctypes.c_int(-1)
    err = R(gpa(name.encode(), ctypes.byref(pp), version, int(flags), ctypes.byref(st)))
    p, st = pp.value, st.value
    names = ["cuCtxCreate", "cuCtxCreate_v2", "cuCtxCreate_v3", "cuCtxCreate_v4", "cuMemAlloc", "cuMemAlloc_v2",
             "cuMemcpyAsync", "cuMemcpyAsync_ptsz", "cuMemcpyHtoD_v2", "cuMemcpyHtoD_v2_ptds",
             "cuGetProcAddress", "cuGetProcAddress_v2", "cuMemAllocAsync"]
    hit = [n for n in names if p and addr(n) == p]
    return [err.name, int(st), hit[0] if hit else None]
print(json.dumps({
    "ctx3020": which("cuCtxCreate", 3020), "ctx11040": which("cuCtxCreate", 11040),
    "ctx12050": which("cuCtxCreate", 12050),  # the driver is 12.4: _v4 does not exist yet
    "alloc2000": which("cuMemAlloc", 2000), "alloc12000": which("cuMemAlloc", 12000),
    "memcpy_pt": which("cuMemcpyAsync", 7000, PT), "memcpy": which("cuMemcpyAsync", 7000),
    "htod_pt": which("cuMemcpyHtoD", 12000, PT),
    "gpa": which("cuGetProcAddress", 12000), "gpa11": which("cuGetProcAddress", 11030),
    "too_old": which("cuMemAllocAsync", 11000), "unknown": which("cuNoSuchThing", 12000),
    "stub": d.cuCtxResetPersistingL2Cache()[0].name,
}))
""",
        sim_only_env("t4-x1", tmp_path / "node.state"),
    )
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout) == {
        "ctx3020": ["CUDA_SUCCESS", 0, "cuCtxCreate_v2"],
        "ctx11040": ["CUDA_SUCCESS", 0, "cuCtxCreate_v3"],
        "ctx12050": ["CUDA_SUCCESS", 0, "cuCtxCreate_v3"],
        "alloc2000": ["CUDA_SUCCESS", 0, "cuMemAlloc"],
        "alloc12000": ["CUDA_SUCCESS", 0, "cuMemAlloc_v2"],
        "memcpy_pt": ["CUDA_SUCCESS", 0, "cuMemcpyAsync_ptsz"],
        "memcpy": ["CUDA_SUCCESS", 0, "cuMemcpyAsync"],
        "htod_pt": ["CUDA_SUCCESS", 0, "cuMemcpyHtoD_v2_ptds"],
        "gpa": ["CUDA_SUCCESS", 0, "cuGetProcAddress_v2"],
        "gpa11": ["CUDA_SUCCESS", 0, "cuGetProcAddress"],
        "too_old": ["CUDA_ERROR_NOT_FOUND", 2, None],
        "unknown": ["CUDA_ERROR_NOT_FOUND", 1, None],
        "stub": "CUDA_ERROR_NOT_SUPPORTED",
    }


def test_kernels_launch_and_contexts_nest(vcuda_built: Path, tmp_path: Path) -> None:
    del vcuda_built
    done = run_python(
        r"""
mod = ok(d.cuModuleLoadData(b"\x7fELF not really a cubin"))
f = ok(d.cuModuleGetFunction(mod, b"kernel"))
s = ok(d.cuStreamCreate(0))
launched = d.cuLaunchKernel(f, 128, 1, 1, 256, 1, 1, 0, s, 0, 0)[0].name
bad = d.cuLaunchKernel(f, 0, 1, 1, 256, 1, 1, 0, s, 0, 0)[0].name
other = ok(d.cuCtxCreate(0, ok(d.cuDeviceGet(1)) if ok(d.cuDeviceGetCount()) > 1 else dev))
cur = ok(d.cuCtxGetDevice())
ok(d.cuCtxPopCurrent())
back = ok(d.cuCtxGetDevice())
ok(d.cuCtxDestroy(other)); ok(d.cuStreamSynchronize(s)); ok(d.cuStreamDestroy(s)); ok(d.cuModuleUnload(mod))
print(json.dumps([launched, bad, int(cur), int(back)]))
""",
        sim_only_env("v100-pcie-x4", tmp_path / "node.state"),
    )
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout) == ["CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE", 1, 0]


def test_cuinit_without_a_spec_says_why(vcuda_built: Path, tmp_path: Path) -> None:
    del vcuda_built
    import subprocess
    import sys

    env = sim_only_env("t4-x1", tmp_path / "node.state")
    del env["GPUSIM_SPEC"]
    done = subprocess.run(
        [sys.executable, "-c", "from cuda.bindings import driver as d; print(d.cuInit(0)[0].name)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.stdout.strip() == "CUDA_ERROR_NO_DEVICE"
    assert "GPUSIM_SPEC is not set" in done.stderr


def test_libraries_and_context_less_kernels(vcuda_built: Path, tmp_path: Path) -> None:
    """cuLibrary* / CUkernel: a kernel launched as a CUfunction runs in its stream's context, current or not."""
    del vcuda_built
    done = run_python(
        r"""
import time
lib = ok(d.cuLibraryLoadData(b"ptx or cubin", None, None, 0, None, None, 0))
k = ok(d.cuLibraryGetKernel(lib, b"spin_20ms"))
name = ok(d.cuKernelGetName(k))
f = ok(d.cuKernelGetFunction(k))
s = ok(d.cuStreamCreate(0))
stream_ctx = ok(d.cuStreamGetCtx(s))
popped = ok(d.cuCtxPopCurrent())
no_ctx = [d.cuCtxGetCurrent()[1] is None or int(d.cuCtxGetCurrent()[1]) == 0,
          d.cuLaunchKernel(k, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0)[0].name]  # NULL stream: needs a current context
t0 = time.monotonic()
on_stream = d.cuLaunchKernel(k, 1, 1, 1, 32, 1, 1, 0, s, 0, 0)[0].name
ok(d.cuStreamSynchronize(s))
waited = time.monotonic() - t0
ok(d.cuCtxPushCurrent(popped))
via_fn = d.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, 0, 0)[0].name
ok(d.cuStreamSynchronize(s))
ok(d.cuLibraryUnload(lib))
after_unload = d.cuLaunchKernel(k, 1, 1, 1, 32, 1, 1, 0, s, 0, 0)[0].name
print(json.dumps({"name": name.decode() if isinstance(name, bytes) else name, "same_ctx": int(stream_ctx) == int(ctx),
                  "no_ctx": no_ctx, "on_stream": on_stream, "waited": waited, "via_fn": via_fn,
                  "after_unload": after_unload}))
""",
        sim_only_env("t4-x1", tmp_path / "node.state"),
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    assert out["name"] == "spin_20ms" and out["same_ctx"] is True
    assert out["no_ctx"] == [True, "CUDA_ERROR_INVALID_CONTEXT"]
    assert out["on_stream"] == "CUDA_SUCCESS" and out["waited"] >= 0.019  # it took simulated GPU time
    assert out["via_fn"] == "CUDA_SUCCESS"
    assert out["after_unload"] == "CUDA_ERROR_INVALID_HANDLE"


def test_the_legacy_launch_api(vcuda_built: Path, tmp_path: Path) -> None:
    del vcuda_built
    done = run_python(
        r"""
import time
mod = ok(d.cuModuleLoadData(b"x"))
f = ok(d.cuModuleGetFunction(mod, b"spin_5ms"))
out = {"unshaped": d.cuLaunch(f)[0].name}
out["shape"] = [d.cuFuncSetBlockShape(f, 0, 1, 1)[0].name, d.cuFuncSetBlockShape(f, 128, 1, 1)[0].name]
out["params"] = [d.cuParamSetSize(f, 8)[0].name, d.cuParamSeti(f, 0, 7)[0].name, d.cuParamSetf(f, 4, 1.5)[0].name,
                 d.cuParamSetSize(f, 1 << 20)[0].name, d.cuFuncSetSharedSize(f, 1024)[0].name]
s = ok(d.cuStreamCreate(0))
t0 = time.monotonic()
out["launch"] = [d.cuLaunch(f)[0].name, d.cuLaunchGrid(f, 4, 2)[0].name, d.cuLaunchGridAsync(f, 4, 1, s)[0].name,
                 d.cuLaunchGrid(f, 0, 1)[0].name]
ok(d.cuCtxSynchronize())
out["waited"] = time.monotonic() - t0
print(json.dumps(out))
""",
        sim_only_env("t4-x1", tmp_path / "node.state"),
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    assert out["unshaped"] == "CUDA_ERROR_INVALID_VALUE"
    assert out["shape"] == ["CUDA_ERROR_INVALID_VALUE", "CUDA_SUCCESS"]
    assert out["params"] == ["CUDA_SUCCESS"] * 3 + ["CUDA_ERROR_INVALID_VALUE", "CUDA_SUCCESS"]
    assert out["launch"] == ["CUDA_SUCCESS"] * 3 + ["CUDA_ERROR_INVALID_VALUE"]
    assert out["waited"] >= 0.0145  # three 5 ms kernels ran


def test_memory_pools_reserve_keep_and_trim(vcuda_built: Path, tmp_path: Path) -> None:
    """A pool reserves 2 MiB chunks, keeps what is freed until a synchronisation above its release threshold, and
    gives it back on cuMemPoolTrimTo; the GPU (and NVML) sees what the pool reserves."""
    del vcuda_built
    done = run_python(
        r"""
A = d.CUmemPool_attribute
pool = ok(d.cuDeviceGetDefaultMemPool(dev))
s = ok(d.cuStreamCreate(0))
def attr(a):
    return int(ok(d.cuMemPoolGetAttribute(pool, a)))
context = phys_used()
def state():
    return [attr(A.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), attr(A.CU_MEMPOOL_ATTR_USED_MEM_CURRENT),
            phys_used() - context]
out = {"threshold0": attr(A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)}
p = ok(d.cuMemAllocAsync(3 << 20, s))
out["one"] = state()                      # 3 MiB used, 4 MiB reserved (2 MiB chunks)
q = ok(d.cuMemAllocAsync(1 << 20, s))
out["two"] = state()                      # fits in the reserved 4 MiB
ok(d.cuMemFreeAsync(p, s)); ok(d.cuMemFreeAsync(q, s))
out["freed"] = state()                    # still reserved until a synchronisation
ok(d.cuStreamSynchronize(s))
out["synced"] = state()                   # threshold 0: given back
ok(d.cuMemPoolSetAttribute(pool, A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, d.cuuint64_t(1 << 62)))
p = ok(d.cuMemAllocAsync(64 << 20, s)); ok(d.cuMemFreeAsync(p, s)); ok(d.cuStreamSynchronize(s))
out["retained"] = state()                 # a high threshold keeps it
out["high"] = [attr(A.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH), attr(A.CU_MEMPOOL_ATTR_USED_MEM_HIGH)]
ok(d.cuMemPoolTrimTo(pool, 16 << 20))
out["trimmed"] = state()
ok(d.cuMemPoolSetAttribute(pool, A.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, d.cuuint64_t(0)))
out["high_reset"] = attr(A.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)
ok(d.cuMemPoolTrimTo(pool, 0))
out["empty"] = state()
out["read_only"] = d.cuMemPoolSetAttribute(pool, A.CU_MEMPOOL_ATTR_USED_MEM_CURRENT, d.cuuint64_t(5))[0].name
print(json.dumps(out))
""",
        sim_only_env("t4-x1", tmp_path / "node.state"),
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    M = MIB
    assert out == {
        "threshold0": 0,
        "one": [4 * M, 3 * M, 4 * M],
        "two": [4 * M, 4 * M, 4 * M],
        "freed": [4 * M, 0, 4 * M],
        "synced": [0, 0, 0],
        "retained": [64 * M, 0, 64 * M],
        "high": [64 * M, 64 * M],
        "trimmed": [16 * M, 0, 16 * M],
        "high_reset": 16 * M,
        "empty": [0, 0, 0],
        "read_only": "CUDA_ERROR_INVALID_VALUE",
    }


def test_stream_capture_records_a_graph(vcuda_built: Path, tmp_path: Path) -> None:
    """Work on a capturing stream becomes graph nodes (nothing runs, nothing allocated) until the graph runs."""
    del vcuda_built
    done = run_python(
        r"""
import time
S = d.CUstreamCaptureStatus
s = ok(d.cuStreamCreate(0))
mod = ok(d.cuModuleLoadData(b"x"))
fn = ok(d.cuModuleGetFunction(mod, b"spin_20ms"))
base = phys_used()  # the context and the module
ok(d.cuStreamBeginCapture(s, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
status, cid, graph, _deps, _n = ok(d.cuStreamGetCaptureInfo(s))
ok(d.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s, 0, 0))
buf = ok(d.cuMemAllocAsync(64 << 20, s))
ok(d.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s, 0, 0))
ok(d.cuMemFreeAsync(buf, s))
out = {"capturing": [ok(d.cuStreamIsCapturing(s)).name, status.name, int(cid) > 0],
       "phys_captured": phys_used() - base,
       "legacy": d.cuStreamBeginCapture(0, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)[0].name}
g = ok(d.cuStreamEndCapture(s))
out["same_graph"] = int(g) == int(graph)
out["after"] = ok(d.cuStreamIsCapturing(s)).name
x = ok(d.cuGraphInstantiate(g, 0))
out["phys_instantiated"] = phys_used() - base
t0 = time.monotonic()
ok(d.cuStreamSynchronize(s))
out["nothing_ran"] = time.monotonic() - t0  # the captured kernels were not queued
t1 = time.monotonic()
ok(d.cuGraphLaunch(x, s)); ok(d.cuStreamSynchronize(s))
out["graph_ran"] = time.monotonic() - t1
ok(d.cuGraphExecDestroy(x)); ok(d.cuGraphDestroy(g))
A = d.CUgraphMem_attribute
pool = lambda: [int(ok(d.cuDeviceGetGraphMemAttribute(dev, a))) for a in (
    A.CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, A.CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
    A.CU_GRAPH_MEM_ATTR_USED_MEM_HIGH, A.CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)]
out["phys_kept"] = [phys_used() - base, pool()]  # the device's graph pool keeps it for later graphs
ok(d.cuDeviceGraphMemTrim(dev))
out["phys_end"] = [phys_used() - base, pool()]
out["reset_high"] = [d.cuDeviceSetGraphMemAttribute(dev, A.CU_GRAPH_MEM_ATTR_USED_MEM_HIGH, d.cuuint64_t(0))[0].name,
                     d.cuDeviceSetGraphMemAttribute(dev, A.CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, d.cuuint64_t(0))[0].name,
                     pool()]
# A synchronisation inside a capture invalidates it.
ok(d.cuStreamBeginCapture(s, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
out["sync_in_capture"] = [d.cuStreamSynchronize(s)[0].name, ok(d.cuStreamIsCapturing(s)).name,
                          d.cuStreamEndCapture(s)[0].name]
print(json.dumps(out))
""",
        sim_only_env("t4-x1", tmp_path / "node.state"),
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    assert out["capturing"] == ["CU_STREAM_CAPTURE_STATUS_ACTIVE", "CU_STREAM_CAPTURE_STATUS_ACTIVE", True]
    assert out["phys_captured"] == 0 and out["legacy"] == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
    assert out["same_graph"] is True and out["after"] == "CU_STREAM_CAPTURE_STATUS_NONE"
    assert out["phys_instantiated"] == 64 * MIB  # the exec holds the graph's memory
    assert out["nothing_ran"] < 0.02 and out["graph_ran"] >= 0.039, out  # two 20 ms kernels
    assert out["phys_kept"] == [64 * MIB, [0, 64 * MIB, 64 * MIB, 64 * MIB]]
    assert out["phys_end"] == [0, [0, 0, 64 * MIB, 64 * MIB]]  # trimmed
    assert out["reset_high"] == ["CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE", [0, 0, 0, 64 * MIB]]
    assert out["sync_in_capture"] == ["CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "CU_STREAM_CAPTURE_STATUS_INVALIDATED",
                                      "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"]  # fmt: skip


def test_a_child_graph_node_embeds_a_clone_that_runs_with_its_graph(vcuda_built: Path, tmp_path: Path) -> None:
    """cuGraphAddChildGraphNode clones the child graph into the node (cuda.h): the original can go, the embedded
    graph is the node's (what is added to it runs too, memory nodes excepted), and it goes with the node's graph. A
    child graph with memory nodes is refused."""
    del vcuda_built
    done = run_python(
        r"""
import time
T = d.CUgraphNodeType
s = ok(d.cuStreamCreate(0))
mod = ok(d.cuModuleLoadData(b"x"))
fn = ok(d.cuModuleGetFunction(mod, b"spin_20ms"))
p = d.CUDA_KERNEL_NODE_PARAMS()
p.func = fn
p.gridDimX = p.gridDimY = p.gridDimZ = 1
p.blockDimX, p.blockDimY, p.blockDimZ = 32, 1, 1
inner = ok(d.cuGraphCreate(0))
ok(d.cuGraphAddKernelNode(inner, None, 0, p))
outer = ok(d.cuGraphCreate(0))
node = ok(d.cuGraphAddChildGraphNode(outer, None, 0, inner))
emb = ok(d.cuGraphChildGraphNodeGetGraph(node))
out = {"type": ok(d.cuGraphNodeGetType(node)).name, "cloned": int(emb) != int(inner),
       "emb_nodes": ok(d.cuGraphGetNodes(emb))[1]}
ok(d.cuGraphDestroy(inner))  # the node keeps its clone
ok(d.cuGraphAddKernelNode(emb, None, 0, p))  # changes to the embedded graph are the node's

def ran(graph):
    x = ok(d.cuGraphInstantiate(graph, 0))
    t = time.monotonic()
    ok(d.cuGraphLaunch(x, s)); ok(d.cuStreamSynchronize(s))
    took = time.monotonic() - t
    ok(d.cuGraphExecDestroy(x))
    return took

out["ran"] = ran(outer)  # two 20 ms kernels
top = ok(d.cuGraphCreate(0))
ok(d.cuGraphAddChildGraphNode(top, None, 0, outer))  # nested: outer cloned, its child's clone cloned in turn
out["nested_ran"] = ran(top)
ok(d.cuStreamBeginCapture(s, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
buf = ok(d.cuMemAllocAsync(1 << 20, s))
ok(d.cuMemFreeAsync(buf, s))
with_memory = ok(d.cuStreamEndCapture(s))
out["memory_child"] = d.cuGraphAddChildGraphNode(top, None, 0, with_memory)[0].name
ok(d.cuGraphDestroy(outer))  # its node's embedded graph goes with it
out["emb_after"] = d.cuGraphGetNodes(emb)[0].name
ok(d.cuGraphDestroy(top))
print(json.dumps(out))
""",
        sim_only_env("t4-x1", tmp_path / "node.state"),
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    assert out["type"] == "CU_GRAPH_NODE_TYPE_GRAPH" and out["cloned"] is True and out["emb_nodes"] == 1
    assert out["ran"] >= 0.039 and out["nested_ran"] >= 0.039, out
    assert out["memory_child"] == "CUDA_ERROR_INVALID_VALUE"
    assert out["emb_after"] == "CUDA_ERROR_INVALID_VALUE"


def test_contexts_and_modules_take_memory_nvml_shows_per_process(vcuda_built: Path, tmp_path: Path) -> None:
    """Every context takes its GPU model's size (the spec may set it), every module a 2 MiB page; NVML's process
    list shows it per process."""
    del vcuda_built
    spec = json.loads((spec_dir() / "v100-pcie-x4.json").read_text())
    spec["gpus"][1]["context_mib"] = 123
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    program = r"""
import pynvml
pynvml.nvmlInit()
def mine(i):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    return [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == os.getpid()]
out = {"primary": mine(0)}
other = ok(d.cuCtxCreate(0, dev))
out["two_contexts"] = mine(0)
mod = ok(d.cuModuleLoadData(b"x"))
out["module"] = mine(0)
ok(d.cuModuleUnload(mod)); ok(d.cuCtxDestroy(other)); ok(d.cuCtxSetCurrent(ctx))
out["one_context"] = mine(0)
g1 = ok(d.cuDeviceGet(1))
c1 = ok(d.cuDevicePrimaryCtxRetain(g1))
out["spec_set"] = mine(1)
ok(d.cuDevicePrimaryCtxRelease(g1))
out["released"] = mine(1)
print(json.dumps(out))
"""
    env = sim_only_env("v100-pcie-x4", tmp_path / "node.state")
    env["GPUSIM_SPEC"] = str(path)
    done = run_python(program, env)
    assert done.returncode == 0, done.stderr
    v100 = load_spec(path).gpus[0].context_bytes
    assert v100 == 300 * MIB  # the V100's default
    assert last_json(done.stdout) == {
        "primary": [v100],
        "two_contexts": [2 * v100],
        "module": [2 * v100 + 2 * MIB],
        "one_context": [v100],
        "spec_set": [123 * MIB],
        "released": [],
    }
    env["GPUSIM_CONTEXT_MIB"] = "0"  # the knob for tests that want contexts free
    free = run_python("print(json.dumps(ok(d.cuMemGetInfo())[0] == ok(d.cuDeviceTotalMem(dev))))", env)
    assert last_json(free.stdout) is True


MODULE_IMAGES = r"""
import pynvml
pynvml.nvmlInit()
def mine():
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    return sum(p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == os.getpid())
PTX = b'''.version 7.0
.target sm_75
.address_size 64
// .global .b8 commented[999999999];
.visible .global .align 8 .b8 table[104857600];
.visible .const .align 4 .u32 coeffs[4] = {1, 2, 3, 4};
.extern .global .b8 elsewhere[64];
.visible .entry work_1us(.param .u64 p) { .reg .b64 %rd<2>; ret; }
''' + b"\0"
"""


def test_modules_and_libraries_take_their_variables_where_they_are_loaded(vcuda_built: Path, tmp_path: Path) -> None:
    """A module's code page and PTX variables (whole 2 MiB pages) are its context's; a library goes into a context
    lazily (when something there needs it) or, with CUDA_MODULE_LOADING=EAGER, into every context at once."""
    del vcuda_built
    program = (
        MODULE_IMAGES
        + r"""
base = mine()
out = {}
mod = ok(d.cuModuleLoadData(PTX))
out["module"] = mine() - base
ptr, size = ok(d.cuModuleGetGlobal(mod, b"table"))
out["table"] = int(size)
out["set"] = d.cuMemsetD8(ptr, 0, int(size))[0].name  # copies and sets accept a module's variables
out["coeffs"] = int(ok(d.cuModuleGetGlobal(mod, b"coeffs"))[1])
out["extern"] = d.cuModuleGetGlobal(mod, b"elsewhere")[0].name
out["commented"] = d.cuModuleGetGlobal(mod, b"commented")[0].name
other = ok(d.cuCtxCreate(0, dev))
m2 = ok(d.cuModuleLoadData(PTX))
out["two"] = mine() - base
ok(d.cuCtxDestroy(other))  # its module goes with it
ok(d.cuCtxSetCurrent(ctx))
out["after_destroy"] = mine() - base
ok(d.cuModuleUnload(mod))
out["unloaded"] = mine() - base
lib = ok(d.cuLibraryLoadData(PTX, None, None, 0, None, None, 0))
out["library"] = mine() - base
other = ok(d.cuCtxCreate(0, dev))
ctx_size = mine() - base
out["library_new_ctx"] = ctx_size
gptr, gsize = ok(d.cuLibraryGetGlobal(lib, b"table"))
out["get_global"] = mine() - base - ctx_size
ok(d.cuCtxSetCurrent(ctx))
k = ok(d.cuLibraryGetKernel(lib, b"work_1us"))
s = ok(d.cuStreamCreate(0))
ok(d.cuLaunchKernel(k, 1, 1, 1, 32, 1, 1, 0, s, 0, 0))
ok(d.cuStreamSynchronize(s))
out["launched"] = mine() - base - ctx_size
ok(d.cuLibraryUnload(lib))
out["library_unloaded"] = mine() - base - ctx_size
print(json.dumps(out))
"""
    )
    env = sim_only_env("t4-x1", tmp_path / "node.state")
    done = run_python(program, env)
    assert done.returncode == 0, done.stderr
    footprint = 2 * MIB + 102 * MIB  # code page + 100 MiB and 16 bytes of variables in whole pages
    ctx = load_spec(spec_dir() / "t4-x1.json").gpus[0].context_bytes
    assert last_json(done.stdout) == {
        "module": footprint,
        "table": 100 * MIB,
        "set": "CUDA_SUCCESS",
        "coeffs": 16,
        "extern": "CUDA_ERROR_NOT_FOUND",
        "commented": "CUDA_ERROR_NOT_FOUND",
        "two": ctx + 2 * footprint,
        "after_destroy": footprint,
        "unloaded": 0,
        "library": 0,  # lazily: nothing until a context needs it
        "library_new_ctx": ctx,
        "get_global": footprint,  # into the current (new) context
        "launched": 2 * footprint + STREAM,  # a launch in the primary context loads it there too (and its stream)
        "library_unloaded": STREAM,
    }
    eager = run_python(
        MODULE_IMAGES
        + r"""
base = mine()
lib = ok(d.cuLibraryLoadData(PTX, None, None, 0, None, None, 0))
loaded = mine() - base
other = ok(d.cuCtxCreate(0, dev))
with_ctx = mine() - base
ok(d.cuLibraryUnload(lib))
print(json.dumps([loaded, with_ctx, mine() - base]))
""",
        {**env, "CUDA_MODULE_LOADING": "EAGER"},
    )
    assert eager.returncode == 0, eager.stderr
    assert last_json(eager.stdout) == [footprint, ctx + 2 * footprint, ctx]


def test_freed_device_addresses_come_back(vcuda_built: Path, tmp_path: Path) -> None:
    """As with the real driver, an allocation takes the range a free of its size just gave back; a program that
    allocates and frees in a loop never runs out of addresses (70,000 x 256 MiB is more than the 16 TiB a GPU's
    fresh addresses span)."""
    del vcuda_built
    done = run_python(
        r"""
a = ok(d.cuMemAlloc(256 << 20)); ok(d.cuMemFree(a))
b = ok(d.cuMemAlloc(256 << 20)); other = ok(d.cuMemAlloc(256 << 20))
ok(d.cuMemFree(b)); ok(d.cuMemFree(other))
s = ok(d.cuStreamCreate(0))
c = ok(d.cuMemAllocAsync(64 << 20, s)); ok(d.cuMemFreeAsync(c, s)); ok(d.cuStreamSynchronize(s))
c2 = ok(d.cuMemAllocAsync(64 << 20, s)); ok(d.cuMemFreeAsync(c2, s))
last, n = None, 0
for _ in range(70000):
    r = d.cuMemAlloc(256 << 20)
    if r[0] != R.CUDA_SUCCESS:
        last = r[0].name
        break
    ok(d.cuMemFree(r[1]))
    n += 1
print(json.dumps({"reused": int(a) == int(b), "distinct": int(other) != int(b), "pool": int(c) == int(c2),
                  "loops": n, "last": last}))
""",
        sim_only_env("t4-x1", tmp_path / "node.state"),
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout) == {"reused": True, "distinct": True, "pool": True, "loops": 70000, "last": None}


def test_a_pool_allocation_never_shares_its_range_and_is_always_freeable(vcuda_built: Path, tmp_path: Path) -> None:
    """A freed pool allocation's range stays the pool's (it serves the pool's next allocations that fit there):
    a segment the pool grows later, or a cuMemAlloc, must never take that range while the pool still holds it.
    Checked on a fixed case (free the first of two 48 MiB allocations, allocate two more) and on a seeded walk of
    allocations, frees, trims and synchronisations: live ranges never overlap, and every free succeeds."""
    del vcuda_built
    done = run_python(
        r"""
import random
"""
        + KEEPING_POOL
        + r"""
s = ok(d.cuStreamCreate(0))
M = 1 << 20
live = {}  # address -> (size, "pool" | "plain")
bad = []
def took(p, size, kind):
    p = int(p)
    for q, (qs, qk) in live.items():
        if p < q + qs and q < p + size:
            bad.append(f"{kind} {p:#x}+{size >> 20} MiB overlaps {qk} {q:#x}+{qs >> 20} MiB")
    live[p] = (size, kind)
def free(p):
    size, kind = live.pop(p)
    r = d.cuMemFreeAsync(p, s) if kind == "pool" else d.cuMemFree(p)
    if r[0] != R.CUDA_SUCCESS:
        bad.append(f"free of {kind} {p:#x}+{size >> 20} MiB: {r[0].name}")
a = ok(d.cuMemAllocAsync(48 * M, s)); took(a, 48 * M, "pool")
b = ok(d.cuMemAllocAsync(48 * M, s)); took(b, 48 * M, "pool")
free(int(a))
for _ in range(2):
    took(ok(d.cuMemAllocAsync(48 * M, s)), 48 * M, "pool")
took(ok(d.cuMemAlloc(48 * M)), 48 * M, "plain")
fixed = list(bad)
for p in list(live):
    free(p)
ok(d.cuStreamSynchronize(s))
rng = random.Random(7)
for step in range(3000):
    x = rng.random()
    if x < 0.45 or not live:
        size = rng.choice([1, 3, 16, 48, 48, 48, 100]) * M
        if rng.random() < 0.85:
            r = d.cuMemAllocAsync(size, s)
            kind = "pool"
        else:
            r = d.cuMemAlloc(size)
            kind = "plain"
        if r[0] == R.CUDA_SUCCESS:
            took(r[1], size, kind)
    elif x < 0.9:
        free(rng.choice(list(live)))
    elif x < 0.95:
        ok(d.cuMemPoolTrimTo(pool, rng.choice([0, 64 * M, 256 * M])))
    else:
        ok(d.cuMemPoolSetAttribute(pool, A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, d.cuuint64_t(rng.choice([0, 1 << 62]))))
        ok(d.cuStreamSynchronize(s))
    if len(live) > 12:
        free(rng.choice(list(live)))
used = int(ok(d.cuMemPoolGetAttribute(pool, A.CU_MEMPOOL_ATTR_USED_MEM_CURRENT)))
pool_live = sum(size for size, kind in live.values() if kind == "pool")
for p in list(live):
    free(p)
print(json.dumps({"fixed": fixed, "walk": bad[len(fixed):][:10], "used": used == pool_live}))
""",
        sim_only_env("t4-x1", tmp_path / "node.state"),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout) == {"fixed": [], "walk": [], "used": True}


def test_proc_driver_nvidia_version_is_served(vcuda_built: Path, tmp_path: Path) -> None:
    """The simulated driver writes its /proc/driver/nvidia/version where GPUSIM_PROC_VERSION says; preloading
    libgpusim-proc.so makes a process read it at the real path."""
    del vcuda_built
    env = sim_only_env("t4-x1", tmp_path / "node.state")
    env["GPUSIM_PROC_VERSION"] = str(tmp_path / "version")
    env["LD_PRELOAD"] = str(BUILD / "sim" / "libgpusim-proc.so")
    done = run_python(
        r"""
import pynvml
pynvml.nvmlInit()
with open("/proc/driver/nvidia/version") as f:
    text = f.read()
print(json.dumps({"text": text, "nvml": pynvml.nvmlSystemGetDriverVersion(),
                  "other_paths": os.path.exists("/proc/self/status")}))
""",
        env,
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    first = out["text"].splitlines()[0]
    assert first.startswith("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  ")
    assert out["nvml"] == "550.54.15" and out["other_paths"] is True
    assert (tmp_path / "version").read_text() == out["text"]


def test_copies_sets_pointer_queries_limits_and_host_functions(vcuda_built: Path, tmp_path: Path) -> None:
    """Copies and sets check their ranges (no data moves); pointers are looked up; a bigger stack takes memory."""
    del vcuda_built
    done = run_python(
        r"""
import time
M = 1 << 20
p = int(ok(d.cuMemAlloc(M)))
host = bytearray(M)
out = {
    "htod": d.cuMemcpyHtoD(p, host, M)[0].name,
    "htod_past_end": d.cuMemcpyHtoD(p + M - 10, host, 100)[0].name,
    "dtoh": d.cuMemcpyDtoH(host, p, M)[0].name,
    "dtod": d.cuMemcpyDtoD(p, p + M // 2, M // 2)[0].name,
    "memset": [d.cuMemsetD32(p, 7, M // 4)[0].name, d.cuMemsetD8(p, 1, M + 1)[0].name],
    "unknown": d.cuMemcpyHtoD(0x1234, host, 4)[0].name,
}
A = d.CUpointer_attribute
out["pointer"] = [int(ok(d.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, p + 100))) == int(p),
                  ok(d.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_RANGE_SIZE, p + 100)),
                  ok(d.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p))]
base, size = ok(d.cuMemGetAddressRange(p + 5))
out["range"] = [int(base) == int(p), size, d.cuMemGetAddressRange(0x1234)[0].name]
s = ok(d.cuStreamCreate(0))
q = int(ok(d.cuMemAllocAsync(M, s)))
pool = ok(d.cuDeviceGetDefaultMemPool(dev))
out["pool"] = int(ok(d.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, q))) == int(pool)
# A host function runs once the stream's work before it is done.
lib = ctypes.CDLL("libcuda.so.1")
called = []
CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
cb = CB(lambda _arg: called.append(time.monotonic()))
mod = ok(d.cuModuleLoadData(b"x"))
fn = ok(d.cuModuleGetFunction(mod, b"spin_20ms"))
t0 = time.monotonic()
ok(d.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s, 0, 0))
lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, CB, ctypes.c_void_p]
assert lib.cuLaunchHostFunc(ctypes.c_void_p(int(s)), cb, None) == 0
ok(d.cuStreamSynchronize(s))
time.sleep(0.05)
out["host_fn"] = len(called) == 1 and called[0] - t0 >= 0.019
# A bigger stack is reserved for every thread the GPU can hold (T4: 40 SMs x 1024 threads).
before = phys_used()
L = d.CUlimit
ok(d.cuCtxSetLimit(L.CU_LIMIT_STACK_SIZE, 4096))
out["stack"] = [ok(d.cuCtxGetLimit(L.CU_LIMIT_STACK_SIZE)), phys_used() - before]
ok(d.cuCtxSetLimit(L.CU_LIMIT_STACK_SIZE, 1024))
out["stack_back"] = phys_used() - before
out["priorities"] = list(ok(d.cuCtxGetStreamPriorityRange()))
print(json.dumps(out))
""",
        sim_only_env("t4-x1", tmp_path / "node.state"),
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    bad = "CUDA_ERROR_INVALID_VALUE"
    assert [out["htod"], out["htod_past_end"], out["dtoh"], out["dtod"]] == ["CUDA_SUCCESS", bad, "CUDA_SUCCESS",
                                                                            "CUDA_SUCCESS"]  # fmt: skip
    assert out["memset"] == ["CUDA_SUCCESS", bad] and out["unknown"] == bad
    assert out["pointer"] == [True, MIB, 0]
    assert out["range"] == [True, MIB, "CUDA_ERROR_NOT_FOUND"]
    assert out["pool"] is True and out["host_fn"] is True
    assert out["stack"] == [4096, (4096 - 1024) * 40 * 1024]
    assert out["stack_back"] == 0
    assert out["priorities"] == [0, -5]


def test_streams_take_device_memory_until_destroyed_or_their_context_goes(vcuda_built: Path, tmp_path: Path) -> None:
    """A stream holds device memory of its context that no allocation shows (an H200 with driver 580: 500 streams
    took 272 MiB, 70 MiB for 128), given back when it is destroyed or its context goes; GPUSIM_STREAM_KIB sets it."""
    del vcuda_built
    program = (
        MODULE_IMAGES
        + r"""
base = mine()
streams = [ok(d.cuStreamCreate(1)) for _ in range(4)]
out = {"four": mine() - base}
ok(d.cuStreamDestroy(streams.pop()))
out["three"] = mine() - base
other = ok(d.cuCtxCreate(0, dev))
with_ctx = mine() - base
ok(d.cuStreamCreate(0))
out["in_other"] = mine() - base - with_ctx
ok(d.cuCtxDestroy(other))
out["other_gone"] = mine() - base
print(json.dumps(out))
"""
    )
    done = run_python(program, sim_only_env("t4-x1", tmp_path / "node.state"))
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout) == {
        "four": 4 * STREAM,
        "three": 3 * STREAM,
        "in_other": STREAM,
        "other_gone": 3 * STREAM,
    }
    env = sim_only_env("t4-x1", tmp_path / "node2.state")
    env["GPUSIM_STREAM_KIB"] = "2048"
    done = run_python(program, env)
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout)["four"] == 4 * 2048 * 1024  # type: ignore[index]
