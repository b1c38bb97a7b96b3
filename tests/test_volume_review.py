"""The driver mirror against host layouts: hwcaps subdirectories, umask, binary names, bad config values."""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from gpumanager.volume.errors import VolumeError
from gpumanager.volume.manager import build_vdriver

X86_64 = 0x0303  # libc6, x86-64
I386 = 0x0003  # libc6, default 32-bit ABI
GLIBC_HWCAPS = 1 << 62  # hwcap field: an entry of a glibc-hwcaps subdirectory


def make_elf(soname: str | None, *, bits: int = 64, payload: bytes = b"") -> bytes:
    """A minimal ELF shared object: one PT_LOAD over the file and a PT_DYNAMIC naming ``soname``."""
    strtab = b"\0"
    soname_at = 0
    if soname is not None:
        soname_at = len(strtab)
        strtab += soname.encode() + b"\0"
    if bits == 64:
        ehdr_size, phent, dyn_fmt, machine = 64, 56, "<qQ", 62
    else:
        ehdr_size, phent, dyn_fmt, machine = 52, 32, "<iI", 3
    strtab_at = ehdr_size + 2 * phent
    dyn_at = (strtab_at + len(strtab) + 7) & ~7
    tags = [(5, strtab_at), (10, len(strtab))]
    if soname is not None:
        tags.append((14, soname_at))
    tags.append((0, 0))
    dynamic = b"".join(struct.pack(dyn_fmt, tag, value) for tag, value in tags)
    total = dyn_at + len(dynamic) + len(payload)
    ident = b"\x7fELF" + bytes([2 if bits == 64 else 1, 1, 1]) + bytes(9)
    if bits == 64:
        ehdr = ident + struct.pack("<HHIQQQIHHHHHH", 3, machine, 1, 0, ehdr_size, 0, 0, ehdr_size, phent, 2, 64, 0, 0)
        load = struct.pack("<IIQQQQQQ", 1, 5, 0, 0, 0, total, total, 0x1000)
        dyn = struct.pack("<IIQQQQQQ", 2, 6, dyn_at, dyn_at, dyn_at, len(dynamic), len(dynamic), 8)
    else:
        ehdr = ident + struct.pack("<HHIIIIIHHHHHH", 3, machine, 1, 0, ehdr_size, 0, 0, ehdr_size, phent, 2, 40, 0, 0)
        load = struct.pack("<IIIIIIII", 1, 0, 0, 0, total, total, 5, 0x1000)
        dyn = struct.pack("<IIIIIIII", 2, dyn_at, dyn_at, dyn_at, len(dynamic), len(dynamic), 6, 4)
    head = ehdr + load + dyn + strtab
    return head + bytes(dyn_at - len(head)) + dynamic + payload


def make_ldcache(entries: Sequence[tuple[str, str, int, int]]) -> bytes:
    """A new-format ld.so.cache of ``(key, value, flags, hwcap)`` entries, in the order given."""
    header = struct.Struct("<17s3sIIB3xI12x")
    entry = struct.Struct("<iIIIQ")
    strings_at = header.size + len(entries) * entry.size
    strings = b""
    table = b""
    for key, value, flags, hwcap in entries:
        key_at = strings_at + len(strings)
        strings += key.encode() + b"\0"
        value_at = strings_at + len(strings)
        strings += value.encode() + b"\0"
        table += entry.pack(flags, key_at, value_at, 0, hwcap)
    return header.pack(b"glibc-ld.so.cache", b"1.1", len(entries), len(strings), 2, 0) + table + strings


class Host:
    """A fake driver root: libraries, binaries, its ld.so.cache."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache: list[tuple[str, str, int, int]] = []

    def file(self, host_path: str, data: bytes, mode: int = 0o755) -> Path:
        path = self.root / host_path.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)
        return path

    def link(self, host_path: str, target: str) -> None:
        path = self.root / host_path.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target)

    def library(
        self, directory: str, name: str, soname: str, *, bits: int = 64, hwcap: int = 0, tag: bytes = b""
    ) -> None:
        """``directory/name`` with its soname link, listed in the cache under the soname."""
        self.file(f"{directory}/{name}", make_elf(soname, bits=bits, payload=tag or name.encode()))
        if soname != name:
            self.link(f"{directory}/{soname}", name)
        self.cache.append((soname, f"{directory}/{soname}", X86_64 if bits == 64 else I386, hwcap))

    def write_cache(self) -> None:
        self.file("/etc/ld.so.cache", make_ldcache(self.cache), 0o644)


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path / "host")


def write_config(path: Path, base: Path, volumes: Sequence[tuple[str, Sequence[str], Sequence[str]]]) -> Path:
    raw = {
        "volume": [
            {"name": name, "base": str(base), "components": {"binaries": list(bins), "libraries": list(libs)}}
            for name, bins, libs in volumes
        ]
    }
    path.write_text(json.dumps(raw))
    return path


def tree_files(tree: Path) -> Iterator[tuple[str, os.stat_result]]:
    for directory, dirs, files in os.walk(tree):
        for name in (*dirs, *files):
            path = os.path.join(directory, name)
            yield os.path.relpath(path, tree), os.lstat(path)


def test_glibc_hwcaps_variant_is_not_preferred_over_the_baseline_library(host: Host, tmp_path: Path) -> None:
    # ldconfig lists a glibc-hwcaps variant (here for x86-64-v4) before the plain library of the same
    # soname; the loader only takes it on a CPU of that level. The mirror flattens directories, so it
    # must keep the baseline build, which runs on every CPU.
    host.library("/usr/lib64", "libcuda.so.550.54.15", "libcuda.so.1", tag=b"cuda")
    host.file(
        "/usr/lib64/glibc-hwcaps/x86-64-v4/libnvidia-ml.so.550.54.15",
        make_elf("libnvidia-ml.so.1", payload=b"v4 build, needs AVX-512"),
    )
    host.cache.append(
        ("libnvidia-ml.so.1", "/usr/lib64/glibc-hwcaps/x86-64-v4/libnvidia-ml.so.550.54.15", X86_64, GLIBC_HWCAPS)
    )
    host.library("/usr/lib64", "libnvidia-ml.so.550.54.15", "libnvidia-ml.so.1", tag=b"baseline build")
    host.write_cache()
    config = write_config(
        tmp_path / "volume.conf", tmp_path / "vdriver", [("origin", [], ["libcuda.so", "libnvidia-ml.so"])]
    )
    result = build_vdriver(volume_config=config, driver_root=host.root, share_mode=False, interceptor=None)
    assert result.origin is not None
    mirrored = (result.origin / "lib64" / "libnvidia-ml.so.550.54.15").read_bytes()
    assert mirrored.endswith(b"baseline build")
    assert not any("glibc-hwcaps" in warning for warning in result.warnings), result.warnings


def test_glibc_hwcaps_only_library_is_still_mirrored(host: Host, tmp_path: Path) -> None:
    host.file("/usr/lib64/glibc-hwcaps/x86-64-v3/libnvidia-ml.so.550.54.15", make_elf("libnvidia-ml.so.1"))
    host.cache.append(
        ("libnvidia-ml.so.1", "/usr/lib64/glibc-hwcaps/x86-64-v3/libnvidia-ml.so.550.54.15", X86_64, GLIBC_HWCAPS)
    )
    host.write_cache()
    config = write_config(tmp_path / "volume.conf", tmp_path / "vdriver", [("origin", [], ["libnvidia-ml.so"])])
    result = build_vdriver(volume_config=config, driver_root=host.root, share_mode=False, interceptor=None)
    assert result.origin is not None
    assert (result.origin / "lib64" / "libnvidia-ml.so.550.54.15").is_file()


@pytest.fixture
def strict_umask() -> Iterator[None]:
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def test_trees_are_readable_by_container_users_under_a_strict_umask(
    host: Host, tmp_path: Path, strict_umask: None
) -> None:
    # An agent started with umask 077 (a hardened unit or shell) must still give containers that run
    # as another user than root a driver they can open.
    host.library("/usr/lib64", "libcuda.so.550.54.15", "libcuda.so.1")
    host.write_cache()
    config = write_config(tmp_path / "volume.conf", tmp_path / "vdriver", [("origin", [], ["libcuda.so"])])
    result = build_vdriver(volume_config=config, driver_root=host.root, share_mode=False, interceptor=None)
    assert result.origin is not None
    tree = result.origin.resolve()
    assert stat.S_IMODE(os.stat(tree).st_mode) == 0o755
    for rel, st in tree_files(tree):
        if stat.S_ISDIR(st.st_mode):
            assert stat.S_IMODE(st.st_mode) == 0o755, rel


def test_a_tree_built_under_a_strict_umask_is_rebuilt_readable(host: Host, tmp_path: Path) -> None:
    host.library("/usr/lib64", "libcuda.so.550.54.15", "libcuda.so.1")
    host.write_cache()
    config = write_config(tmp_path / "volume.conf", tmp_path / "vdriver", [("origin", [], ["libcuda.so"])])
    first = build_vdriver(volume_config=config, driver_root=host.root, share_mode=False, interceptor=None)
    assert first.origin is not None
    tree = first.origin.resolve()
    for directory in (tree, tree / "lib64"):  # as left by an earlier version under umask 077
        directory.chmod(0o700)
    again = build_vdriver(volume_config=config, driver_root=host.root, share_mode=False, interceptor=None)
    assert again.origin is not None
    for rel, st in [(".", os.stat(again.origin.resolve())), *tree_files(again.origin.resolve())]:
        if stat.S_ISDIR(st.st_mode):
            assert stat.S_IMODE(st.st_mode) == 0o755, rel


def test_binaries_are_mirrored_under_the_name_volume_conf_gives(host: Host, tmp_path: Path) -> None:
    # Containers run /usr/local/nvidia/bin/<name>; upstream's library runs .../bin/gpu-client.
    host.library("/usr/lib64", "libcuda.so.550.54.15", "libcuda.so.1")
    host.file("/usr/lib/nvidia/550/nvidia-smi.real", make_elf(None, payload=b"smi"))
    host.link("/usr/bin/nvidia-smi", "../lib/nvidia/550/nvidia-smi.real")
    host.write_cache()
    client = tmp_path / "agent" / "gpu-client-1.2"
    client.parent.mkdir()
    client.write_bytes(make_elf(None, payload=b"client"))
    client.chmod(0o755)
    config = write_config(
        tmp_path / "volume.conf", tmp_path / "vdriver", [("nvidia", ["nvidia-smi", "gpu-client"], ["libcuda.so"])]
    )
    result = build_vdriver(
        volume_config=config, driver_root=host.root, share_mode=False, interceptor=None, gpu_client=client
    )
    assert result.nvidia is not None
    assert sorted(os.listdir(result.nvidia / "bin")) == ["gpu-client", "nvidia-smi"]
    assert (result.nvidia / "bin" / "gpu-client").read_bytes().endswith(b"client")


def test_two_binary_names_of_one_file_are_both_mirrored(host: Host, tmp_path: Path) -> None:
    host.file("/usr/bin/nvidia-cuda-mps-control", make_elf(None, payload=b"mps"))
    host.link("/usr/bin/nvidia-cuda-mps-server", "nvidia-cuda-mps-control")
    host.write_cache()
    names = ["nvidia-cuda-mps-control", "nvidia-cuda-mps-server"]
    config = write_config(tmp_path / "volume.conf", tmp_path / "vdriver", [("origin", names, [])])
    result = build_vdriver(volume_config=config, driver_root=host.root, share_mode=False, interceptor=None)
    assert result.origin is not None
    assert sorted(os.listdir(result.origin / "bin")) == names


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("name", "nvidia\0", "name"),
        ("base", "/etc/gpu-manager\0/vdriver", "base"),
        ("binaries", ["nvidia-smi\0"], "binaries"),
        ("libraries", ["libcuda.so\0"], "libraries"),
        ("binaries", [".."], "binaries"),
    ],
)
def test_volume_conf_values_that_are_no_file_names_are_named(
    host: Host, tmp_path: Path, field: str, value: object, named: str
) -> None:
    host.write_cache()
    volume: dict[str, object] = {"name": "nvidia", "base": str(tmp_path / "vdriver"), "components": {}}
    components: dict[str, object] = {"binaries": [], "libraries": ["libcuda.so"]}
    if field in components:
        components[field] = value
    else:
        volume[field] = value
    volume["components"] = components
    config = tmp_path / "volume.conf"
    config.write_text(json.dumps({"volume": [volume]}))
    with pytest.raises(VolumeError, match=named) as caught:
        build_vdriver(volume_config=config, driver_root=host.root, share_mode=False, interceptor=None)
    assert str(config) in str(caught.value)


def test_a_library_rewritten_while_it_is_copied_is_not_published(
    host: Host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A driver installed over the old files (cp over a file in place) while the mirror copies it:
    # the copy holds half of each, and must not become the tree containers mount.
    import gpumanager.volume.tree as tree_module

    host.library("/usr/lib64", "libcuda.so.550.54.15", "libcuda.so.1", tag=b"x" * 8192)
    host.write_cache()
    config = write_config(tmp_path / "volume.conf", tmp_path / "vdriver", [("origin", [], ["libcuda.so"])])
    source = host.root / "usr/lib64/libcuda.so.550.54.15"
    real_copy = tree_module._copy_data

    def rewritten_meanwhile(src: int, dst: int, size: int) -> None:
        with source.open("r+b") as stream:
            stream.truncate(100)
        real_copy(src, dst, size)

    monkeypatch.setattr(tree_module, "_copy_data", rewritten_meanwhile)
    with pytest.raises(VolumeError, match=r"libcuda\.so\.550\.54\.15 changed"):
        build_vdriver(
            volume_config=config, driver_root=host.root, share_mode=False, interceptor=None, allow_hardlinks=False
        )
    assert not (tmp_path / "vdriver" / "origin").exists()


def test_a_library_replaced_after_it_was_found_is_not_linked_under_the_old_identity(
    host: Host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpumanager.volume.tree as tree_module

    host.library("/usr/lib64", "libcuda.so.550.54.15", "libcuda.so.1")
    host.write_cache()
    config = write_config(tmp_path / "volume.conf", tmp_path / "vdriver", [("origin", [], ["libcuda.so"])])
    source = host.root / "usr/lib64/libcuda.so.550.54.15"
    real_build = tree_module.build_tree

    def replaced_meanwhile(*args: object, **kwargs: object) -> object:
        source.unlink()
        source.write_bytes(make_elf("libcuda.so.1", payload=b"another build of the same name"))
        return real_build(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("gpumanager.volume.manager.build_tree", replaced_meanwhile)
    with pytest.raises(VolumeError, match=r"libcuda\.so\.550\.54\.15 changed"):
        build_vdriver(volume_config=config, driver_root=host.root, share_mode=False, interceptor=None)
    assert not (tmp_path / "vdriver" / "origin").exists()


def test_an_interceptor_built_for_another_machine_is_refused(host: Host, tmp_path: Path) -> None:
    host.library("/usr/lib64", "libcuda.so.550.54.15", "libcuda.so.1")
    host.write_cache()
    config = write_config(tmp_path / "volume.conf", tmp_path / "vdriver", [("nvidia", [], ["libcuda.so"])])
    arm = bytearray(make_elf("libcuda-control.so"))
    arm[18:20] = struct.pack("<H", 183)  # e_machine: EM_AARCH64
    interceptor = tmp_path / "libcuda-control.so"
    interceptor.write_bytes(bytes(arm))
    result = build_vdriver(
        volume_config=config, driver_root=host.root, share_mode=True, interceptor=interceptor, machine="x86_64"
    )
    assert result.share_problem.startswith(
        f"share mode has no interceptor: interceptor library {tmp_path}/libcuda-control.so is built for EM_AARCH64"
    )
    assert not (tmp_path / "vdriver" / "nvidia").exists()  # no share-mode tree without the interceptor
