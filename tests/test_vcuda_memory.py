"""The interceptor's memory cap, driven by cuda-bindings through every allocation path.

Each program allocates until the driver says no.  The cap must stop it at the allocation that
would cross the container's limit, with CUDA_ERROR_OUT_OF_MEMORY, while the simulated GPU (whose
own memory is far larger) still has room.  The cap covers the container's whole footprint: the
context each process makes takes device memory too (the simulated T4's 250 MiB), and counts.
After everything is freed, only the contexts stay charged, in the budget and on the GPU.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.vcuda_fixtures import MIB, PRELUDE, Container, container, last_json, vcuda_built

__all__ = ["container", "vcuda_built"]  # fixtures

MakeContainer = Callable[..., Container]

# Each path defines alloc() -> (CUresult, handle) for one 64 MiB chunk (as the simulated driver
# sizes it) and free(handle).
PATHS = {
    "cuMemAlloc": r"""
def alloc():
    r = d.cuMemAlloc(64 << 20); return r[0], r[1]
def free(h): ok(d.cuMemFree(h))
""",
    "cuMemAllocPitch": r"""
def alloc():
    r = d.cuMemAllocPitch(8192, 8192, 4); return r[0], r[1]
def free(h): ok(d.cuMemFree(h))
""",
    "cuMemAllocManaged": r"""
def alloc():
    r = d.cuMemAllocManaged(64 << 20, d.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL); return r[0], r[1]
def free(h): ok(d.cuMemFree(h))
""",
    "cuMemAllocAsync": r"""
stream = ok(d.cuStreamCreate(0))
def alloc():
    r = d.cuMemAllocAsync(64 << 20, stream); return r[0], r[1]
def free(h): ok(d.cuMemFreeAsync(h, stream))
""",
    "cuMemAllocFromPoolAsync": r"""
props = d.CUmemPoolProps()
props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
props.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
props.location.id = 0
pool = ok(d.cuMemPoolCreate(props))
def alloc():
    r = d.cuMemAllocFromPoolAsync(64 << 20, pool, 0); return r[0], r[1]
def free(h): ok(d.cuMemFreeAsync(h, 0))
""",
    "cuMemCreate": r"""
prop = d.CUmemAllocationProp()
prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 0
gran = ok(d.cuMemGetAllocationGranularity(prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
assert (64 << 20) % gran == 0
def alloc():
    r = d.cuMemCreate(64 << 20, prop, 0)
    if r[0] != R.CUDA_SUCCESS:
        return r[0], None
    va = ok(d.cuMemAddressReserve(64 << 20, 0, 0, 0))
    ok(d.cuMemMap(va, 64 << 20, 0, r[1], 0))
    acc = d.CUmemAccessDesc()
    acc.location = prop.location
    acc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    ok(d.cuMemSetAccess(va, 64 << 20, [acc], 1))
    return r[0], (r[1], va)
def free(h):
    handle, va = h
    ok(d.cuMemUnmap(va, 64 << 20)); ok(d.cuMemAddressFree(va, 64 << 20)); ok(d.cuMemRelease(handle))
""",
    "cuArrayCreate": r"""
desc = d.CUDA_ARRAY_DESCRIPTOR()
desc.Width, desc.Height, desc.NumChannels = 4096, 4096, 1
desc.Format = d.CUarray_format.CU_AD_FORMAT_FLOAT
def alloc():
    r = d.cuArrayCreate(desc)
    if r[0] == R.CUDA_SUCCESS:
        req = ok(d.cuArrayGetMemoryRequirements(r[1], dev))
        assert req.size == 64 << 20, req.size
    return r[0], r[1]
def free(h): ok(d.cuArrayDestroy(h))
""",
    "cuArray3DCreate": r"""
desc = d.CUDA_ARRAY3D_DESCRIPTOR()
desc.Width, desc.Height, desc.Depth, desc.NumChannels = 1024, 1024, 16, 1
desc.Format = d.CUarray_format.CU_AD_FORMAT_FLOAT
def alloc():
    r = d.cuArray3DCreate(desc); return r[0], r[1]
def free(h): ok(d.cuArrayDestroy(h))
""",
    "cuMipmappedArrayCreate": r"""
desc = d.CUDA_ARRAY3D_DESCRIPTOR()
desc.Width, desc.Height, desc.Depth, desc.NumChannels = 4096, 4096, 0, 1
desc.Format = d.CUarray_format.CU_AD_FORMAT_UNSIGNED_INT8
def alloc():
    r = d.cuMipmappedArrayCreate(desc, 4); return r[0], r[1]
def free(h): ok(d.cuMipmappedArrayDestroy(h))
""",
    "cuGraphAddMemAllocNode": r"""
# One graph per allocation, instantiated: the memory is the exec's (cuda.h).
def alloc():
    graph = ok(d.cuGraphCreate(0))
    p = d.CUDA_MEM_ALLOC_NODE_PARAMS()
    p.poolProps.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.poolProps.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.poolProps.location.id = 0
    p.bytesize = 64 << 20
    r = d.cuGraphAddMemAllocNode(graph, None, 0, p)
    if r[0] != R.CUDA_SUCCESS:
        ok(d.cuGraphDestroy(graph))
        return r[0], None
    return r[0], (graph, ok(d.cuGraphInstantiate(graph, 0)))
def free(h):  # the device's graph pool keeps the memory for later graphs until trimmed
    ok(d.cuGraphExecDestroy(h[1])); ok(d.cuGraphDestroy(h[0])); ok(d.cuDeviceGraphMemTrim(dev))
""",
    "legacy cuMemAlloc (CUDA 2.0 ABI)": r"""
lib = ctypes.CDLL("libcuda.so.1")
lib.cuMemAlloc.argtypes = [ctypes.POINTER(ctypes.c_uint), ctypes.c_uint]
lib.cuMemFree.argtypes = [ctypes.c_uint]
def alloc():
    p = ctypes.c_uint(0)
    return R(lib.cuMemAlloc(ctypes.byref(p), 64 << 20)), p.value
def free(h): assert lib.cuMemFree(h) == 0
""",
}

FILL = r"""
context = phys_used()  # what the GPU holds for this process before any allocation: its context
handles = []
while True:
    before = phys_used()
    rc, h = alloc()
    if rc != R.CUDA_SUCCESS:
        break
    handles.append((h, phys_used() - before))
    assert len(handles) < 1000
full_phys = phys_used()
full_free, full_total = ok(d.cuMemGetInfo())
for h, _size in handles:
    free(h)
ok(d.cuCtxSynchronize())  # memory pools give freed memory back at synchronisation
after_free, after_total = ok(d.cuMemGetInfo())
print(json.dumps({
    "rc": rc.name, "count": len(handles), "sizes": sorted({s for _h, s in handles}),
    "full_phys": full_phys, "full_free": full_free, "total": full_total, "context": context,
    "after_phys": phys_used(), "after_free": after_free, "gpu_total": ok(d.cuDeviceTotalMem(dev)),
}))
"""


@pytest.mark.parametrize("path", list(PATHS))
def test_every_allocation_path_stops_at_the_cap(container: MakeContainer, path: str) -> None:
    c = container(1024)
    done = c.python(PATHS[path] + FILL)
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    limit = c.limit_bytes
    chunk = max(out["sizes"])
    assert out["rc"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert out["count"] >= 1
    # The cap held for the whole footprint (context included), and it was the cap (not the 15 GiB GPU)
    # that said no: one more chunk would cross it.
    assert out["context"] == c.context_bytes
    assert out["full_phys"] <= limit
    assert out["full_phys"] + chunk > limit
    assert out["total"] == limit
    assert out["full_free"] == limit - out["full_phys"]
    # Nothing leaks: the GPU and the container's budget hold the context only.
    assert out["after_phys"] == c.context_bytes
    assert out["after_free"] == limit - c.context_bytes
    assert out["gpu_total"] == limit


def test_a_failed_driver_call_returns_its_reservation(container: MakeContainer) -> None:
    c = container(1024)
    done = c.python(
        r"""
# Invalid arguments the driver rejects after the interceptor reserved: nothing may stay charged.
bad = [d.cuMemAllocPitch(1024, 1024, 3)[0], d.cuMemAllocManaged(1 << 20, 12345)[0]]
free_now, total = ok(d.cuMemGetInfo())
print(json.dumps({"bad": [b.name for b in bad], "free": free_now, "total": total}))
"""
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert out == {"bad": ["CUDA_ERROR_INVALID_VALUE"] * 2, "free": c.limit_bytes - c.context_bytes,
                   "total": c.limit_bytes}  # fmt: skip


def test_frees_of_unknown_pointers_reach_the_driver(container: MakeContainer) -> None:
    c = container(1024)
    done = c.python(
        r"""
print(json.dumps([d.cuMemFree(0x1234)[0].name, d.cuMemFreeAsync(0x1234, 0)[0].name]))
"""
    )
    assert done.returncode == 0, done.stderr
    # The simulated driver's answers, not the interceptor's: the calls reached it.
    assert last_json(done.stdout) == ["CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_INVALID_VALUE"]


HOLD = r"""
import threading, time
held, lock = [], threading.Lock()
print("ready", flush=True)
# Start together: at the moment the test names, both processes already waiting for it (a "go" written to
# one and then the other lets the first fill the container before the second is scheduled on a busy machine).
time.sleep(max(0.0, float(sys.stdin.readline()) - time.time()))
def worker():
    ok(d.cuCtxSetCurrent(ctx))
    while True:
        r = d.cuMemAlloc(256 << 10)
        if r[0] != R.CUDA_SUCCESS:
            assert r[0] == R.CUDA_ERROR_OUT_OF_MEMORY, r
            return
        with lock:
            held.append(r[1])
threads = [threading.Thread(target=worker) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps({"held": len(held)}), flush=True)
sys.stdin.readline()
"""


def test_two_processes_racing_never_exceed_the_cap(container: MakeContainer) -> None:
    c = container(1024)
    procs = [c.popen(HOLD) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdin is not None
            assert p.stdout.readline().strip() == "ready", p.stderr.read() if p.stderr else ""
        start = time.time() + 0.3
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(f"{start}\n")
            p.stdin.flush()
        counts = []
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line, p.stderr.read() if p.stderr else ""
            counts.append(last_json(line)["held"])  # type: ignore[index]
        from simnode.gpusim_state import GpuSimState

        with GpuSimState(c.state_path) as st:
            phys = st.snapshot().used_bytes(0)
        # Both stopped only when the container was full (their two contexts included), and together they
        # never went past it.
        assert sum(counts) * 256 * 1024 == c.limit_bytes - 2 * c.context_bytes
        assert phys == c.limit_bytes
        assert all(n > 0 for n in counts)
    finally:
        for p in procs:
            p.communicate(input="\n", timeout=30)


def test_a_killed_process_gives_its_reservation_back(container: MakeContainer) -> None:
    c = container(1024)
    holder = c.popen(
        r"""
p = ok(d.cuMemAlloc(512 << 20))
print("ready", flush=True)
sys.stdin.readline()
"""
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ready"
        blocked = c.python("print(d.cuMemAlloc(512 << 20)[0].name)")
        assert blocked.stdout.strip() == "CUDA_ERROR_OUT_OF_MEMORY", blocked.stderr
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.communicate(timeout=30)
    after = c.python(
        r"""
p = ok(d.cuMemAlloc(512 << 20))
print(json.dumps({"info": list(ok(d.cuMemGetInfo())), "phys": phys_used()}))
"""
    )
    assert after.returncode == 0, after.stderr
    held = c.context_bytes + 512 * MIB
    assert last_json(after.stdout) == {"info": [c.limit_bytes - held, c.limit_bytes], "phys": held}


def test_every_context_is_charged_what_it_takes(container: MakeContainer) -> None:
    """A created context costs its measured size on top of the primary one, until it is destroyed."""
    c = container(1024)
    done = c.python(
        r"""
out = {"primary": list(ok(d.cuMemGetInfo()))}
other = ok(d.cuCtxCreate(0, dev))
out["two"] = [list(ok(d.cuMemGetInfo())), phys_used()]
ok(d.cuCtxDestroy(other)); ok(d.cuCtxSetCurrent(ctx))
out["one"] = list(ok(d.cuMemGetInfo()))
print(json.dumps(out))
"""
    )
    assert done.returncode == 0, done.stderr
    cap, ctx = c.limit_bytes, c.context_bytes
    assert last_json(done.stdout) == {"primary": [cap - ctx, cap], "two": [[cap - 2 * ctx, cap], 2 * ctx],
                                      "one": [cap - ctx, cap]}  # fmt: skip


def test_a_context_that_does_not_fit_is_refused(container: MakeContainer) -> None:
    """A 256 MiB container on a GPU whose contexts take 250 MiB: one process fits, a second one's context does not."""
    c = container(256)
    holder = c.popen('print("ready", flush=True); sys.stdin.readline()')
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ready"
        second = c.python(
            "import json\nfrom cuda.bindings import driver as d\nd.cuInit(0)\ndev = d.cuDeviceGet(0)[1]\n"
            "print(json.dumps([d.cuDevicePrimaryCtxRetain(dev)[0].name, d.cuCtxCreate(0, dev)[0].name]))",
            prelude=False,
        )
        from simnode.gpusim_state import GpuSimState

        with GpuSimState(c.state_path) as st:
            phys = st.snapshot().used_bytes(0)
    finally:
        holder.communicate(input="\n", timeout=30)
    assert second.returncode == 0, second.stderr
    assert last_json(second.stdout) == ["CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_OUT_OF_MEMORY"]
    assert phys == c.context_bytes  # the holder's context; the refused ones are gone


def test_forked_child_has_its_own_reservations(container: MakeContainer) -> None:
    c = container(1024)
    done = c.python(
        r"""
p = ok(d.cuMemAlloc(512 << 20))
pid = os.fork()
if pid == 0:
    # The child owns nothing of its parent's; freeing the parent's pointer returns nothing.
    d.cuMemFree(p)
    os._exit(0)
os.waitpid(pid, 0)
print(json.dumps(list(ok(d.cuMemGetInfo()))))
"""
    )
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout)[0] == c.limit_bytes - c.context_bytes - 512 * MIB  # type: ignore[index]


PEAK = r"""
from simnode.gpusim_state import GpuSimState
def peak():
    with GpuSimState(os.environ["GPUSIM_STATE"]) as st:
        return st.snapshot(1).gpus[0].used_peak
"""


@pytest.mark.parametrize("shape", ["2d", "3d", "mipmap", "layered"])
def test_arrays_are_reserved_at_their_footprint_before_the_driver_call(container: MakeContainer, shape: str) -> None:
    """A thin array's rows are padded: a 256 KiB description takes 32 MiB.  With 16 MiB left under the cap the
    driver must never be asked (the GPU would hold more than the cap, even for a moment)."""
    c = container(1024)
    make = {
        "2d": "desc = d.CUDA_ARRAY_DESCRIPTOR(); desc.Width, desc.Height = 1, 65536\n"
        "create = lambda: d.cuArrayCreate(desc)",
        "3d": "desc = d.CUDA_ARRAY3D_DESCRIPTOR(); desc.Width, desc.Height, desc.Depth = 1, 64, 1024\n"
        "create = lambda: d.cuArray3DCreate(desc)",
        "layered": "desc = d.CUDA_ARRAY3D_DESCRIPTOR(); desc.Width, desc.Height, desc.Depth = 1, 2048, 32\n"
        "desc.Flags = d.CUDA_ARRAY3D_LAYERED\ncreate = lambda: d.cuArray3DCreate(desc)",
        "mipmap": "desc = d.CUDA_ARRAY3D_DESCRIPTOR(); desc.Width, desc.Height, desc.Depth = 1, 43690, 0\n"
        "create = lambda: d.cuMipmappedArrayCreate(desc, 2)",
    }[shape]
    done = c.python(
        PEAK
        + make
        + r"""
desc.NumChannels, desc.Format = 1, d.CUarray_format.CU_AD_FORMAT_FLOAT
context = phys_used()
fill = ok(d.cuMemAlloc(ok(d.cuMemGetInfo())[0] - (16 << 20)))  # 16 MiB left under the cap
r = create()
out = {"rc": r[0].name, "peak": peak()}
ok(d.cuMemFree(fill))
h = ok(create())
is_mip = isinstance(h, d.CUmipmappedArray)
req = ok((d.cuMipmappedArrayGetMemoryRequirements if is_mip else d.cuArrayGetMemoryRequirements)(h, dev))
free_b, total = ok(d.cuMemGetInfo())
out.update(size=req.size, charged=total - free_b - context, phys=phys_used() - context)
ok((d.cuMipmappedArrayDestroy if is_mip else d.cuArrayDestroy)(h))
out["after"] = ok(d.cuMemGetInfo())[0]
print(json.dumps(out))
"""
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    assert out["rc"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert out["peak"] <= c.limit_bytes, f"the GPU held {out['peak'] >> 20} MiB for a {c.limit_bytes >> 20} MiB cap"
    assert out["size"] >= 31 * MIB  # the padded footprint, far above the description
    assert out["charged"] == out["size"] == out["phys"]
    assert out["after"] == c.limit_bytes - c.context_bytes


VMM = r"""
prop = d.CUmemAllocationProp()
prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 0
prop.requestedHandleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
def mapped(size):
    h = ok(d.cuMemCreate(size, prop, 0))
    va = ok(d.cuMemAddressReserve(size, 0, 0, 0))
    ok(d.cuMemMap(va, size, 0, h, 0))
    acc = d.CUmemAccessDesc()
    acc.location = prop.location
    acc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    ok(d.cuMemSetAccess(va, size, [acc], 1))
    return h, va
def try_alloc(size):
    r = d.cuMemAlloc(size)
    if r[0] == R.CUDA_SUCCESS:
        ok(d.cuMemFree(r[1]))
    return r[0].name
"""


def test_vmm_memory_stays_charged_while_mapped(container: MakeContainer) -> None:
    """cuda.h: cuMemRelease right after cuMemMap is the usual pattern; the memory goes with the last unmap."""
    c = container(1024)
    done = c.python(
        PEAK
        + VMM
        + r"""
h, va = mapped(512 << 20)
ok(d.cuMemRelease(h))
out = {"released_mapped": try_alloc(768 << 20), "phys1": phys_used()}
h2 = ok(d.cuMemRetainAllocationHandle(va))
out["same_handle"] = int(h2) == int(h)
ok(d.cuMemRelease(h2))
out["retained_released"] = try_alloc(768 << 20)
ok(d.cuMemUnmap(va, 512 << 20)); ok(d.cuMemAddressFree(va, 512 << 20))
out["unmapped"] = try_alloc(768 << 20)
# Two mappings of one allocation: it goes with the second unmap, not the first.
h, va = mapped(256 << 20)
va2 = ok(d.cuMemAddressReserve(256 << 20, 0, 0, 0))
ok(d.cuMemMap(va2, 256 << 20, 0, h, 0))
ok(d.cuMemRelease(h)); ok(d.cuMemUnmap(va, 256 << 20))
out["one_left"] = list(ok(d.cuMemGetInfo()))
ok(d.cuMemUnmap(va2, 256 << 20))
out["none_left"] = list(ok(d.cuMemGetInfo()))
out.update(peak=peak(), phys=phys_used())
print(json.dumps(out))
"""
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    cap = c.limit_bytes
    ctx = c.context_bytes
    assert out["released_mapped"] == "CUDA_ERROR_OUT_OF_MEMORY", "released but still mapped: must stay charged"
    assert out["phys1"] == ctx + 512 * MIB
    assert out["same_handle"] is True
    assert out["retained_released"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert out["unmapped"] == "CUDA_SUCCESS"
    assert out["one_left"] == [cap - ctx - 256 * MIB, cap]
    assert out["none_left"] == [cap - ctx, cap]
    assert out["peak"] <= cap and out["phys"] == ctx


def test_imported_shareable_memory_is_the_exporters(container: MakeContainer) -> None:
    """cuMemExportToShareableHandle -> another container imports it: not charged there, and nothing credited."""
    exporter, importer = container(1024), container(512)
    done = exporter.python(
        VMM
        + r"""
import subprocess
h, va = mapped(512 << 20)
fd = ok(d.cuMemExportToShareableHandle(h, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0))
child = subprocess.run([sys.executable, "-c", os.environ["IMPORTER"], str(fd)], env=json.loads(os.environ["ENV_B"]),
                       pass_fds=[fd], capture_output=True, text=True, timeout=60)
assert child.returncode == 0, child.stderr
print(json.dumps({"importer": json.loads(child.stdout.splitlines()[-1]), "exporter": list(ok(d.cuMemGetInfo()))}))
""",
        env=exporter.env(
            ENV_B=json.dumps(importer.env()),
            IMPORTER=PRELUDE
            + VMM
            + r"""
fd = int(sys.argv[1])
h = ok(d.cuMemImportFromShareableHandle(fd, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
va = ok(d.cuMemAddressReserve(512 << 20, 0, 0, 0))
ok(d.cuMemMap(va, 512 << 20, 0, h, 0))
out = {"mapped": list(ok(d.cuMemGetInfo()))}
full = ok(d.cuMemAlloc(ok(d.cuMemGetInfo())[0]))  # all this container has left
ok(d.cuMemUnmap(va, 512 << 20)); ok(d.cuMemRelease(h))
out["after_release"] = [try_alloc(1 << 20), list(ok(d.cuMemGetInfo()))]
print(json.dumps(out))
""",
        ),
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    ctx = exporter.context_bytes
    assert out["importer"]["mapped"] == [512 * MIB - ctx, 512 * MIB]  # nothing charged to the importer
    assert out["importer"]["after_release"] == ["CUDA_ERROR_OUT_OF_MEMORY", [0, 512 * MIB]]  # nothing credited
    assert out["exporter"] == [512 * MIB - ctx, 1024 * MIB]


GRAPH = r"""
s = ok(d.cuStreamCreate(0))
def alloc_node(graph, size):
    p = d.CUDA_MEM_ALLOC_NODE_PARAMS()
    p.poolProps.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.poolProps.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.poolProps.location.id = 0
    p.bytesize = size
    node = ok(d.cuGraphAddMemAllocNode(graph, None, 0, p))
    return node, int(p.dptr)
def try_alloc(size):
    r = d.cuMemAlloc(size)
    if r[0] == R.CUDA_SUCCESS:
        ok(d.cuMemFree(r[1]))
    return r[0].name
"""


def test_graph_memory_is_the_execs_and_outlives_the_graph(container: MakeContainer) -> None:
    """cuda.h: destroying a graph frees nothing; the exec holds the memory; a launch without a free node leaves
    it live until cuMemFree."""
    c = container(1024)
    done = c.python(
        PEAK
        + GRAPH
        + r"""
graph = ok(d.cuGraphCreate(0))
node, dptr = alloc_node(graph, 512 << 20)
x = ok(d.cuGraphInstantiate(graph, 0))
ok(d.cuGraphDestroy(graph))
out = {"graph_destroyed": try_alloc(768 << 20)}
ok(d.cuGraphLaunch(x, s)); ok(d.cuStreamSynchronize(s))
ok(d.cuGraphExecDestroy(x))
out["launched_not_freed"] = try_alloc(768 << 20)
ok(d.cuMemFreeAsync(dptr, s)); ok(d.cuStreamSynchronize(s))
out["freed_kept"] = try_alloc(768 << 20)  # back in the device's graph pool, which keeps it
ok(d.cuDeviceGraphMemTrim(dev))
out["freed"] = try_alloc(768 << 20)
# Freed in its own graph: each launch gives it back; the exec holds it until destroyed.
graph = ok(d.cuGraphCreate(0))
node, dptr = alloc_node(graph, 512 << 20)
ok(d.cuGraphAddMemFreeNode(graph, [node], 1, dptr))
x = ok(d.cuGraphInstantiate(graph, 0))
ok(d.cuGraphLaunch(x, s)); ok(d.cuStreamSynchronize(s))
out["exec_alive"] = try_alloc(768 << 20)
ok(d.cuGraphExecDestroy(x)); ok(d.cuGraphDestroy(graph))
out["pool_kept"] = try_alloc(768 << 20)
ok(d.cuDeviceGraphMemTrim(dev))
out["all_gone"] = [try_alloc(768 << 20), list(ok(d.cuMemGetInfo()))]
out.update(peak=peak(), phys=phys_used())
print(json.dumps(out))
"""
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    oom = "CUDA_ERROR_OUT_OF_MEMORY"
    assert out["graph_destroyed"] == oom, "the exec still holds the graph's memory"
    assert out["launched_not_freed"] == oom, "the launch left the allocation live"
    assert out["freed_kept"] == oom, "the graph pool keeps freed memory until trimmed"
    assert out["freed"] == "CUDA_SUCCESS"
    assert out["exec_alive"] == oom
    assert out["pool_kept"] == oom
    assert out["all_gone"] == ["CUDA_SUCCESS", [c.limit_bytes - c.context_bytes, c.limit_bytes]]
    assert out["peak"] <= c.limit_bytes and out["phys"] == c.context_bytes


def test_allocations_captured_into_a_graph_follow_the_graph(container: MakeContainer) -> None:
    """cuMemAllocAsync/cuMemFreeAsync in a stream capture become the graph's memory nodes."""
    c = container(1024)
    done = c.python(
        PEAK
        + GRAPH
        + r"""
mod = ok(d.cuModuleLoadData(b"x"))
fn = ok(d.cuModuleGetFunction(mod, b"spin_1ms"))
ok(d.cuStreamBeginCapture(s, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
dptr = ok(d.cuMemAllocAsync(512 << 20, s))
ok(d.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s, 0, 0))
ok(d.cuMemFreeAsync(dptr, s))
graph = ok(d.cuStreamEndCapture(s))
out = {"captured": try_alloc(768 << 20)}
x = ok(d.cuGraphInstantiate(graph, 0))
ok(d.cuGraphDestroy(graph))
out["instantiated"] = try_alloc(768 << 20)
ok(d.cuGraphLaunch(x, s)); ok(d.cuStreamSynchronize(s))
out["launched"] = try_alloc(768 << 20)
ok(d.cuGraphExecDestroy(x))
out["exec_gone"] = try_alloc(768 << 20)  # the device's graph pool keeps it
ok(d.cuDeviceGraphMemTrim(dev))
out["trimmed"] = try_alloc(768 << 20)
out.update(peak=peak(), phys=phys_used(), info=list(ok(d.cuMemGetInfo())))
print(json.dumps(out))
"""
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    oom = "CUDA_ERROR_OUT_OF_MEMORY"
    assert [out["captured"], out["instantiated"], out["launched"], out["exec_gone"]] == [oom] * 4
    assert out["trimmed"] == "CUDA_SUCCESS"
    module = 2 * MIB  # the loaded module's memory: no hook sees it, NVML does (reconciled)
    assert out["peak"] <= c.limit_bytes and out["phys"] == c.context_bytes + module
    assert out["info"] == [c.limit_bytes - c.context_bytes - module, c.limit_bytes]


def test_memory_freed_with_its_context_comes_back(container: MakeContainer) -> None:
    """cuda.h: cuCtxDestroy (and cuDevicePrimaryCtxReset) free everything allocated in the context."""
    c = container(1024)
    done = c.python(
        GRAPH
        + r"""
other = ok(d.cuCtxCreate(0, dev))
p = ok(d.cuMemAlloc(256 << 20))
desc = d.CUDA_ARRAY_DESCRIPTOR()
desc.Width, desc.Height, desc.NumChannels, desc.Format = 4096, 4096, 1, d.CUarray_format.CU_AD_FORMAT_FLOAT
arr = ok(d.cuArrayCreate(desc))
ok(d.cuCtxDestroy(other))
ok(d.cuCtxSetCurrent(ctx))
out = {"ctx_destroyed": [try_alloc(750 << 20), phys_used()]}
p = ok(d.cuMemAlloc(512 << 20))
ok(d.cuDevicePrimaryCtxReset(dev))
ctx = ok(d.cuDevicePrimaryCtxRetain(dev))
ok(d.cuCtxSetCurrent(ctx))
out["primary_reset"] = [try_alloc(750 << 20), phys_used(), list(ok(d.cuMemGetInfo()))]
print(json.dumps(out))
"""
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    ctx = c.context_bytes  # the primary context's own memory stays
    assert out["ctx_destroyed"] == ["CUDA_SUCCESS", ctx]
    assert out["primary_reset"] == ["CUDA_SUCCESS", ctx, [c.limit_bytes - ctx, c.limit_bytes]]


def test_ipc_memory_is_the_exporters(container: MakeContainer) -> None:
    """cuIpcOpenMemHandle in another container: not charged there, and closing it credits no one."""
    exporter, importer = container(1024), container(512)
    done = exporter.python(
        GRAPH
        + r"""
import subprocess
p = ok(d.cuMemAlloc(512 << 20))
handle = ctypes.string_at(ok(d.cuIpcGetMemHandle(p)).getPtr(), 64)  # CUipcMemHandle: 64 opaque bytes
child = subprocess.run([sys.executable, "-c", os.environ["IMPORTER"], handle.hex()],
                       env=json.loads(os.environ["ENV_B"]), capture_output=True, text=True, timeout=60)
assert child.returncode == 0, child.stderr
print(json.dumps({"importer": json.loads(child.stdout.splitlines()[-1]), "exporter": list(ok(d.cuMemGetInfo())),
                  "phys": phys_used()}))
""",
        env=exporter.env(
            ENV_B=json.dumps(importer.env()),
            IMPORTER=PRELUDE
            + GRAPH
            + r"""
h = d.CUipcMemHandle()
ctypes.memmove(h.getPtr(), bytes.fromhex(sys.argv[1]), 64)
flags = d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
ptr = ok(d.cuIpcOpenMemHandle(h, flags))
again = ok(d.cuIpcOpenMemHandle(h, flags))
out = {"same_ptr": int(again) == int(ptr), "opened": list(ok(d.cuMemGetInfo()))}
full = ok(d.cuMemAlloc(ok(d.cuMemGetInfo())[0]))  # all this container has left
ok(d.cuIpcCloseMemHandle(ptr)); ok(d.cuIpcCloseMemHandle(ptr))
out["closed"] = [try_alloc(1 << 20), list(ok(d.cuMemGetInfo())), d.cuIpcCloseMemHandle(ptr)[0].name]
print(json.dumps(out))
""",
        ),
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    assert out["importer"]["same_ptr"] is True
    ctx = exporter.context_bytes
    assert out["importer"]["opened"] == [512 * MIB - ctx, 512 * MIB]
    assert out["importer"]["closed"] == ["CUDA_ERROR_OUT_OF_MEMORY", [0, 512 * MIB], "CUDA_ERROR_INVALID_VALUE"]
    assert out["exporter"] == [512 * MIB - ctx, 1024 * MIB]
    assert out["phys"] == ctx + 512 * MIB  # the exporter's (the importer has exited)


FOOTPRINT_PROC = r"""
import json, sys
from cuda.bindings import driver as d
R = d.CUresult
print("ready", flush=True)
sys.stdin.readline()  # start together
assert d.cuInit(0)[0] == R.CUDA_SUCCESS
dev = d.cuDeviceGet(0)[1]
rc, ctx = d.cuDevicePrimaryCtxRetain(dev)
chunks = 0
if rc == R.CUDA_SUCCESS:
    d.cuCtxSetCurrent(ctx)
    while d.cuMemAlloc(64 << 20)[0] == R.CUDA_SUCCESS:
        chunks += 1
print(json.dumps({"context": rc.name, "chunks": chunks}), flush=True)
sys.stdin.readline()
"""


def test_four_processes_hold_the_cap_with_their_contexts(container: MakeContainer) -> None:
    """What the GPU holds for the container's processes, contexts included, never exceeds its cap."""
    import subprocess
    import sys

    from simnode.gpusim_state import GpuSimState, repo_root

    c = container(1024)
    procs = [
        subprocess.Popen([sys.executable, "-c", FOOTPRINT_PROC], env=c.env(), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=repo_root())
        for _ in range(4)
    ]  # fmt: skip
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        start = time.time() + 0.3
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(f"{start}\n")
            p.stdin.flush()
        results = []
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line, p.stderr.read() if p.stderr else ""
            results.append(json.loads(line))
        with GpuSimState(c.state_path) as st:
            snap = st.snapshot(1)
    finally:
        for p in procs:
            p.communicate(input="\n", timeout=30)
    pids = {p.pid for p in procs}
    held = sum(e.used_bytes for e in snap.processes if e.pid in pids)
    contexts = sum(r["context"] == "CUDA_SUCCESS" for r in results)
    assert held <= c.limit_bytes, f"the container's processes held {held >> 20} MiB on a 1024 MiB cap: {results}"
    assert snap.gpus[0].used_peak <= c.limit_bytes
    assert contexts >= 1 and held == contexts * c.context_bytes + 64 * MIB * sum(r["chunks"] for r in results)
    assert held + 64 * MIB > c.limit_bytes or contexts < 4  # full: nothing more fitted


def test_memory_no_hook_sees_is_reconciled(container: MakeContainer) -> None:
    """A pool that keeps freed memory, module code: NVML shows it for the process; the cap counts it."""
    c = container(1024)
    done = c.python(
        PEAK
        + GRAPH
        + r"""
import time, pynvml
A = d.CUmemPool_attribute
pool = ok(d.cuDeviceGetDefaultMemPool(dev))
ok(d.cuMemPoolSetAttribute(pool, A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, d.cuuint64_t(1 << 62)))
p = ok(d.cuMemAllocAsync(600 << 20, s)); ok(d.cuMemFreeAsync(p, s)); ok(d.cuStreamSynchronize(s))
out = {"pool_kept": phys_used(), "beyond_pool": try_alloc(300 << 20)}
ok(d.cuMemPoolTrimTo(pool, 0))
out["trimmed"] = try_alloc(300 << 20)
mods = [ok(d.cuModuleLoadData(b"x")) for _ in range(100)]  # 200 MiB of module code
time.sleep(0.15)  # memory views reconcile at most every 100 ms
free_b, total = ok(d.cuMemGetInfo())
pynvml.nvmlInit()
m = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
out["views"] = [total - free_b, m.used, phys_used()]
chunks = []
while True:
    r = d.cuMemAlloc(16 << 20)
    if r[0] != R.CUDA_SUCCESS:
        break
    chunks.append(r[1])
out.update(full=phys_used(), peak=peak())
print(json.dumps(out))
"""
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    cap, ctx = c.limit_bytes, c.context_bytes
    assert out["pool_kept"] == ctx + 600 * MIB
    assert out["beyond_pool"] == "CUDA_ERROR_OUT_OF_MEMORY", "the pool still holds 600 MiB"
    assert out["trimmed"] == "CUDA_SUCCESS"
    assert out["views"] == [ctx + 200 * MIB] * 3  # cuMemGetInfo and NVML inside show what the GPU holds
    assert out["full"] <= cap and out["full"] + 16 * MIB > cap
    assert out["peak"] <= cap


def test_a_device_nvml_cannot_tell_about_keeps_the_reconciled_memory(container: MakeContainer) -> None:
    """Memory no hook sees on GPU 1 is reconciled into the budget; when GPU 1's process list then fails (a lost GPU),
    the reconciliation cannot tell the container's footprint and keeps it, instead of lowering it to the sum of the
    other GPUs."""
    c = container(1024, spec="v100-pcie-x4")
    done = c.python(
        r"""
import time
from simnode.gpusim_state import GpuSimState
def used():
    time.sleep(0.15)  # memory views reconcile at most every 100 ms
    free_b, total = ok(d.cuMemGetInfo())
    return total - free_b
with GpuSimState(os.environ["GPUSIM_STATE"]) as st:
    before = used()
    st.set_process(1, os.getpid(), 300 << 20)  # e.g. a library's workspace: NVML shows it, no hook charged it
    seen = used()
    st.set_lost(1)
    try:
        lost = used()
    finally:
        st.set_lost(1, False)
        st.remove_process(os.getpid(), 1)
print(json.dumps({"before": before, "seen": seen, "lost": lost}))
"""
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    assert out["seen"] == out["before"] + 300 * MIB, out
    assert out["lost"] == out["seen"], out


GREEN = r"""
SM = d.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
DEFAULT_STREAM = d.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
def green_desc():
    res = ok(d.cuDeviceGetDevResource(dev, SM))
    return ok(d.cuDevResourceGenerateDesc([res], 1))
"""


def green_run(c: Container, body: str) -> dict[str, Any]:
    """Run ``body`` (with the green-context helpers above) in a process of container ``c``; its last JSON line."""
    done = c.python(GREEN + body)
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    return out


def test_green_contexts_are_charged_like_contexts(container: MakeContainer) -> None:
    """cuGreenCtxCreate costs a context's memory: a 1536 MiB container on an H100 (500 MiB contexts) holds its
    primary context and two green ones, never more; cuGreenCtxDestroy gives each back."""
    c = container(1536, spec="h100-nvlink-x8")
    out = green_run(
        c,
        r"""
desc = green_desc()
greens, rcs, peak = [], [], 0
for _ in range(6):
    rc, g = d.cuGreenCtxCreate(desc, dev, DEFAULT_STREAM)
    rcs.append(rc.name)
    peak = max(peak, phys_used())
    if rc == R.CUDA_SUCCESS:
        greens.append(g)
out = {"rcs": rcs, "peak": peak, "held": [list(ok(d.cuMemGetInfo())), phys_used()]}
for g in greens:
    ok(d.cuGreenCtxDestroy(g))
out["destroyed"] = [list(ok(d.cuMemGetInfo())), phys_used()]
print(json.dumps(out))
""",
    )
    cap, ctx = c.limit_bytes, c.context_bytes
    assert out["rcs"] == ["CUDA_SUCCESS"] * 2 + ["CUDA_ERROR_OUT_OF_MEMORY"] * 4
    assert out["peak"] <= cap
    assert out["held"] == [[cap - 3 * ctx, cap], 3 * ctx]
    assert out["destroyed"] == [[cap - ctx, cap], ctx]


def test_a_green_context_brings_its_primary_context_and_shares_its_memory(container: MakeContainer) -> None:
    """cuda.h: a green context retains the primary context (charged when that brings it alive) and releases it
    when destroyed; what was allocated in the green context is the primary context's: charged until freed, or
    until the primary context goes with the green context's reference."""
    c = container(2048, spec="h100-nvlink-x8")
    out = green_run(
        c,
        r"""
ok(d.cuCtxSetCurrent(None)); ok(d.cuDevicePrimaryCtxRelease(dev))  # no context at all
out = {"none": [phys_used()]}
g = ok(d.cuGreenCtxCreate(green_desc(), dev, DEFAULT_STREAM))
out["green"] = [phys_used(), ok(d.cuDevicePrimaryCtxGetState(dev))[1]]
gctx = ok(d.cuCtxFromGreenCtx(g))
ok(d.cuCtxSetCurrent(gctx))
out["alloc"] = d.cuMemAlloc(1100 << 20)[0].name  # 1000 MiB of contexts + 1100 > 2048
p = ok(d.cuMemAlloc(512 << 20))
out["allocated"] = [list(ok(d.cuMemGetInfo())), phys_used()]
ok(d.cuGreenCtxDestroy(g))
out["destroyed"] = [phys_used(), ok(d.cuDevicePrimaryCtxGetState(dev))[1]]
ctx = ok(d.cuDevicePrimaryCtxRetain(dev)); ok(d.cuCtxSetCurrent(ctx))
out["retained"] = [list(ok(d.cuMemGetInfo())), phys_used()]
print(json.dumps(out))
""",
    )
    cap, ctx = c.limit_bytes, c.context_bytes
    assert out["none"] == [0]
    assert out["green"] == [2 * ctx, 1]  # its own context and the primary one
    assert out["alloc"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert out["allocated"] == [[cap - 2 * ctx - 512 * MIB, cap], 2 * ctx + 512 * MIB]
    # The green context held the last reference: the primary context went, with what was allocated in the green one.
    assert out["destroyed"] == [0, 0]
    assert out["retained"] == [[cap - ctx, cap], ctx]


def test_green_context_memory_outlives_it_with_the_primary_context(container: MakeContainer) -> None:
    """Memory allocated in a green context stays charged while the primary context lives, until freed."""
    c = container(2048, spec="h100-nvlink-x8")
    out = green_run(
        c,
        r"""
g = ok(d.cuGreenCtxCreate(green_desc(), dev, DEFAULT_STREAM))
ok(d.cuCtxSetCurrent(ok(d.cuCtxFromGreenCtx(g))))
p = ok(d.cuMemAlloc(512 << 20))
ok(d.cuGreenCtxDestroy(g))
ok(d.cuCtxSetCurrent(ctx))
out = {"kept": [list(ok(d.cuMemGetInfo())), phys_used()]}
ok(d.cuMemFree(p))
out["freed"] = [list(ok(d.cuMemGetInfo())), phys_used()]
print(json.dumps(out))
""",
    )
    cap, ctx = c.limit_bytes, c.context_bytes
    assert out["kept"] == [[cap - ctx - 512 * MIB, cap], ctx + 512 * MIB]
    assert out["freed"] == [[cap - ctx, cap], ctx]


def test_a_green_context_destroyed_after_its_primary_was_released_gives_its_memory_back(
    container: MakeContainer,
) -> None:
    """A green context retains the primary context; released from under it (cuDevicePrimaryCtxRelease once too
    often), the primary goes, and destroying the green contexts then frees them all the same: their charge goes
    with them instead of staying for the process's life (500 MiB of the cap each)."""
    c = container(1536, spec="h100-nvlink-x8")
    out = green_run(
        c,
        r"""
greens = [ok(d.cuGreenCtxCreate(green_desc(), dev, DEFAULT_STREAM)) for _ in range(2)]
for _ in range(3):
    d.cuDevicePrimaryCtxRelease(dev)
rcs = [d.cuGreenCtxDestroy(g)[0].name for g in greens]
ctx = ok(d.cuDevicePrimaryCtxRetain(dev))
ok(d.cuCtxSetCurrent(ctx))
print(json.dumps({"rcs": rcs, "after": [list(ok(d.cuMemGetInfo())), phys_used()]}))
""",
    )
    cap, ctx = c.limit_bytes, c.context_bytes
    assert out["rcs"] == ["CUDA_SUCCESS"] * 2, out
    assert out["after"] == [[cap - ctx, cap], ctx], out
