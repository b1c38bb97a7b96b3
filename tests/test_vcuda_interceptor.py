"""The interceptor's surfaces: what the container sees, cuGetProcAddress, configuration, exports."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from simnode.gpusim_state import repo_root
from tests.make_lock import run_make
from tests.vcuda_fixtures import BUILD, MIB, Container, config_bytes, container, last_json, vcuda_built

__all__ = ["container", "vcuda_built"]  # fixtures

MakeContainer = Callable[..., Container]


def test_memory_queries_show_the_cap(container: MakeContainer) -> None:
    c = container(1024)
    done = c.python(
        r"""
import pynvml
p = ok(d.cuMemAlloc(100 << 20))
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
m1 = pynvml.nvmlDeviceGetMemoryInfo(h)
m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
lib = ctypes.CDLL("libcuda.so.1")
f32, t32, tot32 = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
assert lib.cuMemGetInfo(ctypes.byref(f32), ctypes.byref(t32)) == 0
assert lib.cuDeviceTotalMem(ctypes.byref(tot32), 0) == 0
print(json.dumps({
    "info": list(ok(d.cuMemGetInfo())), "total": ok(d.cuDeviceTotalMem(dev)),
    "legacy": [f32.value, t32.value, tot32.value],
    "nvml": [m1.total, m1.used, m1.free], "nvml_v2": [m2.total, m2.used, m2.free, m2.reserved],
}))
"""
    )
    assert done.returncode == 0, done.stderr
    used, limit = c.context_bytes + 100 * MIB, c.limit_bytes  # the whole footprint: its context too
    assert last_json(done.stdout) == {
        "info": [limit - used, limit],
        "total": limit,
        "legacy": [limit - used, limit, limit],
        "nvml": [limit, used, limit - used],
        "nvml_v2": [limit, used, limit - used, 0],
    }


def test_nvml_in_a_process_without_cuda_sees_the_container(container: MakeContainer) -> None:
    """nvidia-smi's view: a second process, NVML only, sees what the first one holds."""
    c = container(2048)
    holder = c.popen('p = ok(d.cuMemAlloc(300 << 20)); print("ready", flush=True); sys.stdin.readline()')
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ready"
        done = c.python(
            "import pynvml, json\npynvml.nvmlInit()\n"
            "m = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))\n"
            "print(json.dumps([m.total, m.used, m.free]))",
            prelude=False,
        )
    finally:
        holder.communicate(input="\n", timeout=30)
    assert done.returncode == 0, done.stderr
    held = c.context_bytes + 300 * MIB  # the holder's context and allocation
    assert last_json(done.stdout) == [2048 * MIB, held, 2048 * MIB - held]


GPA = r"""
lib = ctypes.CDLL("libcuda.so.1")
real = ctypes.CDLL(os.environ["REAL_LIBCUDA"])
addr = lambda l, n: ctypes.cast(getattr(l, n), ctypes.c_void_p).value
gpa1 = lib.cuGetProcAddress
gpa1.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64]
gpa2 = lib.cuGetProcAddress_v2
gpa2.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                 ctypes.POINTER(ctypes.c_int)]
def lookup(name, version, flags=0, v2=True):
    p, st = ctypes.c_void_p(), ctypes.c_int(-1)
    rc = gpa2(name.encode(), ctypes.byref(p), version, flags, ctypes.byref(st)) if v2 else \
         gpa1(name.encode(), ctypes.byref(p), version, flags)
    return rc, p.value, st.value
ALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t)
out = {"alloc": []}
for v2 in (False, True):
    for version in (3020, 11030, 12000, 12040, 12090):
        rc, p, st = lookup("cuMemAlloc", version, 0, v2)
        ptr = ctypes.c_uint64()
        too_big = ALLOC(p)(ctypes.byref(ptr), 2 << 30)   # over the 1 GiB cap, fine for the 15 GiB GPU
        fits = ALLOC(p)(ctypes.byref(ptr), 1 << 20)
        out["alloc"].append([v2, version, rc, p == addr(lib, "cuMemAlloc_v2"), p != addr(real, "cuMemAlloc_v2"),
                             too_big, fits, st if v2 else None])
        ok(d.cuMemFree(ptr.value))
def ours(name, version, flags=0):
    rc, p, st = lookup(name, version, flags)
    return [rc, st, p == addr(lib, name_of[(name, version, flags)])]
name_of = {
    ("cuGetProcAddress", 11030, 0): "cuGetProcAddress", ("cuGetProcAddress", 12000, 0): "cuGetProcAddress_v2",
    ("cuMemAllocAsync", 11020, 0): "cuMemAllocAsync", ("cuMemAllocAsync", 11020, 2): "cuMemAllocAsync_ptsz",
    ("cuMemFreeAsync", 12000, 2): "cuMemFreeAsync_ptsz", ("cuCtxCreate", 11040, 0): "cuCtxCreate_v3",
    ("cuMemGetInfo", 3020, 0): "cuMemGetInfo_v2", ("cuMemGetInfo", 2000, 0): "cuMemGetInfo",
    ("cuMemCreate", 10020, 0): "cuMemCreate", ("cuGraphAddMemAllocNode", 11040, 0): "cuGraphAddMemAllocNode",
}
out["ours"] = {f"{n}@{v}/{f}": ours(n, v, f) for (n, v, f) in name_of}
# Not hooked: the driver's own pointer comes back untouched.
rc, p, st = lookup("cuDeviceGetCount", 2000)
out["passthrough"] = p == addr(real, "cuDeviceGetCount")
out["missing"] = list(lookup("cuNoSuchFunction", 12000)[::2])
print(json.dumps(out))
"""


def test_cu_get_proc_address_returns_wrappers_that_enforce(container: MakeContainer) -> None:
    c = container(1024)
    real = str(c.mirror / "libcuda.so.550.54.15")
    done = c.python(GPA, env=c.env(REAL_LIBCUDA=real))
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    for v2, version, rc, is_ours, not_real, too_big, fits, status in out["alloc"]:
        assert (rc, is_ours, not_real) == (0, True, True), (v2, version)
        assert too_big == 2, f"cuMemAlloc from cuGetProcAddress{'_v2' if v2 else ''}@{version} did not enforce"
        assert fits == 0
        assert status in (0, None)
    for key, (rc, status, is_ours) in out["ours"].items():
        assert (rc, status, is_ours) == (0, 0, True), key
    assert out["passthrough"] is True
    assert out["missing"] == [500, 1]  # CUDA_ERROR_NOT_FOUND, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND


def test_per_thread_stream_clients_are_enforced(container: MakeContainer) -> None:
    """cuda-bindings asks cuGetProcAddress with the per-thread flag; the _ptsz hooks answer."""
    c = container(1024)
    done = c.python(
        "print(json.dumps([d.cuMemAllocAsync(2 << 30, 0)[0].name, d.cuMemAllocAsync(1 << 20, 0)[0].name]))",
        env=c.env(CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM="1"),
    )
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout) == ["CUDA_ERROR_OUT_OF_MEMORY", "CUDA_SUCCESS"]


OVER_LIMIT = r"""
r = d.cuMemAlloc(2 << 30)
print(json.dumps({"alloc": r[0].name, "total": ok(d.cuDeviceTotalMem(dev)), "info": list(ok(d.cuMemGetInfo()))}))
"""


def test_enable_zero_passes_through(container: MakeContainer) -> None:
    c = container(1024, enable=0)
    done = c.python(OVER_LIMIT)
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    assert out["alloc"] == "CUDA_SUCCESS"
    assert out["total"] > 10 * 1024 * MIB  # the whole T4
    assert done.stderr == ""


def test_no_config_passes_through(container: MakeContainer) -> None:
    c = container(1024, config=False)
    done = c.python(OVER_LIMIT)
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout)["alloc"] == "CUDA_SUCCESS"  # type: ignore[index]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\0" * 100, "100 bytes, expected 8240"),
        (config_bytes(1 << 30) + b"\0", "8241 bytes, expected 8240"),
        (config_bytes(1 << 30, enable=7), "enable = 7"),
    ],
)
def test_bad_config_is_reported_and_skipped(container: MakeContainer, content: bytes, message: str) -> None:
    c = container(1024, config=False)
    c.config_path.write_bytes(content)
    done = c.python(OVER_LIMIT)
    assert f"{c.config_path}: {message}" in done.stderr
    assert "ignoring it" in done.stderr
    # The next place in the lookup order; here there is none: CUDA is refused (fail closed), never run unlimited.
    assert done.returncode != 0 and "CUDA_ERROR_NOT_PERMITTED" in done.stderr, done.stderr
    assert "CUDA is refused" in done.stderr


def test_bad_config_falls_back_to_the_upstream_layout(container: MakeContainer) -> None:
    c = container(1024, config=False)
    c.config_path.write_bytes(b"short")
    (c.root / "etc-vcuda" / "vcuda.config").write_bytes(config_bytes(512 * MIB))
    done = c.python(OVER_LIMIT)
    assert "expected 8240" in done.stderr
    assert last_json(done.stdout) == {"alloc": "CUDA_ERROR_OUT_OF_MEMORY", "total": 512 * MIB,
                                      "info": [512 * MIB - c.context_bytes, 512 * MIB]}  # fmt: skip


def test_upstream_pod_level_config(container: MakeContainer) -> None:
    c = container(1024, config=False)
    (c.root / "etc-vcuda" / "vcuda.config").write_bytes(config_bytes(768 * MIB))
    done = c.python(OVER_LIMIT, env=c.env(VCUDA_CONFIG_PATH=None))
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout)["total"] == 768 * MIB  # type: ignore[index]


def test_upstream_per_container_config(container: MakeContainer) -> None:
    """/etc/vcuda/<container id>/vcuda.config: the only one there is taken (no cgroup parsing needed)."""
    c = container(1024, config=False)
    cid = "3f2c9a7e8b1d4c5f6a7b8c9d0e1f2a3b4c5d6e7f8a9b0c1d2e3f4a5b6c7d8e9f"
    (c.root / "etc-vcuda" / cid).mkdir()
    (c.root / "etc-vcuda" / cid / "vcuda.config").write_bytes(config_bytes(640 * MIB))
    c.config_path.parent.rmdir()
    done = c.python(OVER_LIMIT, env=c.env(VCUDA_CONFIG_PATH=None))
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout)["total"] == 640 * MIB  # type: ignore[index]


def test_exports_every_cuda_and_nvml_function(vcuda_built: object) -> None:
    del vcuda_built
    names = subprocess.run(
        ["nm", "-D", "--defined-only", str(BUILD / "libcuda-control.so")], capture_output=True, text=True, check=True
    ).stdout.split()
    exported = {n for n in names if n.startswith(("cu", "nvml"))}
    sim_cuda = subprocess.run(
        ["nm", "-D", "--defined-only", str(BUILD / "sim" / "libcuda.so.1")], capture_output=True, text=True, check=True
    ).stdout.split()
    sim_nvml = subprocess.run(
        ["nm", "-D", "--defined-only", str(BUILD / "sim" / "libnvidia-ml.so.1")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    wanted = {n for n in sim_cuda + sim_nvml if n.startswith(("cu", "nvml"))}
    assert len(wanted) > 900
    assert wanted <= exported
    # Nothing but the API: internals stay hidden.
    assert {n for n in names if n[0].isalpha() and not n.startswith(("cu", "nvml"))} <= {"T", "D", "B", "V", "W"}


def test_make_test_runs_the_c_tests_under_sanitizers(vcuda_built: object) -> None:
    del vcuda_built
    done = run_make(
        ["make", "-C", str(repo_root() / "vcuda"), "test", f"PYTHON={sys.executable}"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "test_interceptor: all passed" in done.stdout


def test_an_sm_limit_without_a_memory_limit_shares_the_container_budget(container: MakeContainer) -> None:
    """gpu_memory = 0 with an SM share: the SM limit's ledger and the process's slot live in the container's
    budget file, as with a memory limit (not in a private mapping of each process)."""
    c = container(0, cores=30)
    done = c.python(
        r"""
import struct
mod = ok(d.cuModuleLoadData(b"x"))
f = ok(d.cuModuleGetFunction(mod, b"spin_1ms"))
for _ in range(3):
    ok(d.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0))
ok(d.cuCtxSynchronize())
budgets = sorted(os.listdir(os.environ["VCUDA_BUDGET_DIR"]))
raw = open(os.path.join(os.environ["VCUDA_BUDGET_DIR"], budgets[0]), "rb").read() if budgets else b""
pids = [struct.unpack_from("<i", raw, 4096 + 64 * i)[0] for i in range(1024)] if raw else []
print(json.dumps({"budgets": budgets, "mine": os.getpid() in pids}))
""",
        env=c.env(LOGGER_LEVEL="4"),
    )
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert out == {"budgets": ["0b6e6e0c-1f4a-4c1e-9c53-6d1b2c3d4e5f_main.budget"], "mine": True}, done.stderr
    assert "per process only" not in done.stderr and "ERROR" not in done.stderr, done.stderr
    assert "memory limit" not in done.stderr.replace("no memory limit", ""), done.stderr
