"""The driver mirror while a driver is being installed, and ld.so.cache entries glibc's loader reads
differently from the whole file: flags bits and string offsets."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from pathlib import Path

import pytest

import simnode.simhost as simhost
from gpumanager.volume.errors import VolumeError
from gpumanager.volume.keeper import MirrorKeeper
from gpumanager.volume.ldcache import read_ldcache
from gpumanager.volume.manager import build_vdriver
from tests.volume_fixtures import DEFAULT_VOLUME_CONF, build_shared, write_cache

V_OLD = "550.54.15"
V_NEW = "560.35.03"
SETTLE = 60.0
RETRY = 7.0
PERIOD = 300.0

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


class Host:
    """A simulated host (simnode.simhost) with two driver versions built, and a keeper on a fake clock."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        repo = tmp / "repo"
        monkeypatch.setattr(simhost, "repo_root", lambda: repo)
        for version in (V_OLD, V_NEW):
            for name in simhost.SIM_LIBRARIES:
                out = repo / "vcuda" / "build" / "sim" / f"{name}.so.{version}"
                soname = f"{name}.so.1"
                build_shared(out, soname, marker=f"{name} {version}")
        self.root = tmp / "host"
        self.base = tmp / "vdriver"
        conf = json.loads(DEFAULT_VOLUME_CONF.read_text())
        for volume in conf["volume"]:
            volume["base"] = str(self.base)
        self.conf = tmp / "volume.conf"
        self.conf.write_text(json.dumps(conf))
        self.interceptor = build_shared(tmp / "libcuda-control.so", "libcuda-control.so", marker="interceptor")
        self.proc = tmp / "proc"
        self.proc.mkdir()
        self.now = 0.0
        self.keeper = MirrorKeeper(
            volume_config=str(self.conf),
            driver_root=str(self.root),
            share_mode=True,
            interceptor=str(self.interceptor),
            proc_root=str(self.proc),
            period=PERIOD,
            retry=RETRY,
            settle=SETTLE,
            clock=lambda: self.now,
        )

    def last_change(self) -> float:
        """The latest mtime or ctime of the driver's files, their directory and the cache (seconds):
        a time after it counts as "now" right after the last change."""
        libdir = self.root / simhost.LIB_DIR
        paths = [libdir, self.root / "etc/ld.so.cache", *libdir.iterdir()]
        return max(max(st.st_mtime_ns, st.st_ctime_ns) for st in map(os.stat, paths)) / 1e9

    def published(self, volume: str = "nvidia") -> Path:
        return (self.base / volume).resolve()

    def versions_in(self, volume: str = "nvidia") -> set[str]:
        return {p.name.split(".so.", 1)[1] for p in (self.published(volume) / "lib64").glob("lib*.so.*.*")}


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Host:
    return Host(tmp_path, monkeypatch)


@needs_gcc
def test_a_half_installed_driver_is_not_published_and_is_checked_again_soon(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """New libnvidia-ml laid down, libcuda still the old one, ldconfig not yet run: the tree
    published before stays, the keeper looks again after the short retry, and says so once."""
    simhost.install_sim_driver(host.root, V_OLD)
    host.now = host.last_change() + 1
    assert host.keeper.build() and host.keeper.next_check == PERIOD
    before = host.published()
    assert host.versions_in() == {V_OLD}

    simhost.install_sim_driver(host.root, V_NEW, libraries=["libnvidia-ml"], ldconfig=False)
    host.now = host.last_change() + 1
    caplog.clear()
    assert host.keeper.build()
    assert host.published() == before and host.published("origin").name.startswith("origin-")
    assert host.versions_in() == {V_OLD} and host.versions_in("origin") == {V_OLD}
    assert host.keeper.next_check == RETRY
    assert host.keeper.share_problem == ""
    assert host.keeper.nvidia == str(host.base / "nvidia")
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, warned
    for part in (f"libcuda.so.{V_OLD}", f"libnvidia-ml.so.{V_NEW}", V_OLD, V_NEW, "half-installed"):
        assert part in warned[0]

    host.now += RETRY  # still within the settle time: still waiting, not said again
    assert host.keeper.build() and host.published() == before and host.keeper.next_check == RETRY
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1

    simhost.install_sim_driver(host.root, V_NEW)  # the install completes: ldconfig runs last
    host.now = host.last_change() + 1
    assert host.keeper.build()
    assert host.published() != before and host.versions_in() == {V_NEW} and host.versions_in("origin") == {V_NEW}
    assert host.keeper.next_check == PERIOD and host.keeper.install_in_progress == ""


@needs_gcc
def test_the_cache_rebuilt_before_every_library_is_written_is_waited_for(host: Host) -> None:
    """A package manager that runs ldconfig between packages: libcuda is new and listed, the new
    libnvidia-ml not written yet; then it is written after the cache."""
    simhost.install_sim_driver(host.root, V_OLD)
    host.now = host.last_change() + 1
    assert host.keeper.build()
    before = host.published()
    simhost.install_sim_driver(host.root, V_NEW, libraries=["libcuda"])  # ldconfig runs
    host.now = host.last_change() + 1
    assert host.keeper.build() and host.published() == before and host.keeper.next_check == RETRY

    # all files of one version now, but one was written after the cache (its mtime later than the cache's)
    simhost.install_sim_driver(host.root, V_NEW, libraries=["libnvidia-ml"], ldconfig=False)
    cache = host.root / "etc/ld.so.cache"
    lib = host.root / simhost.LIB_DIR / f"libnvidia-ml.so.{V_NEW}"
    os.utime(cache, ns=(cache.stat().st_atime_ns, lib.stat().st_mtime_ns - 5_000_000_000))
    host.now = host.last_change() + 1
    assert host.keeper.build() and host.published() == before
    assert "changed after" in host.keeper.install_in_progress and str(lib.name) in host.keeper.install_in_progress


@needs_gcc
def test_a_half_installed_driver_left_alone_is_mirrored_with_a_warning(host: Host) -> None:
    """No change for the settle time: it is the host's state (its processes see it too)."""
    simhost.install_sim_driver(host.root, V_OLD)
    simhost.install_sim_driver(host.root, V_NEW, libraries=["libnvidia-ml"], ldconfig=False)
    host.now = host.last_change() + SETTLE + 1
    assert host.keeper.build() and host.keeper.next_check == PERIOD
    assert host.versions_in() == {V_OLD, V_NEW}
    result = build_vdriver(
        volume_config=host.conf,
        driver_root=host.root,
        share_mode=True,
        interceptor=host.interceptor,
        proc_root=host.proc,
        now=host.now,
        settle_seconds=SETTLE,
    )
    assert result.install_in_progress == ""
    assert any("several driver versions" in w and f"libnvidia-ml.so.{V_NEW}" in w for w in result.warnings)


@needs_gcc
def test_a_first_build_during_an_install_publishes_nothing(host: Host) -> None:
    simhost.install_sim_driver(host.root, V_OLD)
    simhost.install_sim_driver(host.root, V_NEW, libraries=["libcuda"], ldconfig=False)
    host.now = host.last_change() + 1
    assert host.keeper.build() is False
    assert "driver install in progress" in host.keeper.error
    assert not (host.base / "nvidia").exists()
    assert "not built" in host.keeper.share_problem
    assert host.keeper.next_check == RETRY


# ---- ld.so.cache flags, as glibc's loader reads them -------------------------------------------


def test_entries_the_loader_passes_by_are_not_mirrored(tmp_path: Path) -> None:
    """glibc's _dl_cache_check_flags compares the whole flags word: FLAG_X8664_LIB64 with another
    type than FLAG_ELF_LIBC6, or with a bit outside the type and ABI bytes, is never loaded."""
    entries = [
        (0x0303, "libcuda.so.1", "/usr/lib64/libcuda.so.1"),  # FLAG_X8664_LIB64 | FLAG_ELF_LIBC6
        (0x0003, "libcuda.so.1", "/usr/lib/libcuda.so.1"),  # i386, FLAG_ELF_LIBC6
        (0x0001, "libnvidia-ml.so.1", "/usr/lib/libnvidia-ml.so.1"),  # i386, FLAG_ELF
        (0x10303, "libnvidia-ml.so.1", "/usr/lib64/odd/libnvidia-ml.so.1"),  # a bit above the ABI byte
        (0x0307, "libnvcuvid.so.1", "/usr/lib64/odd/libnvcuvid.so.1"),  # type 7
        (0x0301, "libnvidia-encode.so.1", "/usr/lib64/odd/libnvidia-encode.so.1"),  # x86-64 without LIBC6
        (-1, "libnvidia-fbc.so.1", "/usr/lib64/odd/libnvidia-fbc.so.1"),  # FLAG_ANY
    ]
    for fmt in ("new", "old", "compat"):
        path = tmp_path / f"cache.{fmt}"
        path.write_bytes(write_cache(entries, fmt=fmt))
        cache = read_ldcache(path)
        assert [(e.flags, e.key, e.value) for e in cache.entries] == entries
        assert [e.is_elf for e in cache.entries] == [True, True, True, False, False, False, False], fmt


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (0x02, None),  # little-endian
        (0x06, None),  # little-endian, and a bit for future use: ignored by glibc
        (0xFE, None),
        (0x07, "foreign"),  # big-endian with a future bit: still big-endian
        (0x05, "invalid byte order"),
        (0x04, "name no byte order"),  # not 0 (unknown), but no byte order either: glibc refuses it
    ],
)
def test_the_header_byte_order_is_read_from_its_two_bits(tmp_path: Path, flags: int, problem: str | None) -> None:
    path = tmp_path / "ld.so.cache"
    path.write_bytes(write_cache([(0x0303, "libcuda.so.1", "/usr/lib64/libcuda.so.1")], endian_flag=flags))
    if problem is None:
        assert [e.key for e in read_ldcache(path).entries] == ["libcuda.so.1"]
    else:
        with pytest.raises(VolumeError, match=problem):
            read_ldcache(path)


# ---- ld.so.cache entries with a bad string offset -----------------------------------------------


def _entry_at(data: bytes, fmt: str, index: int) -> int:
    """The byte offset of entry ``index`` of the table glibc's loader reads in a cache of ``fmt``."""
    if fmt == "old":
        return 16 + 12 * index
    (nlibs,) = struct.unpack_from("<I", data, 12)
    base = 0 if fmt == "new" else (16 + 12 * nlibs + 7) & ~7
    return base + 48 + 24 * index


def _break_string(data: bytes, fmt: str, index: int, field: str) -> bytes:
    """Point the key or value of entry ``index`` past the end of the file."""
    out = bytearray(data)
    struct.pack_into("<I", out, _entry_at(data, fmt, index) + (4 if field == "key" else 8), len(data) + 1000)
    return bytes(out)


@pytest.mark.parametrize("fmt", ["new", "compat"])
def test_an_entry_with_a_bad_string_offset_is_skipped_alone(tmp_path: Path, fmt: str) -> None:
    """The new format gives its string table's size: an entry pointing outside the file is its own fault."""
    entries = [(0x0303, f"libnvidia-{i}.so.1", f"/usr/lib64/libnvidia-{i}.so.1") for i in range(5)]
    data = _break_string(_break_string(write_cache(entries, fmt=fmt), fmt, 1, "key"), fmt, 3, "value")
    path = tmp_path / "ld.so.cache"
    path.write_bytes(data)
    cache = read_ldcache(path)
    assert [e.key for e in cache.entries] == ["libnvidia-0.so.1", "libnvidia-2.so.1", "libnvidia-4.so.1"]
    assert cache.skipped == 2
    # a header that announces more entries than the file holds is still the whole cache's error
    bad_header = bytearray(data)
    count_at = _entry_at(data, fmt, 0) - 48 + 20
    struct.pack_into("<I", bad_header, count_at, 10_000)
    path.write_bytes(bytes(bad_header))
    with pytest.raises(VolumeError, match="truncated or corrupt"):
        read_ldcache(path)


def test_the_old_format_cannot_tell_a_bad_offset_from_a_file_cut_short(tmp_path: Path) -> None:
    """It gives no string table size: a string past the end of the file may be a truncation."""
    entries = [(0x0303, f"libnvidia-{i}.so.1", f"/usr/lib64/libnvidia-{i}.so.1") for i in range(3)]
    path = tmp_path / "ld.so.cache"
    path.write_bytes(_break_string(write_cache(entries, fmt="old"), "old", 1, "key"))
    with pytest.raises(VolumeError, match=r"entry 1 key .* no terminated string"):
        read_ldcache(path)


@needs_gcc
def test_the_mirror_warns_once_about_skipped_entries_and_uses_the_rest(host: Host) -> None:
    simhost.install_sim_driver(host.root, V_OLD)
    cache_path = host.root / "etc/ld.so.cache"
    cache = read_ldcache(cache_path)
    index = next(i for i, e in enumerate(cache.entries) if e.key == "libnvidia-ml.so.1")
    cache_path.write_bytes(_break_string(cache_path.read_bytes(), cache.format, index, "value"))
    result = build_vdriver(
        volume_config=host.conf,
        driver_root=host.root,
        share_mode=False,
        interceptor=None,
        proc_root=host.proc,
    )
    assert result.driver_version is not None and result.driver_version.full == V_OLD
    origin = host.published("origin") / "lib64"
    assert (origin / f"libcuda.so.{V_OLD}").exists() and not list(origin.glob("libnvidia-ml*"))
    skipped = [w for w in result.warnings if "skipped, their string offsets" in w]
    assert skipped == [
        f"{cache_path}: 1 entry skipped, their string offsets leading outside the file (glibc's loader skips "
        "them too); the rest of the cache is used"
    ]
