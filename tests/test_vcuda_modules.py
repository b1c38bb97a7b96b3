"""Memory the driver takes inside a call: modules, libraries, context limits, against the cap.

The simulated driver gives a loaded module a 2 MiB code page plus its PTX's module-scope variables
(whole 2 MiB pages), loads a library into a context eagerly or lazily (CUDA_MODULE_LOADING), and
makes a bigger stack (times every resident thread), heap or printf FIFO take device memory.  The
judge is what the GPU held: its peak (all processes) never above the container's cap.
"""

from __future__ import annotations

from collections.abc import Callable

from tests.vcuda_fixtures import MIB, Container, container, last_json, vcuda_built

__all__ = ["container", "vcuda_built"]  # fixtures

MakeContainer = Callable[..., Container]

HELPERS = r"""
from simnode.gpusim_state import GpuSimState
def peak():
    with GpuSimState(os.environ["GPUSIM_STATE"]) as st:
        return st.snapshot(1).gpus[0].used_peak
def ptx(entries=("k",), globals_=()):
    body = [".version 7.0", ".target sm_75", ".address_size 64", ""]
    for name, size in globals_:
        body.append(f".visible .global .align 8 .b8 {name}[{size}];")
    for name in entries:
        body.append(f".visible .entry {name}()" + " { ret; }")
    return ("\n".join(body) + "\n").encode() + b"\0"
def used():
    free_b, total = ok(d.cuMemGetInfo())
    return total - free_b
"""


def run(c: Container, code: str, **env: str | None) -> dict[str, object]:
    done = c.python(HELPERS + code, env=c.env(**env) if env else None)
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    return out


def test_module_loads_stop_at_the_cap(container: MakeContainer) -> None:
    c = container(1024)
    out = run(
        c,
        r"""
image = ptx()
mods, last = [], None
for _ in range(1000):
    r = d.cuModuleLoadData(image)
    if r[0] != R.CUDA_SUCCESS:
        last = r[0].name
        break
    mods.append(r[1])
seen = used()
for m in mods:
    ok(d.cuModuleUnload(m))
print(json.dumps({"loaded": len(mods), "last": last, "seen": seen, "full": phys_used(), "peak": peak(),
                  "after": used()}))
""",
    )
    cap, ctx = c.limit_bytes, c.context_bytes
    assert out["last"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert out["peak"] <= cap, f"the GPU held {out['peak'] >> 20} MiB for a {cap >> 20} MiB container"
    assert out["loaded"] == (cap - ctx) // (2 * MIB)  # every page that fitted, not one more
    assert out["seen"] == ctx + out["loaded"] * 2 * MIB  # cuMemGetInfo sees module code at once
    assert out["after"] == ctx  # unloading gives it back


def test_a_module_whose_variables_do_not_fit_is_never_loaded(container: MakeContainer) -> None:
    c = container(1024)
    out = run(
        c,
        r"""
big = ptx(globals_=[("table", 900 << 20)])
r = d.cuModuleLoadData(big)
small = d.cuModuleLoadData(ptx(globals_=[("table", 100 << 20)]))
glob = ok(d.cuModuleGetGlobal(small[1], b"table"))
print(json.dumps({"big": r[0].name, "small": small[0].name, "size": int(glob[1]), "seen": used(),
                  "peak": peak()}))
""",
    )
    ctx = c.context_bytes
    assert out["big"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert out["small"] == "CUDA_SUCCESS" and out["size"] == 100 * MIB
    assert out["seen"] == ctx + 2 * MIB + 100 * MIB
    assert out["peak"] <= ctx + 2 * MIB + 100 * MIB, "the 900 MiB module must never reach the GPU"


def test_context_limits_that_take_memory_are_refused_beyond_the_cap(container: MakeContainer) -> None:
    c = container(1024)
    out = run(
        c,
        r"""
L = d.CUlimit
results = {}
for name, value in (("MALLOC_HEAP_SIZE", 4 << 30), ("PRINTF_FIFO_SIZE", 2 << 30), ("STACK_SIZE", 256 << 10)):
    limit = getattr(L, "CU_LIMIT_" + name)
    before = ok(d.cuCtxGetLimit(limit))
    err, = d.cuCtxSetLimit(limit, value)
    results[name] = [err.name, int(before), int(ok(d.cuCtxGetLimit(limit)))]
small, = d.cuCtxSetLimit(L.CU_LIMIT_MALLOC_HEAP_SIZE, 64 << 20)
print(json.dumps({"results": results, "small": small.name, "seen": used(), "held": phys_used(), "peak": peak()}))
""",
    )
    cap, ctx = c.limit_bytes, c.context_bytes
    results = out["results"]
    assert isinstance(results, dict)
    for name, (err, before, after) in results.items():
        assert err == "CUDA_ERROR_OUT_OF_MEMORY", (name, err)
        assert after == before, f"{name}: a refused limit keeps its old value"
    assert out["small"] == "CUDA_SUCCESS"
    assert out["held"] == ctx + 56 * MIB  # the heap grew from its 8 MiB default
    assert out["seen"] == out["held"]
    assert out["peak"] <= cap


LIBRARY = r"""
image = ptx(entries=["work_1us"], globals_=[("table", 600 << 20)])
lib = ok(d.cuLibraryLoadData(image, [], [], 0, [], [], 0))
kernel = ok(d.cuLibraryGetKernel(lib, b"work_1us"))
"""


def test_a_lazily_loaded_librarys_variables_are_charged_when_it_is_loaded(container: MakeContainer) -> None:
    """CUDA_MODULE_LOADING=LAZY: the library reaches the GPU at its first launch, which no memory hook sees."""
    c = container(1024)
    out = run(
        c,
        LIBRARY
        + r"""
before = phys_used()
r = d.cuMemAlloc(300 << 20)  # with the library's 600 MiB this would not fit
s = ok(d.cuStreamCreate(0))
launch = d.cuLaunchKernel(d.CUfunction(int(kernel)), 1, 1, 1, 1, 1, 1, 0, s, 0, 0)[0]
ok(d.cuStreamSynchronize(s))
print(json.dumps({"alloc": r[0].name, "launch": launch.name, "before": before, "held": phys_used(),
                  "peak": peak()}))
""",
        CUDA_MODULE_LOADING="LAZY",
    )
    cap, ctx = c.limit_bytes, c.context_bytes
    # Asked for (cuLibraryGetKernel): put into the current context at once, as its charge says, not at the launch.
    assert out["before"] == ctx + 602 * MIB
    assert out["alloc"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert out["launch"] == "CUDA_SUCCESS"
    assert out["held"] == ctx + 602 * MIB
    assert out["peak"] <= cap


def test_an_eagerly_loaded_library_that_does_not_fit_is_unloaded(container: MakeContainer) -> None:
    """CUDA_MODULE_LOADING=EAGER: a library goes into every live context at once, beyond one load's estimate."""
    c = container(1024)
    out = run(
        c,
        r"""
ctxs = [ok(d.cuCtxCreate(0, dev)) for _ in range(2)]  # with the primary one: three contexts
held = phys_used()
image = ptx(globals_=[("table", 100 << 20)])
r = d.cuLibraryLoadData(image, [], [], 0, [], [], 0)
after = phys_used()
one = ok(d.cuLibraryLoadData(ptx(globals_=[("table", 8 << 20)]), [], [], 0, [], [], 0))
print(json.dumps({"held": held, "rc": r[0].name, "after": after, "one": phys_used(), "seen": used()}))
""",
        CUDA_MODULE_LOADING="EAGER",
    )
    ctx = c.context_bytes
    assert out["held"] == 3 * ctx
    assert out["rc"] == "CUDA_ERROR_OUT_OF_MEMORY"  # 3 x 102 MiB did not fit beside 750 MiB of contexts
    assert out["after"] == out["held"]  # undone
    assert out["one"] == 3 * ctx + 3 * 10 * MIB
    assert out["seen"] == out["one"]


def test_a_lazily_loaded_library_is_charged_in_every_context_it_may_go_into(container: MakeContainer) -> None:
    """CUDA_MODULE_LOADING=LAZY: a library's module goes into each context where something first needs it
    (cuLibraryGetGlobal, a launch of one of its kernels, ...), its variables once per context, and no memory
    hook sees that.  So they are charged once per live context: at the load (refused when that passes the
    cap) and at every context creation (refused likewise); a destroyed context or the unload gives them back."""
    c = container(1536)
    out = run(
        c,
        r"""
ctxs = [ctx] + [ok(d.cuCtxCreate(0, dev)) for _ in range(2)]  # three contexts, 750 MiB
def in_every(lib, contexts):
    for x in contexts:
        ok(d.cuCtxSetCurrent(x))
        ok(d.cuLibraryGetGlobal(lib, b"table"))
    ok(d.cuCtxSetCurrent(ctx))
out = {}
big = d.cuLibraryLoadData(ptx(globals_=[("table", 300 << 20)]), [], [], 0, [], [], 0)
out["big"] = big[0].name  # 3 x 302 MiB beside 750 MiB of contexts: above 1536 MiB
if big[0] == R.CUDA_SUCCESS:
    in_every(big[1], ctxs)
    ok(d.cuLibraryUnload(big[1]))
lib = ok(d.cuLibraryLoadData(ptx(entries=["work_1us"], globals_=[("table", 150 << 20)]), [], [], 0, [], [], 0))
in_every(lib, ctxs[:2])
s = ok(d.cuStreamCreate(0))  # the third context gets it at a launch
ok(d.cuCtxSetCurrent(ctxs[2]))
s2 = ok(d.cuStreamCreate(0))
kernel = ok(d.cuLibraryGetKernel(lib, b"work_1us"))
ok(d.cuLaunchKernel(d.CUfunction(int(kernel)), 1, 1, 1, 1, 1, 1, 0, s2, 0, 0))
ok(d.cuStreamSynchronize(s2))
ok(d.cuStreamDestroy(s2))
ok(d.cuCtxSetCurrent(ctx))
out["held"] = phys_used()
fourth = d.cuCtxCreate(0, dev)  # 250 MiB would fit, with the library's 150 MiB it does not
out["fourth"] = fourth[0].name
if fourth[0] == R.CUDA_SUCCESS:
    in_every(lib, [fourth[1]])
    ok(d.cuCtxDestroy(fourth[1]))
ok(d.cuCtxSetCurrent(ctx))
ok(d.cuCtxDestroy(ctxs.pop()))  # gives back its 250 MiB and the library's 150 MiB there
ok(d.cuCtxSetCurrent(ctx))
again = ok(d.cuCtxCreate(0, dev))
in_every(lib, [again])
out["again"] = phys_used()
ok(d.cuLibraryUnload(lib))
out["unloaded"] = phys_used()
out["seen"] = used()
out["peak"] = peak()
print(json.dumps(out))
""",
        CUDA_MODULE_LOADING="LAZY",
    )
    cap, ctx = c.limit_bytes, c.context_bytes
    assert out["big"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert out["held"] == 3 * ctx + 3 * 152 * MIB  # in every context: code page and variables
    assert out["fourth"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert out["again"] == out["held"]  # a destroyed context's share came back
    assert out["unloaded"] == 3 * ctx
    assert out["seen"] == out["unloaded"]
    assert out["peak"] <= cap, f"the GPU held {out['peak'] >> 20} MiB for a {cap >> 20} MiB container"
