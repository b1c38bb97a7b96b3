"""A hostile tenant of a 1 GiB container against the interceptor: each test holds, or tries to hold, more
device memory than the cap (the simulated GPU's own accounting is the judge), or to break the shared budget.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.vcuda_fixtures import Container, container, last_json, vcuda_built

__all__ = ["container", "vcuda_built"]  # fixtures

MakeContainer = Callable[..., Container]

HELPERS = r"""
from simnode.gpusim_state import GpuSimState
def peak():
    with GpuSimState(os.environ["GPUSIM_STATE"]) as st:
        return st.snapshot(1).gpus[0].used_peak
MIB = 1 << 20
A = d.CUmemPool_attribute
def new_pool():
    props = d.CUmemPoolProps()
    props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    props.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    props.location.id = 0
    pool = ok(d.cuMemPoolCreate(props))
    ok(d.cuMemPoolSetAttribute(pool, A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, d.cuuint64_t(1 << 62)))
    return pool
"""


def run(c: Container, code: str, **env: str | None) -> dict[str, object]:
    done = c.python(HELPERS + code, env=c.env(**env) if env else None)
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    return out


def test_destroyed_pool_stays_charged_for_what_it_still_holds(container: MakeContainer) -> None:
    """A destroyed pool with an allocation outstanding keeps its whole segment (a freed hole before the live
    allocation cannot be given back) until that allocation is freed: it must stay charged for all of it, not
    only for the outstanding bytes, or the container allocates that hole a second time."""
    c = container(1024)
    out = run(
        c,
        r"""
stream = ok(d.cuStreamCreate(0))
outstanding = []
for _ in range(2):
    pool = new_pool()
    x = ok(d.cuMemAllocFromPoolAsync(250 * MIB, pool, stream))
    ok(d.cuMemFreeAsync(x, stream))
    y = ok(d.cuMemAllocFromPoolAsync(248 * MIB, pool, stream))  # the hole, at the segment's start
    outstanding.append(ok(d.cuMemAllocFromPoolAsync(2 * MIB, pool, stream)))  # live, at its end
    ok(d.cuMemFreeAsync(y, stream))
    ok(d.cuStreamSynchronize(stream))
    ok(d.cuMemPoolDestroy(pool))
first = d.cuMemAlloc(500 * MIB)
held = peak()
if first[0] == R.CUDA_SUCCESS:
    ok(d.cuMemFree(first[1]))
for w in outstanding:
    ok(d.cuMemFreeAsync(w, stream))
ok(d.cuStreamSynchronize(stream))
after = d.cuMemAlloc(500 * MIB)  # the pools' memory came back with their last allocations
print(json.dumps({"peak": held, "first": first[0].name, "after": after[0].name}))
""",
    )
    assert out["peak"] <= c.limit_bytes, out
    assert out["first"] == "CUDA_ERROR_OUT_OF_MEMORY", out
    assert out["after"] == "CUDA_SUCCESS", out


def test_launches_on_a_stream_whose_capture_was_invalidated_are_gated(container: MakeContainer) -> None:
    """A capture invalidated by a synchronising call records nothing any more: launches on that stream run
    on the GPU.  They must be gated like any other launch (only an active capture merely records)."""
    c = container(1024, cores=30)
    out = run(
        c,
        r"""
import time
cu = ctypes.CDLL("libcuda.so.1")
mod, fn, s = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
assert cu.cuModuleLoadData(ctypes.byref(mod), b"fatbin") == 0
assert cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"spin_5ms") == 0
assert cu.cuStreamCreate(ctypes.byref(s), 0) == 0
assert cu.cuStreamBeginCapture_v2(s, 2) == 0  # relaxed
assert cu.cuStreamQuery(s) != 0  # not allowed while capturing: the capture is invalidated
status = ctypes.c_int()
assert cu.cuStreamIsCapturing(s, ctypes.byref(status)) == 0
def launch():
    rc = cu.cuLaunchKernel(fn, 1, 1, 1, 128, 1, 1, 0, s, None, None)
    assert rc == 0, rc
def timeline():
    with GpuSimState(os.environ["GPUSIM_STATE"]) as st:
        return st.timeline(0)
end = time.monotonic() + 0.5
while time.monotonic() < end:
    launch()
t0 = timeline()
end = time.monotonic() + 1.5
while time.monotonic() < end:
    launch()
t1 = timeline()
pid = os.getpid()
share = 100.0 * (t1.busy_of({pid}) - t0.busy_of({pid})) / (t1.now_ns - t0.now_ns)
print(json.dumps({"status": status.value, "share": share}))
""",
    )
    assert out["status"] == 2, out  # CU_STREAM_CAPTURE_STATUS_INVALIDATED
    assert out["share"] < 50, out


def test_a_context_made_while_another_thread_frees_is_charged_its_size(container: MakeContainer) -> None:
    """A context is measured as this process's NVML memory after its creation minus before: what another
    thread frees meanwhile came off the measurement, so the context was charged nothing (and the container
    learned a size of 0 for later ones) while the GPU held it.  The process lists are slowed down (a test knob
    of the simulated NVML) so that the free falls between them."""
    c = container(1024)
    out = run(
        c,
        r"""
import threading, time
cu = ctypes.CDLL("libcuda.so.1")
def alloc(n):
    p = ctypes.c_uint64()
    return cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)), p.value
made = []
def create():
    c = ctypes.c_void_p()
    made.append(cu.cuCtxCreate_v2(ctypes.byref(c), 0, 0))
for _ in range(2):
    rc, x = alloc(250 * MIB)
    assert rc == 0, rc
    t = threading.Thread(target=create)
    t.start()
    time.sleep(0.05)  # the thread is inside cuCtxCreate, between the two process lists
    assert cu.cuMemFree_v2(ctypes.c_uint64(x)) == 0
    t.join()
rc, _ = alloc(500 * MIB)
print(json.dumps({"made": made, "peak": peak()}))
""",
        GPUSIM_PROCS_RETURN_DELAY_US="100000",
    )
    assert out["made"] == [0, 0], out
    assert out["peak"] <= c.limit_bytes, out


PTX = r"""
def ptx(name):
    body = [".version 7.0", ".target sm_75", ".address_size 64", "", f".visible .entry {name}()" + " { ret; }"]
    return ("\n".join(body) + "\n").encode() + b"\0"
"""


def test_libraries_loaded_lazily_into_a_context_count_against_the_cap(container: MakeContainer) -> None:
    """A library is loaded into a context when something there first asks for it (cuLibraryGetModule,
    cuLibraryGetKernel and the rest): many libraries, loaded cheaply and then all asked for, put their code on
    the GPU with no allocation hook seeing it."""
    c = container(1024)
    out = run(
        c,
        PTX
        + r"""
libs = []
for i in range(500):
    r = d.cuLibraryLoadData(ptx(f"k{i}"), None, None, 0, None, None, 0)
    if r[0] != R.CUDA_SUCCESS:
        break
    libs.append(r[1])
asked = []
for lib in libs:
    asked.append(d.cuLibraryGetModule(lib)[0].name)
held = peak()
for lib in libs:
    ok(d.cuLibraryUnload(lib))
after = d.cuMemAlloc(700 * MIB)[0].name  # their code went with them
print(json.dumps({"loaded": len(libs), "peak": held, "refused": asked.count("CUDA_ERROR_OUT_OF_MEMORY"),
                  "after": after}))
""",
    )
    assert out["peak"] <= c.limit_bytes, out
    assert out["refused"] > 0, out
    assert out["after"] == "CUDA_SUCCESS", out


def test_a_library_file_swapped_while_it_loads_is_charged_what_the_driver_loaded(
    container: MakeContainer, tmp_path: Path
) -> None:
    """cuLibraryLoadFromFile: the file was read for the estimate, then read again by the driver.  A file swapped
    in between (a symlink switched by another thread) was charged as a small library while the driver loaded a
    large variable; the library's variables go into a context only when asked for, unseen."""
    c = container(1024)
    small, big, link = tmp_path / "small.ptx", tmp_path / "big.ptx", tmp_path / "lib.ptx"
    head = ".version 7.0\n.target sm_75\n.address_size 64\n\n"
    small.write_text(head + ".visible .entry k() { ret; }\n")
    big.write_text(head + ".visible .global .align 8 .b8 big[419430400];\n.visible .entry k() { ret; }\n")
    link.symlink_to(small)
    out = run(
        c,
        f"""
import threading
SMALL, BIG, LINK = {str(small)!r}, {str(big)!r}, {str(link)!r}
"""
        + r"""
cu = ctypes.CDLL("libcuda.so.1")
stop = False
def swap():
    i = 0
    while not stop:
        i += 1
        tmp = LINK + ".tmp"
        os.symlink(BIG if i % 2 else SMALL, tmp)
        os.replace(tmp, LINK)
t = threading.Thread(target=swap)
t.start()
def used():
    f, total = ctypes.c_size_t(), ctypes.c_size_t()
    assert cu.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(total)) == 0
    return total.value - f.value
kept, attempts = [], 0
while len(kept) < 3 and attempts < 5000:
    attempts += 1
    before = used()
    lib = ctypes.c_void_p()
    if cu.cuLibraryLoadFromFile(ctypes.byref(lib), LINK.encode(), None, None, 0, None, None, 0) != 0:
        continue
    charged = used() - before
    dptr, size = ctypes.c_uint64(), ctypes.c_size_t()
    if charged < 100 * MIB and cu.cuLibraryGetGlobal(ctypes.byref(dptr), ctypes.byref(size), lib, b"big") == 0:
        kept.append(lib)  # charged as the small file, loaded as the big one
    else:
        assert cu.cuLibraryUnload(lib) == 0
stop = True
t.join()
print(json.dumps({"kept": len(kept), "attempts": attempts, "peak": peak()}))
""",
    )
    assert out["peak"] <= c.limit_bytes, out
