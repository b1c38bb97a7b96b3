"""Driver-mirror benchmark on a synthetic driver of 60 libraries.

The driver: 60 real ELF shared objects (gcc) named as NVIDIA's 550 driver names them, 64-bit and
32-bit, several of them large sparse files (libcuda 40 MiB, libnvidia-rtcore 120 MiB, ...), a real
``ld.so.cache`` (ldconfig) padded with 2000 unrelated entries like a busy host's, and the binaries.

Prints, as median and p99 over N runs: (a) the first mirror into an empty base with hard links
(same file system), (b) the same with copies (what the DaemonSet does: the host root and the
vdriver base are different mounts, so hard links fail with EXDEV), (c) the no-op re-run with an
unchanged driver. Targets: (a), (b) < 1 s; (c) < 200 ms.

    python bench/bench_volume.py [--runs 20]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpumanager.volume import build_vdriver
from gpumanager.volume.ldcache import read_ldcache
from tests.volume_fixtures import (
    DEFAULT_VOLUME_CONF,
    LIB32,
    LIB64,
    build_executable,
    build_shared,
    run_ldconfig,
    write_cache,
)

VERSION = "550.54.15"
MIB = 1 << 20
# (name stem, soname, 64-bit size in MiB or 0 for the small real object), as in NVIDIA's 550 driver.
LIBS_64 = [
    ("libcuda", "libcuda.so.1", 40),
    ("libcudadebugger", "libcudadebugger.so.1", 10),
    ("libnvidia-ml", "libnvidia-ml.so.1", 2),
    ("libnvidia-ptxjitcompiler", "libnvidia-ptxjitcompiler.so.1", 30),
    ("libnvidia-nvvm", "libnvidia-nvvm.so.4", 90),
    ("libnvidia-opencl", "libnvidia-opencl.so.1", 60),
    ("libnvidia-cfg", "libnvidia-cfg.so.1", 0),
    ("libnvidia-allocator", "libnvidia-allocator.so.1", 0),
    ("libnvidia-api", "libnvidia-api.so.1", 0),
    ("libnvidia-fbc", "libnvidia-fbc.so.1", 0),
    ("libnvidia-encode", "libnvidia-encode.so.1", 0),
    ("libnvcuvid", "libnvcuvid.so.1", 10),
    ("libnvidia-opticalflow", "libnvidia-opticalflow.so.1", 0),
    ("libnvidia-ngx", "libnvidia-ngx.so.1", 4),
    ("libnvidia-rtcore", f"libnvidia-rtcore.so.{VERSION}", 120),
    ("libnvoptix", "libnvoptix.so.1", 60),
    ("libnvidia-glcore", f"libnvidia-glcore.so.{VERSION}", 50),
    ("libnvidia-eglcore", f"libnvidia-eglcore.so.{VERSION}", 40),
    ("libnvidia-glsi", f"libnvidia-glsi.so.{VERSION}", 0),
    ("libnvidia-tls", f"libnvidia-tls.so.{VERSION}", 0),
    ("libnvidia-glvkspirv", f"libnvidia-glvkspirv.so.{VERSION}", 20),
    ("libnvidia-gpucomp", f"libnvidia-gpucomp.so.{VERSION}", 60),
    ("libnvidia-pkcs11", f"libnvidia-pkcs11.so.{VERSION}", 0),
    ("libnvidia-pkcs11-openssl3", f"libnvidia-pkcs11-openssl3.so.{VERSION}", 0),
    ("libnvidia-egl-gbm", "libnvidia-egl-gbm.so.1", 0),
    ("libnvidia-egl-wayland", "libnvidia-egl-wayland.so.1", 0),
    ("libnvidia-vulkan-producer", f"libnvidia-vulkan-producer.so.{VERSION}", 0),
    ("libnvidia-wayland-client", f"libnvidia-wayland-client.so.{VERSION}", 0),
    ("libGLX_nvidia", "libGLX_nvidia.so.0", 2),
    ("libEGL_nvidia", "libEGL_nvidia.so.0", 2),
    ("libGLESv2_nvidia", "libGLESv2_nvidia.so.2", 0),
    ("libGLESv1_CM_nvidia", "libGLESv1_CM_nvidia.so.1", 0),
    ("libvdpau_nvidia", "libvdpau_nvidia.so.1", 0),
]
GLVND = [  # versioned file names of their own; they need libGLdispatch
    ("libGLdispatch.so.0", "libGLdispatch.so.0"),
    ("libGL.so.1.7.0", "libGL.so.1"),
    ("libGLX.so.0", "libGLX.so.0"),
    ("libOpenGL.so.0", "libOpenGL.so.0"),
    ("libEGL.so.1.1.0", "libEGL.so.1"),
    ("libGLESv2.so.2.1.0", "libGLESv2.so.2"),
    ("libGLESv1_CM.so.1.2.0", "libGLESv1_CM.so.1"),
]
LIBS_32 = [
    "libcuda",
    "libnvidia-ml",
    "libnvidia-ptxjitcompiler",
    "libnvidia-opencl",
    "libnvidia-fbc",
    "libnvidia-encode",
    "libnvcuvid",
    "libnvidia-glcore",
    "libnvidia-eglcore",
    "libnvidia-glsi",
    "libnvidia-tls",
    "libnvidia-gpucomp",
    "libGLX_nvidia",
    "libEGL_nvidia",
    "libGLESv2_nvidia",
    "libGLESv1_CM_nvidia",
    "libvdpau_nvidia",
    "libnvidia-allocator",
    "libnvidia-cfg",
    "libnvidia-api",
]
BINARIES = [
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
]


def make_driver(work: Path) -> tuple[Path, Path, Path, int]:
    """Build the synthetic driver root; returns (root, volume.conf, interceptor, library count)."""
    root = work / "host"
    objs = work / "objs"
    jobs: list[tuple[Path, str, str, list[Path], tuple[int, int, int] | None, int]] = []
    dispatch = objs / "libGLdispatch.so.0"
    build_shared(dispatch, "libGLdispatch.so.0", marker="dispatch")
    soname_of = {stem: soname for stem, soname, _ in LIBS_64}
    for stem, soname, size in LIBS_64:
        tag = (2, 3, 99) if stem == "libnvidia-tls" else None
        jobs.append((root / LIB64.lstrip("/") / f"{stem}.so.{VERSION}", soname, "64", [], tag, size))
    for name, soname in GLVND:
        needed = [] if name.startswith("libGLdispatch") else [dispatch]
        jobs.append((root / LIB64.lstrip("/") / name, soname, "64", needed, None, 0))
    for stem in LIBS_32:
        tag = (2, 3, 99) if stem == "libnvidia-tls" else None
        jobs.append((root / LIB32.lstrip("/") / f"{stem}.so.{VERSION}", soname_of[stem], "32", [], tag, 0))

    def build(job: tuple[Path, str, str, list[Path], tuple[int, int, int] | None, int]) -> None:
        path, soname, bits, needed, tag, size = job
        build_shared(path, soname, marker=path.name + bits, needed=needed, bits=bits, abi_tag=tag)
        if size:
            os.truncate(path, size * MIB)  # a large file that is mostly a hole
        if soname != path.name:
            (path.parent / soname).symlink_to(path.name)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(build, jobs))
        exe = pool.submit(build_executable, work / "exe", "tool").result()
        interceptor = pool.submit(build_shared, work / "libcuda-control.so", "libcuda-control.so", marker="hook")
    for name in BINARIES:
        (root / "usr/bin").mkdir(parents=True, exist_ok=True)
        shutil.copy2(exe, root / "usr/bin" / name)
    (root / "etc").mkdir(parents=True, exist_ok=True)
    (root / "etc/ld.so.conf").write_text(f"{LIB64}\n{LIB32}\n")
    run_ldconfig(root)
    cache_file = root / "etc/ld.so.cache"
    real = [(e.flags, e.key, e.value) for e in read_ldcache(cache_file).entries]
    filler = [
        (0x0303, f"libhost{i}.so.{i % 7}", f"/usr/lib/x86_64-linux-gnu/libhost{i}.so.{i % 7}") for i in range(2000)
    ]
    cache_file.write_bytes(write_cache(real + filler))

    conf = json.loads(DEFAULT_VOLUME_CONF.read_text())
    extra = sorted({f"{stem}.so" for stem, _, _ in LIBS_64} | {n.split(".so")[0] + ".so" for n, _ in GLVND})
    for volume in conf["volume"]:
        libs = volume["components"]["libraries"]
        libs += [name for name in extra if name not in libs]
    conf_file = work / "volume.conf"
    conf_file.write_text(json.dumps(conf))
    return root, conf_file, interceptor.result(), len(jobs)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(q / 100 * len(ordered) + 0.5) - 1))]


def timed(runs: int, setup: Callable[[], None], action: Callable[[], object]) -> list[float]:
    out = []
    for _ in range(runs):
        setup()
        start = time.perf_counter()
        action()
        out.append((time.perf_counter() - start) * 1000)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="bench-volume-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        root, conf, interceptor, count = make_driver(work)
        apparent = sum(p.stat().st_size for p in root.rglob("*.so*") if p.is_file() and not p.is_symlink())
        print(
            f"synthetic driver: {count} libraries ({apparent / MIB:.0f} MiB apparent, sparse), "
            f"cache of {len(read_ldcache(root / 'etc/ld.so.cache').entries)} entries, built in "
            f"{time.perf_counter() - t0:.1f} s"
        )
        base = work / "vdriver"
        proc = work / "proc"
        proc.mkdir()

        def fresh() -> None:
            shutil.rmtree(base, ignore_errors=True)

        def mirror(hardlinks: bool) -> Callable[[], object]:
            return lambda: build_vdriver(
                volume_config=conf,
                base_dir_override=base,
                driver_root=root,
                share_mode=True,
                interceptor=interceptor,
                proc_root=proc,
                allow_hardlinks=hardlinks,
            )

        rows = [
            ("first mirror, hard links", timed(args.runs, fresh, mirror(True)), 1000.0),
            ("first mirror, copies (DaemonSet)", timed(args.runs, fresh, mirror(False)), 1000.0),
            ("no-op re-run (unchanged driver)", timed(args.runs, lambda: None, mirror(False)), 200.0),
        ]
        result = mirror(False)()
        assert not result.changed  # type: ignore[attr-defined]
        files = sum(v.files for v in result.volumes)  # type: ignore[attr-defined]
        links = sum(v.links for v in result.volumes)  # type: ignore[attr-defined]
        print(f"trees: nvidia + origin = {files} files, {links} symlinks; runs: {args.runs}")
        print(f"{'':36} {'median':>9} {'p99':>9} {'target':>9}")
        for label, values, target in rows:
            med, p99 = statistics.median(values), percentile(values, 99)
            verdict = "ok" if p99 < target else "SLOW"
            print(f"{label:36} {med:7.1f}ms {p99:7.1f}ms {target:7.0f}ms  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
