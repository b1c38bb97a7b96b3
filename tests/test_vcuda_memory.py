"""The interceptor's memory cap, driven by cuda-bindings through every allocation path.

Each program allocates until the driver says no.  The cap must stop it at the allocation that
would cross the container's limit, with CUDA_ERROR_OUT_OF_MEMORY, while the simulated GPU (whose
own memory is far larger) still has room; after everything is freed, nothing stays charged,
neither in the container's budget nor on the simulated GPU.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from tests.vcuda_fixtures import MIB, Container, container, last_json, vcuda_built

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
graph = ok(d.cuGraphCreate(0))
def alloc():
    p = d.CUDA_MEM_ALLOC_NODE_PARAMS()
    p.poolProps.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.poolProps.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.poolProps.location.id = 0
    p.bytesize = 64 << 20
    r = d.cuGraphAddMemAllocNode(graph, None, 0, p); return r[0], r[1]
def free(h): ok(d.cuGraphDestroyNode(h))
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
after_free, after_total = ok(d.cuMemGetInfo())
print(json.dumps({
    "rc": rc.name, "count": len(handles), "sizes": sorted({s for _h, s in handles}),
    "full_phys": full_phys, "full_free": full_free, "total": full_total,
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
    # The cap held, and it was the cap (not the 15 GiB GPU) that said no: one more chunk would cross it.
    assert out["full_phys"] <= limit
    assert out["full_phys"] + chunk > limit
    assert out["total"] == limit
    assert out["full_free"] == limit - out["full_phys"]
    # Nothing leaks: the GPU and the container's budget are empty again.
    assert out["after_phys"] == 0
    assert out["after_free"] == limit
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
    assert out == {"bad": ["CUDA_ERROR_INVALID_VALUE"] * 2, "free": c.limit_bytes, "total": c.limit_bytes}


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
import threading
held, lock = [], threading.Lock()
print("ready", flush=True)
sys.stdin.readline()  # start together
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
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
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
        # Both stopped only when the container was full, and together they never went past it.
        assert sum(counts) * 256 * 1024 == c.limit_bytes
        assert phys == c.limit_bytes
        assert all(n > 0 for n in counts)
    finally:
        for p in procs:
            p.communicate(input="\n", timeout=30)


def test_a_killed_process_gives_its_reservation_back(container: MakeContainer) -> None:
    c = container(1024)
    holder = c.popen(
        r"""
p = ok(d.cuMemAlloc(768 << 20))
print("ready", flush=True)
sys.stdin.readline()
"""
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ready"
        blocked = c.python("print(d.cuMemAlloc(512 << 20)[0].name)")
        assert blocked.stdout.strip() == "CUDA_ERROR_OUT_OF_MEMORY"
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.communicate(timeout=30)
    after = c.python(
        r"""
p = ok(d.cuMemAlloc(768 << 20))
print(json.dumps({"info": list(ok(d.cuMemGetInfo())), "phys": phys_used()}))
"""
    )
    assert after.returncode == 0, after.stderr
    assert last_json(after.stdout) == {"info": [256 * MIB, c.limit_bytes], "phys": 768 * MIB}


def test_context_reserve_is_charged_once_per_process(container: MakeContainer) -> None:
    c = container(1024)
    done = c.python(
        r"""
other = ok(d.cuCtxCreate(0, dev))
print(json.dumps(list(ok(d.cuMemGetInfo()))))
""",
        env=c.env(VCUDA_CONTEXT_RESERVE="256M"),
    )
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout) == [768 * MIB, c.limit_bytes]


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
    assert last_json(done.stdout)[0] == 512 * MIB  # type: ignore[index]
