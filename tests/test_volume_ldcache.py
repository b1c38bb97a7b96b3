"""ld.so.cache reader: real caches from ldconfig in every format, hand-made ones, damage and fuzzing."""

from __future__ import annotations

import random
import re
import subprocess
from pathlib import Path

import pytest

from gpumanager.volume import VolumeError
from gpumanager.volume.ldcache import CacheArch, host_lib_dirs, parse_ldcache, read_ldcache
from tests.volume_fixtures import LDCONFIG, V1, DriverStore, driver_store, install_driver, write_cache

__all__ = ["driver_store"]

_P_LINE = re.compile(r"^\t(\S+) \(([^)]*)\) => (\S+)$")


def ldconfig_print(cache: Path) -> list[tuple[str, str, str]]:
    """``ldconfig -p`` of a cache: (key, description, value) in cache order."""
    out = subprocess.run([LDCONFIG, "-p", "-C", str(cache)], check=True, capture_output=True, text=True).stdout
    return [m.groups() for line in out.splitlines() if (m := _P_LINE.match(line))]  # type: ignore[misc]


def _arch_of(description: str) -> CacheArch:
    if "x86-64" in description:
        return CacheArch.X86_64
    if "x32" in description:
        return CacheArch.X32
    return CacheArch.I386


@pytest.fixture(scope="module")
def driver_root(driver_store: DriverStore, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ldcache-root")
    install_driver(driver_store, root, V1, ldconfig=False)
    return root


# "old" alone is not written with the real ldconfig: glibc 2.36's old-only writer corrupts keys and
# aborts; old-only caches are covered by the hand-made ones below.
@pytest.mark.parametrize("fmt", ["new", "compat"])
def test_real_ldconfig_cache_reads_like_ldconfig_p(driver_root: Path, fmt: str) -> None:
    cache_file = driver_root / f"etc/ld.so.cache.{fmt}"
    subprocess.run(
        [LDCONFIG, "-c", fmt, "-r", str(driver_root), "-f", "/etc/ld.so.conf", "-C", f"/etc/ld.so.cache.{fmt}"],
        check=True,
        capture_output=True,
    )
    cache = read_ldcache(cache_file)
    assert cache.format == fmt
    expected = ldconfig_print(cache_file)
    assert [(e.key, e.value) for e in cache.entries] == [(k, v) for k, _, v in expected]
    assert [e.arch for e in cache.entries] == [_arch_of(d) for _, d, _ in expected]
    by_value = {e.value: e for e in cache.entries}
    cuda64 = by_value["/lib/x86_64-linux-gnu/libcuda.so.1"]
    assert (cuda64.arch, cuda64.bits, cuda64.is_elf) == (CacheArch.X86_64, 64, True)
    cuda32 = by_value["/usr/lib/i386-linux-gnu/libcuda.so.1"]
    assert (cuda32.arch, cuda32.bits) == (CacheArch.I386, 32)
    cudax32 = by_value["/usr/libx32/libcuda.so.1"]
    assert (cudax32.arch, cudax32.bits) == (CacheArch.X32, 32)


def test_hand_made_formats_and_foreign_architectures(tmp_path: Path) -> None:
    entries = [
        (0x0303, "libcuda.so.1", "/usr/lib64/libcuda.so.1"),
        (0x0003, "libcuda.so.1", "/usr/lib/libcuda.so.1"),
        (0x0803, "libcuda.so.1", "/usr/libx32/libcuda.so.1"),
        (0x0503, "libcuda.so.1", "/usr/lib/powerpc64le-linux-gnu/libcuda.so.1"),
        (0x0A03, "libcuda.so.1", "/usr/lib/aarch64-linux-gnu/libcuda.so.1"),
        (0x7F03, "libodd.so.1", "/usr/lib/odd/libodd.so.1"),
        (0x0002, "libc5.so.1", "/usr/lib/libc5.so.1"),
    ]
    for fmt in ("new", "old", "compat"):
        path = tmp_path / f"cache.{fmt}"
        path.write_bytes(write_cache(entries, fmt=fmt))
        cache = read_ldcache(path)
        assert cache.format == fmt
        assert [(e.flags, e.key, e.value) for e in cache.entries] == entries
        assert [e.arch for e in cache.entries] == [
            CacheArch.X86_64,
            CacheArch.I386,
            CacheArch.X32,
            CacheArch.PPC64,
            CacheArch.AARCH64,
            CacheArch.UNKNOWN,
            CacheArch.I386,
        ]
        assert [e.bits for e in cache.entries] == [64, 32, 32, 64, 64, None, 32]
        assert [e.is_elf for e in cache.entries] == [True] * 6 + [False]


def test_host_arch_decides_which_entries_are_used() -> None:
    assert host_lib_dirs("x86_64") == {CacheArch.X86_64: "lib64", CacheArch.I386: "lib"}
    assert host_lib_dirs("amd64") == host_lib_dirs("x86_64")
    assert host_lib_dirs("aarch64") == {CacheArch.AARCH64: "lib64"}
    assert host_lib_dirs("ppc64le") == {CacheArch.PPC64: "lib64"}
    with pytest.raises(VolumeError, match="s390x"):
        host_lib_dirs("s390x")


def test_big_endian_cache_is_rejected_as_foreign(tmp_path: Path) -> None:
    entries = [(0x0503, "libcuda.so.1", "/usr/lib64/libcuda.so.1")] * 3
    path = tmp_path / "ld.so.cache"
    path.write_bytes(write_cache(entries, byteorder="big"))
    with pytest.raises(VolumeError, match=r"ld\.so\.cache .*foreign.*big-endian"):
        read_ldcache(path)
    # An old writer that left the byte-order flag unset: the counts give it away.
    path.write_bytes(write_cache(entries, byteorder="big", endian_flag=0))
    with pytest.raises(VolumeError, match="foreign"):
        read_ldcache(path)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "truncated"),
        (b"glibc-ld.so", "truncated"),
        (b"ld.so-1.7.0\0\x01", "truncated"),
        (b"\x7fELF\x02\x01\x01" + b"\0" * 60, "not an ld.so.cache"),
        (b"glibc-ld.so.cache1.0" + b"\0" * 40, "unsupported version"),
    ],
)
def test_bad_files_give_clear_errors(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "etc-ld.so.cache"
    path.write_bytes(data)
    with pytest.raises(VolumeError, match=message) as err:
        read_ldcache(path)
    assert str(path) in str(err.value)


def test_truncated_tables_and_strings(tmp_path: Path) -> None:
    entries = [(0x0303, f"libnvidia-{i}.so.1", f"/usr/lib64/libnvidia-{i}.so.1") for i in range(20)]
    for fmt in ("new", "old", "compat"):
        data = write_cache(entries, fmt=fmt)
        for cut in (len(data) // 3, len(data) // 2, len(data) - 5):
            with pytest.raises(VolumeError, match="truncated") as err:
                parse_ldcache(data[:cut], tmp_path / fmt)
            assert str(tmp_path / fmt) in str(err.value)


def test_missing_cache_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(VolumeError, match=f"cannot read ld.so.cache {tmp_path}/nope"):
        read_ldcache(tmp_path / "nope")


def test_fuzzed_caches_never_crash(driver_root: Path) -> None:
    """Random truncations and byte changes: a cache or a VolumeError, never another exception."""
    subprocess.run(
        [LDCONFIG, "-c", "compat", "-r", str(driver_root), "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache.fuzz"],
        check=True,
        capture_output=True,
    )
    seeds = [
        (driver_root / "etc/ld.so.cache.fuzz").read_bytes(),
        write_cache([(0x0303, "libcuda.so.1", "/usr/lib64/libcuda.so.1")] * 5, fmt="old"),
        write_cache([(0x0303, "libcuda.so.1", "/usr/lib64/libcuda.so.1")] * 5, fmt="new"),
    ]
    rng = random.Random(1234)
    outcomes = {"ok": 0, "error": 0}
    for _ in range(1500):
        data = bytearray(rng.choice(seeds))
        if rng.random() < 0.5:
            del data[rng.randrange(len(data) + 1) :]
        for _ in range(rng.randrange(0, 6)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            parse_ldcache(bytes(data), Path("/fuzz/ld.so.cache"))
            outcomes["ok"] += 1
        except VolumeError as err:
            assert "/fuzz/ld.so.cache" in str(err)
            outcomes["error"] += 1
    assert outcomes["ok"] > 0 and outcomes["error"] > 0
