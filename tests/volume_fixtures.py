"""Fake NVIDIA driver roots for the driver-mirror tests and benchmark.

Libraries are real ELF shared objects built with gcc (64-bit, ``-m32`` and ``-mx32``), with
sonames, DT_NEEDED entries and ``.note.ABI-tag`` notes; the cache is written by the real
``ldconfig -r <root>``. Hand-made caches (old format, foreign architectures, big-endian) come
from :func:`write_cache`.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

LDCONFIG = shutil.which("ldconfig") or "/sbin/ldconfig"
CC = os.environ.get("CC", "gcc")
REPO = Path(__file__).resolve().parent.parent
DEFAULT_VOLUME_CONF = REPO / "deploy" / "volume.conf"

V1 = "550.54.15"
V2 = "560.35.03"
LIB64 = "/usr/lib/x86_64-linux-gnu"
LIB32 = "/usr/lib/i386-linux-gnu"
LIBX32 = "/usr/libx32"
MESA = "/usr/lib/x86_64-linux-gnu/mesa"
TLS_DIR = "/usr/lib/x86_64-linux-gnu/tls"

_SOURCE = """\
const char gm_marker[] = "{marker}";
int gm_{symbol}(void) {{ return {value}; }}
{note}
"""
_ABI_NOTE = """\
__asm__(".section .note.ABI-tag,\\"a\\",@note\\n.p2align 2\\n.long 4\\n.long 16\\n.long 1\\n"
        ".asciz \\"GNU\\"\\n.long 0, {0}, {1}, {2}\\n.previous\\n");
"""


@dataclass(frozen=True)
class Lib:
    """A library of the fake driver: where it lives (host path), its soname and what it needs."""

    host_path: str
    soname: str | None
    needed: tuple[str, ...] = ()
    bits: str = "64"  # "64", "32" or "x32"
    abi_tag: tuple[int, int, int] | None = None
    links: tuple[str, ...] = ()  # extra symlink names in the same directory (dev names)

    @property
    def name(self) -> str:
        return self.host_path.rsplit("/", 1)[-1]


def build_shared(
    out: Path,
    soname: str | None,
    *,
    marker: str,
    needed: Sequence[Path] = (),
    bits: str = "64",
    abi_tag: tuple[int, int, int] | None = None,
) -> Path:
    """Compile a shared object with gcc. ``needed`` are libraries linked in (they become DT_NEEDED)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_name(out.name + ".c")
    note = _ABI_NOTE.format(*abi_tag) if abi_tag else ""
    symbol = "".join(c if c.isalnum() else "_" for c in marker)
    src.write_text(_SOURCE.format(marker=marker, symbol=symbol, value=len(marker), note=note))
    cmd = [CC, "-shared", "-fPIC", "-O0", "-o", str(out), str(src)]
    if bits == "32":
        cmd += ["-m32", "-nostdlib"]
    elif bits == "x32":
        cmd += ["-mx32", "-nostdlib"]
    if soname:
        cmd.append(f"-Wl,-soname,{soname}")
    if needed:
        cmd += ["-Wl,--no-as-needed", *map(str, needed)]
    subprocess.run(cmd, check=True, capture_output=True)
    src.unlink()
    return out


def build_executable(out: Path, marker: str) -> Path:
    """Compile a small executable."""
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_name(out.name + ".c")
    src.write_text(f'#include <stdio.h>\nint main(void) {{ puts("{marker}"); return 0; }}\n')
    subprocess.run([CC, "-O0", "-o", str(out), str(src)], check=True, capture_output=True)
    src.unlink()
    return out


def driver_libs(version: str) -> list[Lib]:
    """The libraries of a fake driver ``version``: NVIDIA's names, GLVND, a Mesa libGL, 32-bit and x32."""
    v = version
    gld = "libGLdispatch.so.0"
    return [
        Lib(f"{LIB64}/libcuda.so.{v}", "libcuda.so.1", links=("libcuda.so",)),
        Lib(f"{LIB64}/libnvidia-ml.so.{v}", "libnvidia-ml.so.1", links=("libnvidia-ml.so",)),
        Lib(f"{LIB64}/libnvidia-ptxjitcompiler.so.{v}", "libnvidia-ptxjitcompiler.so.1"),
        Lib(f"{LIB64}/libnvidia-opencl.so.{v}", "libnvidia-opencl.so.1"),
        Lib(f"{LIB64}/libnvcuvid.so.{v}", "libnvcuvid.so.1"),
        Lib(f"{LIB64}/libnvidia-encode.so.{v}", "libnvidia-encode.so.1"),
        Lib(f"{LIB64}/libnvidia-fbc.so.{v}", "libnvidia-fbc.so.1"),
        Lib(f"{LIB64}/libnvidia-gpucomp.so.{v}", f"libnvidia-gpucomp.so.{v}"),
        Lib(f"{LIB64}/libnvidia-glcore.so.{v}", f"libnvidia-glcore.so.{v}"),
        Lib(f"{LIB64}/libnvidia-eglcore.so.{v}", f"libnvidia-eglcore.so.{v}"),
        Lib(f"{LIB64}/libnvidia-glsi.so.{v}", f"libnvidia-glsi.so.{v}"),
        Lib(f"{LIB64}/libnvidia-tls.so.{v}", f"libnvidia-tls.so.{v}", abi_tag=(2, 3, 99)),
        Lib(f"{TLS_DIR}/libnvidia-tls.so.{v}", f"libnvidia-tls.so.{v}", abi_tag=(2, 6, 0)),
        Lib(f"{LIB64}/libGLX_nvidia.so.{v}", "libGLX_nvidia.so.0", needed=(f"libnvidia-glcore.so.{v}",)),
        Lib(f"{LIB64}/libEGL_nvidia.so.{v}", "libEGL_nvidia.so.0", needed=(f"libnvidia-eglcore.so.{v}",)),
        Lib(f"{LIB64}/libGLESv2_nvidia.so.{v}", "libGLESv2_nvidia.so.2"),
        Lib(f"{LIB64}/libvdpau_nvidia.so.{v}", "libvdpau_nvidia.so.1"),
        # GLVND: kept because they need libGLdispatch.
        Lib(f"{LIB64}/libGLdispatch.so.0", gld),
        Lib(f"{LIB64}/libGL.so.1.7.0", "libGL.so.1", needed=(gld,)),
        Lib(f"{LIB64}/libEGL.so.1.1.0", "libEGL.so.1", needed=(gld,)),
        Lib(f"{LIB64}/libGLX.so.0", "libGLX.so.0", needed=(gld,)),
        # Mesa's libGL: not NVIDIA's, blacklisted.
        Lib(f"{MESA}/libGL.so.1.2.0", "libGL.so.1", needed=("libglapi.so.0",)),
        # 32-bit and x32.
        Lib(f"{LIB32}/libcuda.so.{v}", "libcuda.so.1", bits="32"),
        Lib(f"{LIB32}/libnvidia-ml.so.{v}", "libnvidia-ml.so.1", bits="32"),
        Lib(f"{LIB32}/libGLX_nvidia.so.{v}", "libGLX_nvidia.so.0", bits="32"),
        Lib(f"{LIBX32}/libcuda.so.{v}", "libcuda.so.1", bits="x32"),
    ]


BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control")


@dataclass
class DriverStore:
    """Prebuilt files of fake drivers, built once per session and hard-linked into test roots."""

    path: Path
    files: dict[str, Path] = field(default_factory=dict)  # "<version>:<host path>" -> built file

    def build(self, versions: Iterable[str], extra_interceptors: int = 2) -> DriverStore:
        stubs = self.path / "stubs"
        stub_names = {"libglapi.so.0"}
        jobs: list[tuple[str, Lib]] = []
        for version in versions:
            jobs += [(version, lib) for lib in driver_libs(version)]
            stub_names |= {n for _, lib in jobs for n in lib.needed}
        with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
            list(pool.map(lambda n: build_shared(stubs / n, n, marker=f"stub {n}"), sorted(stub_names)))
            futures = {
                f"{version}:{lib.host_path}": pool.submit(
                    build_shared,
                    self.path / version / lib.host_path.lstrip("/"),
                    lib.soname,
                    marker=f"{lib.name} {version} {lib.bits} {lib.host_path}",
                    needed=[stubs / n for n in lib.needed],
                    bits=lib.bits,
                    abi_tag=lib.abi_tag,
                )
                for version, lib in jobs
            }
            for version in versions:
                futures[f"{version}:exe"] = pool.submit(
                    build_executable, self.path / version / "exe", f"tool {version}"
                )
            for i in range(extra_interceptors):
                name = f"libcuda-control-{i}.so"
                futures[f"interceptor:{i}"] = pool.submit(
                    build_shared, self.path / "interceptor" / name, "libcuda-control.so", marker=f"interceptor {i}"
                )
            futures["interceptor32"] = pool.submit(
                build_shared, self.path / "interceptor" / "libcuda-control-32.so", "libcuda-control.so",
                marker="interceptor 32", bits="32",
            )  # fmt: skip
            self.files = {key: f.result() for key, f in futures.items()}
        return self

    def interceptor(self, index: int = 0) -> Path:
        return self.files[f"interceptor:{index}"]


def install_driver(store: DriverStore, root: Path, version: str = V1, *, ldconfig: bool = True) -> None:
    """Lay a fake driver out under ``root`` (a host ``/``) as the NVIDIA installer would, then run ldconfig.

    Also: a merged-/usr ``/lib64`` absolute symlink, binaries on ``/usr/bin`` reached through
    relative and absolute symlinks, a shell-script ``nvidia-cuda-mps-server`` (not ELF) and no
    ``gpu-client``.
    """
    for lib in driver_libs(version):
        dst = root / lib.host_path.lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        _replace_link(store.files[f"{version}:{lib.host_path}"], dst)
        for name in (lib.soname, *lib.links):
            if name and name != lib.name:
                _symlink(lib.name, dst.parent / name)
    exe = store.files[f"{version}:exe"]
    bin_dir = root / "usr/bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    _replace_link(exe, bin_dir / "nvidia-smi")
    # relative symlink into another directory
    _replace_link(exe, root / "usr/lib/nvidia/nvidia-debugdump")
    _symlink("../lib/nvidia/nvidia-debugdump", bin_dir / "nvidia-debugdump")
    # absolute symlink: must resolve inside the root, not on the machine running the test
    _replace_link(exe, root / "opt/nvidia/bin/nvidia-persistenced")
    _symlink("/opt/nvidia/bin/nvidia-persistenced", bin_dir / "nvidia-persistenced")
    _replace_link(exe, root / "usr/sbin/nvidia-cuda-mps-control")
    script = bin_dir / "nvidia-cuda-mps-server"
    if not script.exists():
        script.write_text("#!/bin/sh\nexit 0\n")
        script.chmod(0o755)
    # merged /usr: /lib -> usr/lib (relative), /lib64 -> /usr/lib64 (absolute)
    _symlink("usr/lib", root / "lib")
    (root / "usr/lib64").mkdir(parents=True, exist_ok=True)
    _symlink("/usr/lib64", root / "lib64")
    (root / "etc").mkdir(parents=True, exist_ok=True)
    (root / "etc/ld.so.conf").write_text(
        "\n".join(["/usr/local/lib", MESA, TLS_DIR, "/lib/x86_64-linux-gnu", LIB32, LIBX32, "/lib64"]) + "\n"
    )
    if ldconfig:
        run_ldconfig(root)


def remove_driver(root: Path, version: str) -> None:
    """Uninstall ``version``'s libraries (as an upgrade does: files unlinked, never rewritten)."""
    for lib in driver_libs(version):
        (root / lib.host_path.lstrip("/")).unlink(missing_ok=True)


def remove_libcuda(root: Path, *dirs: str, version: str = V1) -> None:
    """Uninstall ``libcuda`` (file and links) from the host directories ``dirs``, then run ldconfig."""
    for directory in dirs:
        for name in (f"libcuda.so.{version}", "libcuda.so.1", "libcuda.so"):
            (root / directory.lstrip("/") / name).unlink(missing_ok=True)
    run_ldconfig(root)


def run_ldconfig(root: Path) -> None:
    """Rebuild ``root``'s ``/etc/ld.so.cache`` with the real ldconfig."""
    subprocess.run(
        [LDCONFIG, "-r", str(root), "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache"],
        check=True,
        capture_output=True,
    )


def _replace_link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists() or dst.is_symlink():
        dst.unlink()
    os.link(src, dst)


def _symlink(target: str, link: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, link)


# ---- hand-made caches ---------------------------------------------------------------------


def write_cache(
    entries: Sequence[tuple[int, str, str]],
    *,
    fmt: str = "new",
    byteorder: str = "little",
    endian_flag: int | None = None,
) -> bytes:
    """Bytes of an ld.so.cache holding ``(flags, key, value)`` entries.

    ``fmt``: ``new``, ``old`` or ``compat`` (old table followed by a new cache). ``byteorder`` of
    the integers; ``endian_flag`` overrides the new header's byte-order byte (default: matching).
    """
    e = "<" if byteorder == "little" else ">"
    if endian_flag is None:
        endian_flag = 2 if byteorder == "little" else 3
    strings = bytearray()
    offsets: dict[str, int] = {}

    def add(s: str) -> int:
        if s not in offsets:
            offsets[s] = len(strings)
            strings.extend(s.encode() + b"\0")
        return offsets[s]

    for _, key, value in entries:
        add(key)
        add(value)
    n = len(entries)
    new_head = 48 + 24 * n

    def new_part() -> bytes:
        head = struct.pack(e + "17s3sIIB3xI12x", b"glibc-ld.so.cache", b"1.1", n, len(strings), endian_flag, 0)
        table = b"".join(
            struct.pack(e + "iIIIQ", flags, new_head + offsets[k], new_head + offsets[v], 0, 0)
            for flags, k, v in entries
        )
        return head + table + bytes(strings)

    if fmt == "new":
        return new_part()
    old_table = b"".join(struct.pack(e + "iII", flags, offsets[k], offsets[v]) for flags, k, v in entries)
    old = b"ld.so-1.7.0\0" + struct.pack(e + "I", n) + old_table
    if fmt == "old":
        return old + bytes(strings)
    pad = b"\0" * (-len(old) % 8)
    return old + pad + new_part()


# ---- a process that keeps a library mapped -------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import ctypes, hashlib, mmap, sys
    paths = sys.argv[1:]
    libs = [ctypes.CDLL(p) for p in paths]          # mapped by the dynamic loader
    maps = []
    for p in paths:
        with open(p, "rb") as f:
            maps.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
    print("ready", flush=True)
    for line in sys.stdin:
        print(" ".join(hashlib.sha256(m[:]).hexdigest() for m in maps), flush=True)
    """
)


class MappingChild:
    """A child process that dlopens and mmaps files and stays alive until closed."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, *map(str, paths)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.close()
            raise RuntimeError(f"mapping child failed to start: {line!r}")

    def hashes(self) -> list[str]:
        """sha256 of each mapping's bytes, as the child reads them now."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("hash\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().split()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=10)

    def __enter__(self) -> MappingChild:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.close()


def snapshot(base: Path) -> dict[str, tuple[int, int, str]]:
    """Every path under ``base``: (inode, mtime_ns, link target or '') — to prove that nothing changed."""
    out: dict[str, tuple[int, int, str]] = {}
    for directory, dirs, files in os.walk(base):
        for name in dirs + files:
            p = os.path.join(directory, name)
            st = os.lstat(p)
            target = os.readlink(p) if os.path.islink(p) else ""
            out[os.path.relpath(p, base)] = (st.st_ino, st.st_mtime_ns, target)
    st = os.lstat(base)
    out["."] = (st.st_ino, st.st_mtime_ns, "")
    return out


# ---- pytest fixtures (import them into a test module to use them) ------------------------------

_STORE: DriverStore | None = None


@pytest.fixture(scope="session")
def driver_store(tmp_path_factory: pytest.TempPathFactory) -> DriverStore:
    """Both fake drivers (V1, V2) and two interceptors, built once per session."""
    global _STORE
    if _STORE is None:
        _STORE = DriverStore(tmp_path_factory.mktemp("driver-store")).build([V1, V2])
    return _STORE
