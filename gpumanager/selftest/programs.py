"""The CUDA programs the self-test runs in child processes, and the PTX kernels they load.

Each program is Python source run as ``python -c <source> <json arguments>`` with the
environment of a container (the mirror on ``LD_LIBRARY_PATH``, its ``vcuda.config``) or of a
plain process (the real driver only).  It prints one JSON object on its last line.  The kernels
are PTX text, compiled by the driver (``cuModuleLoadData``): no nvcc or NVRTC on the node.
"""

from __future__ import annotations

# spin_1000us spins for the nanoseconds it is given (1 ms) on the GPU's global nanosecond timer, not on
# %clock64: SM clock cycles last longer whenever the clock is below its maximum (load, power, heat), and
# a kernel of a fixed cycle count would change length between the unlimited and the limited runs.
# empty_1ns returns at once.  Their names carry their intended duration, which the simulated driver uses.
#
# spin_cycles_1000us (the two containers run together, only) spins the SM clock cycles it is given (sized to 1 ms
# at the GPU's clock) and counts only the cycles its own context ran: a gap of 65536 cycles or more between two
# reads of %clock64 (about 30 us; the context was switched out, or the warp resumed on another SM) is not
# counted.  A GPU time-slices between contexts, and neither timer stops while a context is switched out: a
# %globaltimer spin, or a plain %clock64 one, preempted mid-way ends as soon as it is resumed, so two processes
# each complete far more than half of what one does alone (an H200, driver 580: 668/s each against 999/s alone,
# for both).  This one completes only after its cycles ran (465/s each: two contexts lose about 7 % of the GPU
# to switching), so its kernels/s are its context's GPU time.  Both containers run at once, at one clock, so
# their shares of the pair's kernels do not follow the clock.
# PTX ISA 6.0 for sm_50 and newer: every driver that runs CUDA 12 or 13 compiles it for its GPU (H100/H200
# sm_90, B200 sm_100).
PTX = r"""
.version 6.0
.target sm_50
.address_size 64

.visible .entry spin_1000us(.param .u64 ns)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<6>;
    ld.param.u64 %rd1, [ns];
    mov.u64 %rd2, %globaltimer;
$Lspin:
    mov.u64 %rd3, %globaltimer;
    sub.s64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p1, %rd4, %rd1;
    @%p1 bra $Lspin;
    ret;
}

.visible .entry spin_cycles_1000us(.param .u64 cycles)
{
    .reg .pred %p<3>;
    .reg .b64 %rd<7>;
    ld.param.u64 %rd1, [cycles];
    mov.u64 %rd5, 0;
    mov.u64 %rd2, %clock64;
$Lcycle:
    mov.u64 %rd3, %clock64;
    sub.s64 %rd4, %rd3, %rd2;
    mov.u64 %rd2, %rd3;
    setp.lt.u64 %p2, %rd4, 65536;
    @%p2 add.s64 %rd5, %rd5, %rd4;
    setp.lt.u64 %p1, %rd5, %rd1;
    @%p1 bra $Lcycle;
    ret;
}

.visible .entry empty_1ns()
{
    ret;
}
"""

# Every program starts here: the device of the given UUID, its primary context, helpers.
PRELUDE = r"""
import ctypes, json, os, sys, time
from cuda.bindings import driver as d
R = d.CUresult
ARGS = json.loads(sys.argv[1])
def report(**fields):
    print(json.dumps(fields), flush=True)
def ok(r):
    if r[0] != R.CUDA_SUCCESS:
        report(error=r[0].name)
        sys.exit(3)
    return r[1] if len(r) == 2 else r[1:]
def uuid_of(dev):
    h = bytes(ok(d.cuDeviceGetUuid(dev)).bytes).hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
ok(d.cuInit(0))
dev = next((g for g in (ok(d.cuDeviceGet(i)) for i in range(ok(d.cuDeviceGetCount()))) if uuid_of(g) == ARGS["uuid"]),
           None)
if dev is None:
    report(error=f"CUDA shows no device {ARGS['uuid']} (a GPU in MIG mode, or hidden by CUDA_VISIBLE_DEVICES)")
    sys.exit(3)
rc, ctx = d.cuDevicePrimaryCtxRetain(dev)
if rc != R.CUDA_SUCCESS:
    report(context=rc.name)
    sys.exit(0)
ok(d.cuCtxSetCurrent(ctx))
def hold(work=None):
    # The self-test reads what NVML accounts to this process now; it says when to go.  With work: called
    # over and over until then (a launch loop keeps its pace while NVML's samples of its window come in).
    if work is not None:
        import select
        while not select.select([sys.stdin], [], [], 0)[0]:
            work()
    sys.stdin.readline()
"""

# Whether CUDA reaches the GPU at all (run without the interceptor before any check): its primary context.
PROBE = (
    PRELUDE
    + r"""
report(context="CUDA_SUCCESS", pid=os.getpid())
"""
)

# One allocation path, to the cap: ARGS chunk (bytes), path, most (allocations at most; default 100000).
ALLOCATE = (
    PRELUDE
    + r"""
chunk, path = ARGS["chunk"], ARGS["path"]
A = d.CUmemAllocationProp()
A.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
A.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
A.location.id = int(dev)
stream = ok(d.cuStreamCreate(0))
def pool_props():
    p = d.CUmemPoolProps()
    p.allocType = A.type
    p.location = A.location
    return p
pool = ok(d.cuMemPoolCreate(pool_props())) if path == "cuMemAllocFromPoolAsync" else None
def array(desc3d, mip=False):
    desc = d.CUDA_ARRAY3D_DESCRIPTOR()
    desc.Width, desc.Height, desc.Depth = desc3d
    desc.NumChannels, desc.Format = 1, d.CUarray_format.CU_AD_FORMAT_FLOAT
    return d.cuMipmappedArrayCreate(desc, 1) if mip else d.cuArray3DCreate(desc)
def graph_alloc():
    graph = ok(d.cuGraphCreate(0))
    p = d.CUDA_MEM_ALLOC_NODE_PARAMS()
    p.poolProps.allocType = A.type
    p.poolProps.location = A.location
    p.bytesize = chunk
    r = d.cuGraphAddMemAllocNode(graph, None, 0, p)
    if r[0] != R.CUDA_SUCCESS:
        return r
    return d.cuGraphInstantiate(graph, 0)
def vmm():
    r = d.cuMemCreate(chunk, A, 0)
    if r[0] != R.CUDA_SUCCESS:
        return r
    va = ok(d.cuMemAddressReserve(chunk, 0, 0, 0))
    ok(d.cuMemMap(va, chunk, 0, r[1], 0))
    ok(d.cuMemRelease(r[1]))  # the usual pattern: the mapping keeps the memory
    return (R.CUDA_SUCCESS, va)
def legacy():
    fn = getattr(ctypes.CDLL("libcuda.so.1"), "cuMemAlloc", None)  # a driver may not export the 2.0 ABI
    if fn is None:
        return (R.CUDA_ERROR_NOT_FOUND, 0)
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint), ctypes.c_uint]
    p = ctypes.c_uint(0)
    return (R(fn(ctypes.byref(p), chunk)), p.value)
side = int(chunk ** 0.5) // 4  # a square float array of about one chunk
ALLOC = {
    "cuMemAlloc": lambda: d.cuMemAlloc(chunk),
    "cuMemAllocPitch": lambda: d.cuMemAllocPitch(chunk // 1024, 1024, 4),
    "cuMemAllocManaged": lambda: d.cuMemAllocManaged(chunk, d.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL),
    "cuMemAllocAsync": lambda: d.cuMemAllocAsync(chunk, stream),
    "cuMemAllocFromPoolAsync": lambda: d.cuMemAllocFromPoolAsync(chunk, pool, stream),
    "cuMemCreate + cuMemMap": vmm,
    "cuArray3DCreate": lambda: array((side, side, 1)),
    "cuMipmappedArrayCreate": lambda: array((side, side, 0), True),
    "graph memory node": graph_alloc,
    "cuMemAlloc (CUDA 2.0 ABI)": legacy,
}[path]
count, rc = 0, R.CUDA_SUCCESS
while count < ARGS.get("most", 100000):
    r = ALLOC()
    rc = r[0]
    if rc != R.CUDA_SUCCESS:
        break
    count += 1
d.cuCtxSynchronize()
free, total = ok(d.cuMemGetInfo())
report(rc=rc.name, count=count, free=free, total=total, pid=os.getpid())
hold()
"""
)

# What the container sees: ARGS alloc (bytes), libs (files whose mapping into the process it reports).
VIEWS = (
    PRELUDE
    + r"""
import pynvml
p = ok(d.cuMemAlloc(ARGS["alloc"]))
free, total = ok(d.cuMemGetInfo())
pynvml.nvmlInit()
m = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(ARGS["uuid"]))
with open("/proc/self/maps") as maps:  # the files this process has mapped: which libcuda it really runs
    mapped = {os.path.realpath(f[5].strip()) for f in (line.split(None, 5) for line in maps) if len(f) == 6}
report(free=free, total=total, device_total=ok(d.cuDeviceTotalMem(dev)), nvml_total=m.total, nvml_used=m.used,
       pid=os.getpid(), mapped=[path for path in ARGS["libs"] if path in mapped],
       libcuda=sorted(p for p in mapped if os.path.basename(p).startswith("libcuda.so")))
hold()
"""
)

# One of several processes of a container: on "go" makes its context (a refused one reports that and
# exits) and says so; on the next line allocates chunks to the cap, reports, holds.
HOLD = (
    r"""
import json, sys
print("ready", flush=True)
sys.stdin.readline()
"""
    + PRELUDE
    + r"""
print("context", flush=True)
sys.stdin.readline()
count = 0
while d.cuMemAlloc(ARGS["chunk"])[0] == R.CUDA_SUCCESS:
    count += 1
report(context="CUDA_SUCCESS", count=count, pid=os.getpid())
hold()
"""
)

# A continuously fed, unsynchronised launch loop of ``fn`` with ``params`` (set by the program before it): ARGS
# settle, seconds; reports launches per second after settle and the wall-clock window (us) they were counted in,
# then launches on (uncounted) until told to go.
_LAUNCH_LOOP = r"""
stream = ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING))
print("running", flush=True)
start = time.monotonic()
settle, end = start + ARGS["settle"], start + ARGS["settle"] + ARGS["seconds"]
counted, t0, from_us = 0, None, 0
while True:
    now = time.monotonic()
    if now >= end:
        break
    ok(d.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, params, 0))
    if now >= settle:
        if t0 is None:
            t0, from_us = now, int(time.time() * 1e6)
        counted += 1
elapsed = time.monotonic() - (t0 or end)
to_us = int(time.time() * 1e6)  # the window NVML's samples are read over (CLOCK_REALTIME, as theirs)
report(rate=counted / elapsed if elapsed > 0 else 0.0, pid=os.getpid(), from_us=from_us or to_us, to_us=to_us)
# Launching on, at the same pace, until NVML has been read past the window: NVML tells nothing of a process
# that ended, and a sample that spans the window's end (a real GPU's period is up to a second) averages what
# came after it in; idle there, it would read the window's end as partly idle.
hold(lambda: d.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, params, 0))
"""

# The launch loop of spin_1000us (1 ms of the global timer): the single-container shares.
SPIN = (
    PRELUDE
    + r"""
mod = ok(d.cuModuleLoadData(ARGS["ptx"].encode()))
fn = ok(d.cuModuleGetFunction(mod, b"spin_1000us"))
params = ((1_000_000,), (ctypes.c_uint64,))  # 1 ms of the global timer
"""
    + _LAUNCH_LOOP
)

# The launch loop of spin_cycles_1000us (1 ms of SM clock cycles at the GPU's clock, counted while its context
# runs): the containers that run together, whose kernels/s must be their GPU time.
SPIN_CYCLES = (
    PRELUDE
    + r"""
mod = ok(d.cuModuleLoadData(ARGS["ptx"].encode()))
fn = ok(d.cuModuleGetFunction(mod, b"spin_cycles_1000us"))
clock = getattr(d.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_CLOCK_RATE", None)  # kHz: cycles per ms
khz = d.cuDeviceGetAttribute(clock, dev) if clock is not None else (None,)
cycles = khz[1] if khz[0] == R.CUDA_SUCCESS and khz[1] > 0 else 1_500_000  # unknown clock: ~1 ms at 1.5 GHz
params = ((cycles,), (ctypes.c_uint64,))
"""
    + _LAUNCH_LOOP
)

# Per-call cost, through ctypes (the same overhead with and without the interceptor): ARGS calls.
COST = r"""
import ctypes, json, statistics, sys, time
ARGS = json.loads(sys.argv[1])
lib = ctypes.CDLL("libcuda.so.1")
def check(rc, what):
    if rc != 0:
        print(json.dumps({"error": f"{what}: {rc}"}))
        sys.exit(3)
check(lib.cuInit(0), "cuInit")
dev, ctx, count = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_int()
check(lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
uuid = (ctypes.c_ubyte * 16)()
for i in range(count.value):
    check(lib.cuDeviceGet(ctypes.byref(dev), i), "cuDeviceGet")
    check(lib.cuDeviceGetUuid_v2(uuid, dev), "cuDeviceGetUuid")
    h = bytes(uuid).hex()
    if f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}" == ARGS["uuid"]:
        break
else:
    print(json.dumps({"error": f"CUDA shows no device {ARGS['uuid']} (a GPU in MIG mode, or hidden by "
                               "CUDA_VISIBLE_DEVICES)"}))
    sys.exit(3)
check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
check(lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(ARGS["ptx"].encode())), "cuModuleLoadData")
check(lib.cuModuleGetFunction(ctypes.byref(fn), mod, b"empty_1ns"), "cuModuleGetFunction")
lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
version, ptr = ctypes.c_int(), ctypes.c_uint64()
def median_ns(call, batches, batch):
    per = []
    for _ in range(batches):
        t = time.perf_counter_ns()
        for _ in range(batch):
            call()
        per.append((time.perf_counter_ns() - t) / batch)
    return statistics.median(per)
def alloc_free():
    lib.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20)
    lib.cuMemFree_v2(ptr)
def launch():
    lib.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, None, None, None)
n = ARGS["calls"]
out = {"passthrough": median_ns(lambda: lib.cuDriverGetVersion(ctypes.byref(version)), 50, max(1, n // 50))}
out["alloc_free"] = median_ns(alloc_free, 20, max(1, n // 200))
out["launch"] = median_ns(launch, 20, max(1, n // 200))
lib.cuCtxSynchronize()
print(json.dumps(out))
"""
