"""Driver mirror on real-host corner cases: the volume base's mode, old-format caches listing
glibc-hwcaps builds."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from gpumanager.volume import VolumeError, build_vdriver
from gpumanager.volume.ldcache import MAX_CACHE_BYTES, read_ldcache
from tests.volume_fixtures import (
    DEFAULT_VOLUME_CONF,
    LIB64,
    V1,
    DriverStore,
    driver_store,  # noqa: F401  (pytest fixture)
    install_driver,
    write_cache,
)

X86_64_LIBC6 = 0x0303


def _conf(path: Path, base: Path) -> Path:
    conf = json.loads(DEFAULT_VOLUME_CONF.read_text())
    for volume in conf["volume"]:
        volume["base"] = str(base)
    path.write_text(json.dumps(conf))
    return path


def test_an_existing_base_keeps_its_mode(tmp_path: Path, driver_store: DriverStore) -> None:  # noqa: F811
    """A volume base that already exists (a shared directory such as /var/tmp, mode 1777) is not
    chmod-ed: containers mount the trees, never the base, and the host's directory stays as it was."""
    root = tmp_path / "host"
    install_driver(driver_store, root)
    base = tmp_path / "shared"
    base.mkdir()
    os.chmod(base, 0o1777)
    build_vdriver(
        volume_config=_conf(tmp_path / "volume.conf", base), driver_root=root, share_mode=False, interceptor=None
    )
    assert stat.S_IMODE(os.stat(base).st_mode) == 0o1777
    # the directories the mirror creates are readable by every container user, whatever the umask
    trees = base / ".trees"
    assert stat.S_IMODE(os.stat(trees).st_mode) == 0o755
    assert (base / "origin" / "lib64" / "libcuda.so.1").exists()


def test_a_base_the_mirror_creates_is_0755_whatever_the_umask(tmp_path: Path, driver_store: DriverStore) -> None:  # noqa: F811
    root = tmp_path / "host"
    install_driver(driver_store, root)
    base = tmp_path / "new" / "vdriver"
    old = os.umask(0o077)
    try:
        build_vdriver(
            volume_config=_conf(tmp_path / "volume.conf", base), driver_root=root, share_mode=False, interceptor=None
        )
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(base).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(base / ".trees").st_mode) == 0o755


def test_an_old_format_cache_listing_a_glibc_hwcaps_build_first_gets_the_plain_build(
    tmp_path: Path,
    driver_store: DriverStore,  # noqa: F811
) -> None:
    """An old-format cache (``ldconfig -c old``) has no hwcap field: glibc 2.33+ still lists the
    builds of ``glibc-hwcaps/x86-64-v3/`` in it, before the plain one. The mirror flattens
    directories, so it must take the plain build, which runs on every CPU, as it does with a
    new-format cache."""
    root = tmp_path / "host"
    install_driver(driver_store, root)
    plain = root / LIB64.lstrip("/") / f"libcuda.so.{V1}"
    hwcaps_dir = root / LIB64.lstrip("/") / "glibc-hwcaps" / "x86-64-v3"
    hwcaps_dir.mkdir(parents=True)
    (hwcaps_dir / f"libcuda.so.{V1}").write_bytes(plain.read_bytes() + b"built for x86-64-v3")
    (root / "etc/ld.so.cache").write_bytes(
        write_cache(
            [
                (X86_64_LIBC6, "libcuda.so.1", f"{LIB64}/glibc-hwcaps/x86-64-v3/libcuda.so.{V1}"),
                (X86_64_LIBC6, "libcuda.so.1", f"{LIB64}/libcuda.so.1"),
                (X86_64_LIBC6, "libnvidia-ml.so.1", f"{LIB64}/libnvidia-ml.so.1"),
            ],
            fmt="old",
        )
    )
    result = build_vdriver(
        volume_config=_conf(tmp_path / "volume.conf", tmp_path / "vdriver"),
        driver_root=root,
        share_mode=False,
        interceptor=None,
    )
    origin = next(v for v in result.volumes if v.name == "origin").tree
    assert (origin / "lib64" / f"libcuda.so.{V1}").read_bytes() == plain.read_bytes()
    assert not any("already comes from" in w for w in result.warnings), result.warnings


def test_the_agents_own_files_are_readable_by_every_container_user(
    tmp_path: Path,
    driver_store: DriverStore,  # noqa: F811
) -> None:
    """The interceptor and gpu-client are copied from the agent's image: one installed 0700 (a
    custom image built under umask 077) would leave libcuda.so.1 unreadable to a container running
    as a non-root user, whose CUDA then finds no driver. In the tree they are 0755."""
    root = tmp_path / "host"
    install_driver(driver_store, root)
    own = tmp_path / "image"
    own.mkdir()
    interceptor = own / "libcuda-control.so"
    interceptor.write_bytes(driver_store.interceptor(0).read_bytes())
    client = own / "gpu-client"
    client.write_bytes(driver_store.files[f"{V1}:exe"].read_bytes())
    for path in (interceptor, client):
        os.chmod(path, 0o700)
    result = build_vdriver(
        volume_config=_conf(tmp_path / "volume.conf", tmp_path / "vdriver"),
        driver_root=root,
        share_mode=True,
        interceptor=interceptor,
        gpu_client=client,
    )
    assert result.share_problem == ""
    tree = next(v for v in result.volumes if v.name == "nvidia").tree
    for rel in ("lib64/libcuda-control.so", "lib64/libcuda.so.1", "lib64/libnvidia-ml.so.1", "bin/gpu-client"):
        assert stat.S_IMODE(os.stat(tree / rel).st_mode) == 0o755, rel
    # the agent's files themselves are left as they are
    assert stat.S_IMODE(os.stat(interceptor).st_mode) == 0o700


def test_a_cache_that_is_no_regular_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    """/etc/ld.so.cache as a FIFO (or a device): reading it would block the agent's start until
    some writer came, or never end; it is refused, naming the file."""
    fifo = tmp_path / "ld.so.cache"
    os.mkfifo(fifo)
    stop = threading.Event()

    def writer() -> None:  # lets a reader that opened the FIFO see its end instead of hanging
        while not stop.is_set():
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                stop.wait(0.01)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        with pytest.raises(VolumeError, match="not a regular file") as err:
            read_ldcache(fifo)
    finally:
        stop.set()
        thread.join()
    assert str(fifo) in str(err.value)


def test_a_cache_far_larger_than_any_real_one_is_refused_without_reading_it(tmp_path: Path) -> None:
    cache = tmp_path / "ld.so.cache"
    with cache.open("wb") as stream:
        stream.truncate(MAX_CACHE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(VolumeError, match=f"{MAX_CACHE_BYTES + 1} bytes") as err:
        read_ldcache(cache)
    assert str(cache) in str(err.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [("name", "nvidia\ud800"), ("base", "/etc/gpu-manager/vdriver\ud800"), ("binaries", "nvidia-smi\udfff")],
)
def test_a_volume_conf_value_no_file_name_can_hold_is_named(
    tmp_path: Path,
    driver_store: DriverStore,  # noqa: F811
    field: str,
    value: str,
) -> None:
    """JSON can carry a lone surrogate (``"\\ud800"``), which no path can: the error names the
    file and the value, instead of a UnicodeEncodeError traceback from deep inside the mirror."""
    conf = json.loads(DEFAULT_VOLUME_CONF.read_text())
    volume = conf["volume"][0]
    volume["base"] = str(tmp_path / "vdriver")
    if field == "binaries":
        volume["components"]["binaries"].append(value)
    else:
        volume[field] = value
    path = tmp_path / "volume.conf"
    path.write_text(json.dumps(conf))  # ensure_ascii: written as the escape \ud800
    root = tmp_path / "host"
    install_driver(driver_store, root)
    with pytest.raises(VolumeError) as err:
        build_vdriver(volume_config=path, driver_root=root, share_mode=False, interceptor=None)
    assert str(path) in str(err.value)
    assert repr(value) in str(err.value)
