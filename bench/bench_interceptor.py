"""Interceptor overhead benchmark: libcuda-control.so over the simulated driver vs the driver alone.

Runs vcuda/bench/bench_calls (C) in fresh processes, once against the simulated libcuda.so.1
alone and once through the interceptor in a gpu-manager-style driver mirror, with a memory
limit (enable = 1) and with enable = 0.  Prints the extra cost per call, median over ``--calls``
calls (batches of 1000): a pass-through call (cuDriverGetVersion, forwarded; target < 5 ns),
cuMemAlloc_v2 + cuMemFree_v2 (target < 200 ns), and the first cuInit (median over ``--starts``
fresh processes).

    python bench/bench_interceptor.py [--calls 1000000] [--starts 15] [--spec deploy/sim/t4-x1.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VCUDA = ROOT / "vcuda"
BUILD = VCUDA / "build"
DRIVER_VERSION = "550.54.15"
TARGETS_NS = {"passthrough_ns": 5.0, "alloc_free_ns": 200.0}


def config_bytes(limit: int, enable: int) -> bytes:
    """vcuda.config (resource_data_t, 8240 bytes)."""
    buf = bytearray(8240)
    struct.pack_into("48s", buf, 0, b"bench-pod")
    struct.pack_into("4096s", buf, 4096, b"bench")
    struct.pack_into("<QiiiiI", buf, 8208, limit, 50, 1, 550, 0, enable)
    return bytes(buf)


def build() -> None:
    cmd = ["make", "-C", str(VCUDA), "bench", f"PYTHON={sys.executable}"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout}{done.stderr}")


def mirror(root: Path) -> Path:
    lib = root / "lib64"
    lib.mkdir(parents=True)
    for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
        (lib / name).symlink_to(BUILD / "libcuda-control.so")
    for name in ("libcuda.so", "libnvidia-ml.so"):
        (lib / f"{name}.{DRIVER_VERSION}").symlink_to(BUILD / "sim" / f"{name}.{DRIVER_VERSION}")
    return lib


def run(lib_dir: Path, env_extra: dict[str, str], calls: int, spec: Path, state: Path) -> dict[str, float]:
    env = {
        "PATH": "/usr/bin:/bin",
        "LD_LIBRARY_PATH": str(lib_dir),
        "GPUSIM_SPEC": str(spec),
        "GPUSIM_STATE": str(state),
        **env_extra,
    }
    done = subprocess.run(
        [str(BUILD / "bench" / "bench_calls"), str(calls)], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        sys.exit(f"bench_calls failed ({lib_dir}):\n{done.stdout}{done.stderr}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(
    name: str, lib_dir: Path, env_extra: dict[str, str], args: argparse.Namespace, state: Path
) -> dict[str, float]:
    """Median of the per-call figures over a few long runs, and of the first cuInit over many starts."""
    long_runs = [run(lib_dir, env_extra, args.calls, args.spec, state) for _ in range(args.repeat)]
    starts = [run(lib_dir, env_extra, 1000, args.spec, state)["first_cuinit_ns"] for _ in range(args.starts)]
    out = {k: statistics.median(r[k] for r in long_runs) for k in ("passthrough_ns", "alloc_free_ns")}
    out["first_cuinit_ns"] = statistics.median(starts)
    out["dlopen_ns"] = statistics.median(r["dlopen_ns"] for r in long_runs)
    print(
        f"{name:34s} pass-through {out['passthrough_ns']:7.2f} ns   alloc+free {out['alloc_free_ns']:8.1f} ns   "
        f"first cuInit {out['first_cuinit_ns'] / 1000:8.1f} us   dlopen {out['dlopen_ns'] / 1000:8.1f} us"
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1_000_000, help="calls per measurement (default 1e6)")
    ap.add_argument("--repeat", type=int, default=3, help="long runs per configuration (median taken)")
    ap.add_argument("--starts", type=int, default=15, help="fresh processes for the first-cuInit figure")
    ap.add_argument("--spec", type=Path, default=ROOT / "deploy" / "sim" / "t4-x1.json")
    args = ap.parse_args()
    build()
    with tempfile.TemporaryDirectory(prefix="vcuda-bench-") as tmp:
        root = Path(tmp)
        lib = mirror(root)
        state = root / "node.state"
        cfg_on, cfg_off = root / "on" / "vcuda.config", root / "off" / "vcuda.config"
        for path, enable in ((cfg_on, 1), (cfg_off, 0)):
            path.parent.mkdir()
            path.write_bytes(config_bytes(8 << 30, enable))
        common = {"VCUDA_BUDGET_DIR": str(root / "shm"), "VCUDA_CONFIG_ROOT": str(root / "none")}
        print(f"{args.calls} calls per figure (median of {args.repeat} runs), first cuInit over {args.starts} starts")
        base = measure("simulated driver alone", BUILD / "sim", {}, args, state)
        on = measure("interceptor, 8 GiB limit", lib, {**common, "VCUDA_CONFIG_PATH": str(cfg_on)}, args, state)
        off = measure("interceptor, enable = 0", lib, {**common, "VCUDA_CONFIG_PATH": str(cfg_off)}, args, state)
    print()
    print("extra cost per call over the simulated driver alone:")
    for name, res in (("limit on", on), ("enable = 0", off)):
        for key, label in (("passthrough_ns", "pass-through call"), ("alloc_free_ns", "cuMemAlloc+cuMemFree")):
            extra = res[key] - base[key]
            verdict = "ok" if extra < TARGETS_NS[key] else "OVER TARGET"
            print(f"  {name:11s} {label:22s} {extra:+8.2f} ns   (target < {TARGETS_NS[key]:g} ns: {verdict})")
        extra_init = (res["first_cuinit_ns"] - base["first_cuinit_ns"]) / 1000
        print(f"  {name:11s} {'first cuInit':22s} {extra_init:+8.1f} us   (opens the real libcuda next to it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
