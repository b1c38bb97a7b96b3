"""Fixtures for the interceptor (libcuda-control.so) and the simulated libcuda.

A test container is a driver mirror laid out as gpu-manager's ``vdriver`` tree: the interceptor
under the names ``libcuda.so.1`` and ``libnvidia-ml.so.1``, the simulated driver under its real
file names ``libcuda.so.<version>`` / ``libnvidia-ml.so.<version>``, so the interceptor finds "the
real library next to itself".  Programs run in subprocesses with ``LD_LIBRARY_PATH`` set before
they start, and drive the libraries with NVIDIA's own clients (``cuda-bindings``, ``pynvml``).
"""

from __future__ import annotations

import struct
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from simnode.gpusim_state import ensure_sim_built, load_spec, repo_root, sim_env, spec_dir
from tests.make_lock import run_make

VCUDA = repo_root() / "vcuda"
BUILD = VCUDA / "build"
DRIVER_VERSION = "550.54.15"  # vcuda/Makefile's SIM_DRIVER_VERSION
CONFIG_SIZE = 8240
MIB = 1 << 20

# Preamble of every client program: initialise, make the primary context of device 0 current.
PRELUDE = r"""
import ctypes, json, os, sys
from cuda.bindings import driver as d
R = d.CUresult
def ok(r):
    assert r[0] == R.CUDA_SUCCESS, r
    return r[1] if len(r) == 2 else r[1:]
ok(d.cuInit(0))
dev = ok(d.cuDeviceGet(0))
ctx = ok(d.cuDevicePrimaryCtxRetain(dev))
ok(d.cuCtxSetCurrent(ctx))
def phys_used():
    from simnode.gpusim_state import GpuSimState
    with GpuSimState(os.environ["GPUSIM_STATE"]) as st:
        return st.snapshot().used_bytes(0)
"""


def config_bytes(
    limit_bytes: int,
    *,
    enable: int = 1,
    pod_uid: str = "0b6e6e0c-1f4a-4c1e-9c53-6d1b2c3d4e5f",
    container: str = "main",
    cores: int = 50,
) -> bytes:
    """A vcuda.config as gpu-manager writes it (resource_data_t, packed, 8240 bytes)."""
    buf = bytearray(CONFIG_SIZE)
    struct.pack_into("48s", buf, 0, pod_uid.encode())
    struct.pack_into("<i", buf, 48, 0)
    struct.pack_into("4096s", buf, 4096, container.encode())
    struct.pack_into("<QiiiiI", buf, 8208, limit_bytes, cores, 1, 550, 0, enable)
    return bytes(buf)


@dataclass
class Container:
    """One simulated container: mirror dir, config, budget dir, and the node's spec and state."""

    root: Path
    spec_path: Path
    limit_bytes: int

    @property
    def context_bytes(self) -> int:
        """Device memory one CUDA context takes on the node's GPU 0 (the simulator's size for its model)."""
        return load_spec(self.spec_path).gpus[0].context_bytes

    @property
    def mirror(self) -> Path:
        return self.root / "nvidia" / "lib64"

    @property
    def config_path(self) -> Path:
        return self.root / "etc-vcuda" / "main" / "vcuda.config"

    @property
    def budget_dir(self) -> Path:
        return self.root / "shm"

    @property
    def state_path(self) -> Path:
        return self.root / "node.state"

    def env(self, **overrides: str | None) -> dict[str, str]:
        """Environment of a process in this container; an override of None removes the variable.

        Its streams take no device memory (GPUSIM_STREAM_KIB=0): the tests here count each path's bytes exactly,
        and a stream's own memory (an H200's ~0.55 MiB, which the simulator charges by default) is the reconciliation's
        (tests/test_vcuda_memory_review11.py "streams" and test_vcuda_streams_take_memory in test_vcuda_sim.py)."""
        env = sim_env(self.spec_path, self.state_path)
        env["GPUSIM_STREAM_KIB"] = "0"
        env["LD_LIBRARY_PATH"] = str(self.mirror)
        env["VCUDA_CONFIG_PATH"] = str(self.config_path)
        env["VCUDA_CONFIG_ROOT"] = str(self.root / "etc-vcuda")
        env["VCUDA_BUDGET_DIR"] = str(self.budget_dir)
        env["PYTHONPATH"] = str(repo_root())
        env.pop("LOGGER_LEVEL", None)
        for key, value in overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def python(
        self, code: str, *, env: Mapping[str, str] | None = None, timeout: float = 60, prelude: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Runs a client program (PRELUDE + code) in this container."""
        return subprocess.run(
            [sys.executable, "-c", (PRELUDE if prelude else "") + code],
            env=dict(env) if env is not None else self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=repo_root(),
        )

    def popen(self, code: str, *, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
        """Starts a client program; stdin, stdout and stderr are pipes."""
        return subprocess.Popen(
            [sys.executable, "-c", PRELUDE + code],
            env=dict(env) if env is not None else self.env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=repo_root(),
        )


def ensure_vcuda_built() -> None:
    """Builds the simulated driver and the interceptor (make is incremental)."""
    ensure_sim_built()
    cmd = ["make", "-C", str(VCUDA), "sim", "interceptor", f"PYTHON={sys.executable}"]
    done = run_make(cmd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}{done.stderr}")


@pytest.fixture(scope="session")
def vcuda_built() -> Path:
    """The interceptor, built once per session."""
    ensure_vcuda_built()
    return BUILD / "libcuda-control.so"


#: Program text (after the prelude): ``pool``, the device's default memory pool, set to keep what is freed
#: into it (release threshold 2^62), and ``A``, the pool attributes.
KEEPING_POOL = r"""
A = d.CUmemPool_attribute
pool = ok(d.cuDeviceGetDefaultMemPool(dev))
ok(d.cuMemPoolSetAttribute(pool, A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, d.cuuint64_t(1 << 62)))
"""


def ctypes_kernel_program(device: str, function: str, body: str) -> str:
    """A test program over libcuda.so.1 through ctypes: a primary context on GPU ``device``, the simulated
    module's kernel ``function`` in ``fn`` with its ``args`` (a 1 MiB buffer), then ``body`` (Python
    expressions are given as source, e.g. ``"int(sys.argv[2])"``)."""
    return (
        f"""
import ctypes, sys
cu = ctypes.CDLL("libcuda.so.1")
def ok(rc):
    assert rc == 0, rc
ok(cu.cuInit(0))
dev = ctypes.c_int()
ok(cu.cuDeviceGet(ctypes.byref(dev), {device}))
ctx = ctypes.c_void_p()
ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
ok(cu.cuCtxSetCurrent(ctx))
mod, fn, buf = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_uint64()
ok(cu.cuModuleLoadData(ctypes.byref(mod), b"fatbin"))
ok(cu.cuModuleGetFunction(ctypes.byref(fn), mod, {function}))
ok(cu.cuMemAlloc_v2(ctypes.byref(buf), ctypes.c_size_t(1 << 20)))
args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(buf), ctypes.c_void_p))
"""
        + body
    )


#: One kernel (named by argv[1]) launched on GPU 0, then the process exits once it ran.
ONE_KERNEL = ctypes_kernel_program(
    "int(sys.argv[2]) if len(sys.argv) > 2 else 0",
    "sys.argv[1].encode()",
    """ok(cu.cuLaunchKernel(fn, 1, 1, 1, 128, 1, 1, 0, None, args, None))
ok(cu.cuCtxSynchronize())
""",
)


class FreshProcesses:
    """Process after process of ``argv``, two at a time and staggered (one starts while the other runs)."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path | None = None) -> None:
        self._argv, self._env, self._cwd = list(argv), dict(env), cwd
        self._procs: list[subprocess.Popen[bytes]] = []
        self.started = 0

    def feed(self, until: float) -> None:
        """Keep two running until ``time.monotonic()`` reaches ``until``."""
        while time.monotonic() < until:
            self._procs = [p for p in self._procs if p.poll() is None]
            if len(self._procs) < 2:
                self._procs.append(subprocess.Popen(self._argv, env=self._env, cwd=self._cwd))
                self.started += 1
            time.sleep(0.02)

    def stop(self) -> None:
        for p in self._procs:
            p.kill()
            p.wait(timeout=30)


def make_mirror(mirror: Path, interceptor: Path) -> None:
    """gpu-manager's share-mode driver tree: the interceptor as libcuda.so.1 / libnvidia-ml.so.1."""
    mirror.mkdir(parents=True, exist_ok=True)
    for name in ("libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1", "libnvidia-ml.so"):
        (mirror / name).symlink_to(interceptor)
    for lib in ("libcuda.so", "libnvidia-ml.so"):
        (mirror / f"{lib}.{DRIVER_VERSION}").symlink_to(BUILD / "sim" / f"{lib}.{DRIVER_VERSION}")


@pytest.fixture
def container(vcuda_built: Path, tmp_path: Path) -> Callable[..., Container]:
    """Factory: container(limit_mib=1024, enable=1, spec="t4-x1", config=True, cores=50) -> Container."""
    count = 0

    def make(
        limit_mib: int = 1024, *, enable: int = 1, spec: str = "t4-x1", config: bool = True, cores: int = 50
    ) -> Container:
        nonlocal count
        count += 1
        c = Container(tmp_path / f"c{count}", spec_dir() / f"{spec}.json", limit_mib * MIB)
        make_mirror(c.mirror, vcuda_built)
        c.config_path.parent.mkdir(parents=True)
        if config:
            c.config_path.write_bytes(config_bytes(c.limit_bytes, enable=enable, cores=cores))
        return c

    return make


def sim_only_env(spec: str, state: Path) -> dict[str, str]:
    """Environment of a process that uses the simulated driver directly (no interceptor)."""
    env = sim_env(spec_dir() / f"{spec}.json", state)
    env["PYTHONPATH"] = str(repo_root())
    return env


def run_python(code: str, env: Mapping[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Runs code (PRELUDE first) with env."""
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + code],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=repo_root(),
    )


def last_json(stdout: str) -> object:
    """The JSON document on the last line of a program's output."""
    import json

    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines, "no output"
    return json.loads(lines[-1])


__all__ = [
    "MIB",
    "PRELUDE",
    "Container",
    "config_bytes",
    "container",
    "last_json",
    "make_mirror",
    "run_python",
    "sim_only_env",
    "vcuda_built",
]
