"""Loader identity: whatever name, order, flags or number of ``dlopen`` calls a process uses, the names
``libcuda.so*`` and ``libnvidia-ml.so*`` reach only the interceptor, never the real libraries it opened.

The interceptor opens the real ``libcuda.so.<version>`` (soname ``libcuda.so.1``) and, for the SM
limit, the real ``libnvidia-ml.so.<version>`` (soname ``libnvidia-ml.so.1``).  The dynamic linker
matches a requested name against the sonames of everything already loaded, so a real library the
interceptor opened must never answer a later ``dlopen("libcuda.so.1")`` or ``"libnvidia-ml.so.1"``.
Each case checks through the handle the process got: an allocation over the cap must fail, and
the memory queries must show the cap.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.vcuda_fixtures import Container, container, last_json, vcuda_built

__all__ = ["container", "vcuda_built"]  # fixtures

MakeContainer = Callable[..., Container]

# Opens a library by name and flags (ctypes), drives it through the raw C ABI.
OPENER = r"""
import ctypes, json, os, sys
MIRROR = os.environ["MIRROR"]
FLAGS = {"local": os.RTLD_LOCAL, "global": os.RTLD_GLOBAL, "deepbind": os.RTLD_DEEPBIND | os.RTLD_LOCAL,
         "noload": os.RTLD_NOLOAD | os.RTLD_LOCAL, "lazy": os.RTLD_LAZY | os.RTLD_LOCAL}
def open_lib(name, flags):
    path = name.replace("MIRROR", MIRROR)
    mode = FLAGS[flags] | (0 if flags == "lazy" else os.RTLD_NOW)
    return ctypes.CDLL(path, mode=mode)
def cuda_start(lib):
    assert lib.cuInit(0) == 0
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    assert lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    assert lib.cuCtxSetCurrent(ctx) == 0
def cuda_view(lib):
    # Through this handle: 2 GiB (over the 1 GiB cap, well within the 15 GiB GPU) and the memory view.
    lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    p, free, total = ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_size_t()
    rc = lib.cuMemAlloc_v2(ctypes.byref(p), 2 << 30)
    if rc == 0:
        lib.cuMemFree_v2(p)
    assert lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
    return {"alloc_2g": rc, "total": total.value}
class Mem(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]
def nvml_view(lib):
    assert lib.nvmlInit_v2() == 0
    h, m = ctypes.c_void_p(), Mem()
    assert lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h)) == 0
    assert lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(m)) == 0
    return {"nvml_total": m.total}
"""

CUDA_NAMES = ["libcuda.so", "libcuda.so.1", "MIRROR/libcuda.so", "MIRROR/libcuda.so.1"]
LATER = [
    ("libcuda.so.1", "local"),
    ("libcuda.so.1", "noload"),
    ("libcuda.so.1", "deepbind"),
    ("libcuda.so.1", "global"),
    ("libcuda.so.1", "lazy"),
    ("libcuda.so", "local"),
    ("MIRROR/libcuda.so.1", "local"),
    ("MIRROR/libcuda.so", "deepbind"),
]


@pytest.mark.parametrize("first", CUDA_NAMES)
@pytest.mark.parametrize("first_flags", ["local", "global", "deepbind"])
def test_every_later_open_of_libcuda_reaches_the_interceptor(
    container: MakeContainer, first: str, first_flags: str
) -> None:
    """The first open initialises CUDA (the interceptor opens the real driver); every later one must not get it."""
    c = container(1024)
    done = c.python(
        OPENER
        + f"""
first = open_lib({first!r}, {first_flags!r})
cuda_start(first)
out = {{"first": cuda_view(first), "later": []}}
for name, flags in {LATER!r}:
    out["later"].append([name, flags, cuda_view(open_lib(name, flags))])
# cuda-bindings opens libcuda.so.1 itself.
from cuda.bindings import driver as d
assert d.cuInit(0)[0] == d.CUresult.CUDA_SUCCESS
ctx = d.cuDevicePrimaryCtxRetain(d.cuDeviceGet(0)[1])[1]
d.cuCtxSetCurrent(ctx)
out["bindings"] = [d.cuMemAlloc(2 << 30)[0].name, int(d.cuMemGetInfo()[2])]
print(json.dumps(out))
""",
        env=c.env(MIRROR=str(c.mirror)),
        prelude=False,
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    cap = {"alloc_2g": 2, "total": c.limit_bytes}  # CUDA_ERROR_OUT_OF_MEMORY
    assert out["first"] == cap
    for name, flags, view in out["later"]:
        assert view == cap, f"dlopen({name!r}, {flags}) after {first!r} reached the real driver: {view}"
    assert out["bindings"] == ["CUDA_ERROR_OUT_OF_MEMORY", c.limit_bytes]


def test_open_and_close_many_times_keeps_the_interceptor(container: MakeContainer) -> None:
    c = container(1024)
    done = c.python(
        OPENER
        + r"""
import _ctypes
seen = []
for i in range(20):
    lib = open_lib(["libcuda.so", "libcuda.so.1"][i % 2], ["local", "global"][i % 2])
    if i == 0:
        cuda_start(lib)
    seen.append(cuda_view(lib)["alloc_2g"])
    _ctypes.dlclose(lib._handle)
print(json.dumps(seen))
""",
        env=c.env(MIRROR=str(c.mirror)),
        prelude=False,
    )
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout) == [2] * 20


# An SM limit: the first limited launch makes the interceptor open the real libnvidia-ml.
LAUNCH = r"""
from cuda.bindings import driver as d
assert d.cuInit(0)[0] == d.CUresult.CUDA_SUCCESS
ctx = d.cuDevicePrimaryCtxRetain(d.cuDeviceGet(0)[1])[1]
d.cuCtxSetCurrent(ctx)
mod = d.cuModuleLoadData(b"x")[1]
fn = d.cuModuleGetFunction(mod, b"spin_10us")[1]
assert d.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0)[0] == d.CUresult.CUDA_SUCCESS
assert d.cuCtxSynchronize()[0] == d.CUresult.CUDA_SUCCESS
"""


@pytest.mark.parametrize(
    ("name", "flags"),
    [("libnvidia-ml.so.1", "local"), ("libnvidia-ml.so.1", "noload"), ("libnvidia-ml.so.1", "deepbind"),
     ("libnvidia-ml.so", "global"), ("MIRROR/libnvidia-ml.so.1", "local")],
)  # fmt: skip
def test_nvml_opened_after_the_sm_limiter_is_the_interceptor(container: MakeContainer, name: str, flags: str) -> None:
    c = container(1024, cores=30)
    done = c.python(
        OPENER
        + LAUNCH
        + f"""
print(json.dumps(nvml_view(open_lib({name!r}, {flags!r}))))
""",
        env=c.env(MIRROR=str(c.mirror)),
        prelude=False,
    )
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout) == {"nvml_total": c.limit_bytes}


def test_pynvml_after_the_sm_limiter_sees_the_cap(container: MakeContainer) -> None:
    c = container(1024, cores=30)
    done = c.python(
        LAUNCH
        + r"""
import json, pynvml
pynvml.nvmlInit()
m = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
print(json.dumps([m.total, m.used]))
""",
        prelude=False,
    )
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout)[0] == c.limit_bytes  # type: ignore[index]


def test_without_the_mirror_on_the_search_path_the_real_nvml_stays_invisible(container: MakeContainer) -> None:
    """Interceptor opened by its full path, no LD_LIBRARY_PATH: a later libnvidia-ml.so.1 is not found at all
    (as without the interceptor), although the SM limiter has the real one open."""
    c = container(1024, cores=30)
    done = c.python(
        OPENER
        + r"""
lib = open_lib("MIRROR/libcuda.so.1", "local")
cuda_start(lib)
lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
assert lib.cuModuleLoadData(ctypes.byref(mod), b"x") == 0
assert lib.cuModuleGetFunction(ctypes.byref(fn), mod, b"spin_10us") == 0
assert lib.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, None, None, None) == 0
assert lib.cuCtxSynchronize() == 0
out = {"cuda": cuda_view(lib)}
try:
    open_lib("libnvidia-ml.so.1", "noload")
    out["nvml_noload"] = "found"
except OSError:
    out["nvml_noload"] = "not loaded"
try:
    open_lib("libnvidia-ml.so.1", "local")
    out["nvml"] = "found"
except OSError:
    out["nvml"] = "not found"
print(json.dumps(out))
""",
        env=c.env(MIRROR=str(c.mirror), LD_LIBRARY_PATH=None),
        prelude=False,
    )
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout) == {
        "cuda": {"alloc_2g": 2, "total": c.limit_bytes},
        "nvml_noload": "not loaded",
        "nvml": "not found",
    }


def test_the_interceptor_names_itself_libcuda_so_1(vcuda_built: object) -> None:
    """Its soname is the driver's: whoever asks the loader for libcuda.so.1 after it is loaded gets it."""
    del vcuda_built
    import subprocess

    from tests.vcuda_fixtures import BUILD

    out = subprocess.run(
        ["readelf", "-d", str(BUILD / "libcuda-control.so")], capture_output=True, text=True, check=True
    ).stdout
    assert "Library soname: [libcuda.so.1]" in out
