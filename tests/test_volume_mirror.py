"""The driver mirror end to end: real ELF libraries, a real ldconfig cache, trees, swaps, upgrades, GC."""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpumanager.volume import DriverVersion, VdriverResult, VolumeError, build_vdriver
from gpumanager.volume.inuse import scan_proc
from gpumanager.volume.ldcache import CacheArch, read_ldcache
from gpumanager.volume.rootfs import DriverRoot, ResolveError
from tests.gpu_client_fixtures import client_built
from tests.volume_fixtures import (
    DEFAULT_VOLUME_CONF,
    LIB32,
    LIB64,
    LIBX32,
    V1,
    V2,
    DriverStore,
    MappingChild,
    build_executable,
    build_shared,
    driver_store,
    install_driver,
    remove_driver,
    remove_libcuda,
    run_ldconfig,
    snapshot,
    write_cache,
)

__all__ = ["client_built", "driver_store"]

INTERCEPTED = ("libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1", "libnvidia-ml.so", "libcuda-control.so")


class Node:
    """A driver root, a vdriver base and a fake /proc for one test."""

    def __init__(self, tmp: Path, store: DriverStore) -> None:
        self.store = store
        self.root = tmp / "host"
        self.base = tmp / "vdriver"
        self.proc = tmp / "proc"
        self.proc.mkdir()
        install_driver(store, self.root, V1)

    def run(self, *, share: bool = True, interceptor: int | Path | None = 0, **kw: object) -> VdriverResult:
        lib = self.store.interceptor(interceptor) if isinstance(interceptor, int) else interceptor
        return build_vdriver(
            volume_config=DEFAULT_VOLUME_CONF,
            base_dir_override=self.base,
            driver_root=self.root,
            share_mode=share,
            interceptor=lib,
            proc_root=self.proc,
            **kw,  # type: ignore[arg-type]
        )

    def built(self, host_path: str, version: str = V1) -> bytes:
        return self.store.files[f"{version}:{host_path}"].read_bytes()

    def watch(self, pid: int) -> None:
        """Let the fake /proc show the real process ``pid``."""
        (self.proc / str(pid)).symlink_to(f"/proc/{pid}")

    def trees(self) -> list[str]:
        return sorted(p.name for p in (self.base / ".trees").iterdir())


@pytest.fixture
def node(tmp_path: Path, driver_store: DriverStore) -> Node:
    return Node(tmp_path, driver_store)


def _is_link_to(path: Path, target: str) -> bool:
    return path.is_symlink() and os.readlink(path) == target


def test_share_mode_mirror(node: Node) -> None:
    result = node.run()
    nvidia, origin = node.base / "nvidia", node.base / "origin"
    assert (result.nvidia, result.origin) == (nvidia, origin)
    assert result.driver_version == DriverVersion("550.54.15", 550, 54)
    assert all(v.changed and v.built for v in result.volumes)
    for vol in (nvidia, origin):
        assert vol.is_symlink() and os.readlink(vol).startswith(".trees/")
        assert sorted(p.name for p in vol.iterdir()) == ["bin", "lib", "lib64"]

    lib64 = nvidia / "lib64"
    interceptor = node.store.interceptor(0).read_bytes()
    inodes = set()
    for name in INTERCEPTED:  # the interceptor under every name, one inode, a regular file
        assert not (lib64 / name).is_symlink() and (lib64 / name).read_bytes() == interceptor, name
        inodes.add((lib64 / name).stat().st_ino)
    assert len(inodes) == 1
    assert (lib64 / f"libcuda.so.{V1}").read_bytes() == node.built(f"{LIB64}/libcuda.so.{V1}")
    assert (lib64 / f"libnvidia-ml.so.{V1}").read_bytes() == node.built(f"{LIB64}/libnvidia-ml.so.{V1}")
    # soname and dev-name links, relative
    assert _is_link_to(lib64 / "libnvcuvid.so.1", f"libnvcuvid.so.{V1}")
    assert _is_link_to(lib64 / "libnvcuvid.so", f"libnvcuvid.so.{V1}")
    assert _is_link_to(lib64 / "libGLX_indirect.so.0", f"libGLX_nvidia.so.{V1}")
    assert _is_link_to(lib64 / "libGLX_indirect.so", f"libGLX_nvidia.so.{V1}")
    assert (lib64 / f"libnvidia-gpucomp.so.{V1}").is_file()
    # blacklist: GLVND libGL kept, Mesa's not; libnvidia-tls of ABI 2.3.99, not 2.6
    assert _is_link_to(lib64 / "libGL.so.1", "libGL.so.1.7.0")
    assert not (lib64 / "libGL.so.1.2.0").exists()
    assert (lib64 / f"libnvidia-tls.so.{V1}").read_bytes() == node.built(f"{LIB64}/libnvidia-tls.so.{V1}")
    # 32-bit: the real libraries, but no libcuda.so.1 the 64-bit interceptor could not serve
    lib = nvidia / "lib"
    assert (lib / f"libcuda.so.{V1}").read_bytes() == node.built(f"{LIB32}/libcuda.so.{V1}")
    assert not any((lib / n).exists() or (lib / n).is_symlink() for n in INTERCEPTED)
    assert _is_link_to(lib / "libGLX_indirect.so.0", f"libGLX_nvidia.so.{V1}")
    # x32 entries are foreign on x86-64
    x32 = node.built(f"/usr/libx32/libcuda.so.{V1}")
    assert all(p.read_bytes() != x32 for p in nvidia.rglob("*") if p.is_file())
    # binaries: relative and absolute symlinks resolved inside the root; non-ELF and missing ones skipped
    assert sorted(p.name for p in (nvidia / "bin").iterdir()) == [
        "nvidia-cuda-mps-control",
        "nvidia-debugdump",
        "nvidia-persistenced",
        "nvidia-smi",
    ]
    assert any("gpu-client" in w for w in result.warnings)
    assert any("nvidia-cuda-mps-server is not an ELF file" in w for w in result.warnings)

    # origin: an untouched driver copy, soname links only, no GLX indirect links; gpucomp, which
    # libcuda opens for PTX JIT, as in the nvidia volume
    o64 = origin / "lib64"
    assert _is_link_to(o64 / "libcuda.so.1", f"libcuda.so.{V1}")
    assert _is_link_to(o64 / "libnvidia-ml.so", f"libnvidia-ml.so.{V1}")
    assert not (o64 / "libcuda-control.so").exists()
    assert not (o64 / "libGLX_indirect.so.0").is_symlink()
    assert (o64 / f"libnvidia-gpucomp.so.{V1}").is_file()
    assert _is_link_to(origin / "lib" / "libcuda.so.1", f"libcuda.so.{V1}")


def test_gpu_client_comes_from_the_agent(node: Node, client_built: Path, tmp_path: Path) -> None:
    """volume.conf lists gpu-client in the nvidia volume: the agent's own binary goes there (a copy)."""
    client = tmp_path / "agent" / "gpu-client"
    client.parent.mkdir()
    shutil.copy2(client_built, client)
    first = node.run(gpu_client=client)
    placed = node.base / "nvidia" / "bin" / "gpu-client"
    assert placed.read_bytes() == client.read_bytes() and os.access(placed, os.X_OK)
    assert placed.stat().st_ino != client.stat().st_ino  # never shares the agent's inode
    assert not (node.base / "origin" / "bin" / "gpu-client").exists()  # as upstream's volume.conf
    assert not any("gpu-client" in w for w in first.warnings)
    assert not any(v.changed for v in node.run(gpu_client=client).volumes)
    client.write_bytes(client.read_bytes() + b"\0")  # a new agent image: a new nvidia tree, origin kept
    second = node.run(gpu_client=client)
    assert [v.name for v in second.volumes if v.changed] == ["nvidia"]
    assert placed.read_bytes() == client.read_bytes()
    missing = node.run(gpu_client=tmp_path / "nowhere" / "gpu-client")
    assert any(f"gpu-client {tmp_path}/nowhere/gpu-client: No such file or directory" in w for w in missing.warnings)
    assert any("'gpu-client' not found on the PATH" in w for w in missing.warnings)


def test_mirrored_libraries_load(node: Node) -> None:
    """The dynamic loader finds the mirrored libraries by soname, GLVND dependencies included."""
    node.run()
    code = (
        "import ctypes\n"
        "import sys\n"
        "for n in sys.argv[1:]:\n"
        "    marker = ctypes.c_char.in_dll(ctypes.CDLL(n), 'gm_marker')\n"
        "    print(n, ctypes.string_at(ctypes.addressof(marker)).decode())\n"
    )
    names = ["libGL.so.1", "libcuda.so.1", "libnvidia-ml.so.1"]
    for volume, cuda in (("origin", f"libcuda.so.{V1} {V1}"), ("nvidia", "interceptor 0")):
        env = dict(os.environ, LD_LIBRARY_PATH=str(node.base / volume / "lib64"))
        extra = ["libGLX_indirect.so.0"] if volume == "nvidia" else []
        out = subprocess.run(
            [sys.executable, "-c", code, *names, *extra], env=env, check=True, capture_output=True, text=True
        ).stdout
        lines = dict(line.split(" ", 1) for line in out.splitlines())
        assert lines["libGL.so.1"].startswith("libGL.so.1.7.0 ")
        assert lines["libcuda.so.1"].startswith(cuda)
        if extra:
            assert lines["libGLX_indirect.so.0"].startswith(f"libGLX_nvidia.so.{V1} ")


def test_exclusive_mode_keeps_the_real_driver(node: Node) -> None:
    result = node.run(share=False, interceptor=None)
    lib64 = node.base / "nvidia" / "lib64"
    assert _is_link_to(lib64 / "libcuda.so.1", f"libcuda.so.{V1}")
    assert _is_link_to(lib64 / "libnvidia-ml.so.1", f"libnvidia-ml.so.{V1}")
    assert not (lib64 / "libcuda-control.so").exists()
    assert _is_link_to(lib64 / "libGLX_indirect.so.0", f"libGLX_nvidia.so.{V1}")
    assert result.driver_version is not None and result.driver_version.full == V1
    # switching share mode on gives a new nvidia tree; origin is untouched
    origin_tree = os.readlink(node.base / "origin")
    second = node.run(share=True)
    assert [v.changed for v in second.volumes] == [True, False]
    assert os.readlink(node.base / "origin") == origin_tree
    assert (lib64 / "libcuda.so.1").read_bytes() == node.store.interceptor(0).read_bytes()


def test_rerun_with_unchanged_driver_changes_nothing(node: Node) -> None:
    node.run()
    before = snapshot(node.base)
    result = node.run()
    assert snapshot(node.base) == before  # same inodes, mtimes and link targets, nothing added
    assert not result.changed and not any(v.built for v in result.volumes)
    assert result.driver_version is not None and result.driver_version.full == V1


def test_upgrade_while_a_process_maps_the_old_driver(node: Node) -> None:
    node.run()
    old_nvidia = (node.base / "nvidia").resolve()
    old_origin = (node.base / "origin").resolve()
    # The interceptor copy under libcuda.so.1 belongs to the nvidia tree alone. (A real driver file is
    # shared by both trees, hard links of one inode, so mapping it keeps both old trees.)
    mapped = [node.base / "nvidia/lib64/libcuda.so.1"]
    with MappingChild(mapped) as child:
        node.watch(child.proc.pid)
        before = child.hashes()
        assert before == [hashlib.sha256(p.read_bytes()).hexdigest() for p in mapped]

        remove_driver(node.root, V1)
        install_driver(node.store, node.root, V2)
        result = node.run(interceptor=1)

        assert result.driver_version == DriverVersion(V2, 560, 35)
        assert all(v.changed and v.built for v in result.volumes)
        new_lib64 = node.base / "nvidia/lib64"
        assert (new_lib64 / f"libcuda.so.{V2}").is_file() and not (new_lib64 / f"libcuda.so.{V1}").exists()
        assert (new_lib64 / "libcuda.so.1").read_bytes() == node.store.interceptor(1).read_bytes()
        assert _is_link_to(node.base / "origin/lib64/libcuda.so.1", f"libcuda.so.{V2}")
        # the old nvidia tree is kept, untouched, while mapped; the unmapped old origin tree is gone
        assert old_nvidia.is_dir() and (old_nvidia / f"lib64/libcuda.so.{V1}").is_file()
        assert [t for t, _ in result.kept_trees] == [old_nvidia]
        assert f"mapped by process {child.proc.pid}" in result.kept_trees[0][1]
        assert result.removed_trees == (old_origin,) and not old_origin.exists()
        assert child.hashes() == before  # the mapping still reads the old bytes

        again = node.run(interceptor=1)  # still mapped: still kept
        assert not any(v.changed for v in again.volumes) and old_nvidia.is_dir()
    final = node.run(interceptor=1)
    assert final.removed_trees == (old_nvidia,)
    assert not old_nvidia.exists() and not Path(f"{old_nvidia}.json").exists()
    assert len(node.trees()) == 4  # two trees and their manifests


def test_mapping_a_shared_driver_file_keeps_every_tree_holding_it(node: Node) -> None:
    first = node.run()
    with MappingChild([node.base / f"origin/lib64/libcuda.so.{V1}"]) as child:
        node.watch(child.proc.pid)
        remove_driver(node.root, V1)
        install_driver(node.store, node.root, V2)
        result = node.run()
        assert sorted(t for t, _ in result.kept_trees) == sorted(v.tree for v in first.volumes)
    assert sorted(node.run().removed_trees) == sorted(v.tree for v in first.volumes)


def test_changed_interceptor_rebuilds_only_the_nvidia_tree(node: Node) -> None:
    first = node.run(interceptor=0)
    old_real = (node.base / f"nvidia/lib64/libcuda.so.{V1}").stat().st_ino
    second = node.run(interceptor=1)
    assert [(v.name, v.changed) for v in second.volumes] == [("nvidia", True), ("origin", False)]
    assert second.volumes[0].previous_tree == first.volumes[0].tree
    assert second.removed_trees == (first.volumes[0].tree,)
    lib64 = node.base / "nvidia/lib64"
    assert (lib64 / "libcuda.so.1").read_bytes() == node.store.interceptor(1).read_bytes()
    assert (lib64 / f"libcuda.so.{V1}").stat().st_ino == old_real
    # rewriting the interceptor file in place is noticed too (its bytes change)
    own = node.root.parent / "libcuda-control.so"
    shutil.copyfile(node.store.interceptor(0), own)
    node.run(interceptor=own)
    own.write_bytes(node.store.interceptor(1).read_bytes())
    third = node.run(interceptor=own)
    assert third.volumes[0].changed
    assert (lib64 / "libcuda.so.1").read_bytes() == node.store.interceptor(1).read_bytes()


def test_the_agents_own_files_count_by_content_not_by_where_they_lie(node: Node, tmp_path: Path) -> None:
    # They lie in the agent image's overlayfs, whose device and inodes change at every start of its
    # container: counted by identity, every start built another nvidia tree (the old one kept while
    # containers mount it).
    image = [tmp_path / "image-1", tmp_path / "image-2"]
    client = build_executable(image[0] / "gpu-client", "own client")
    own = image[0] / "libcuda-control.so"
    shutil.copy2(node.store.interceptor(0), own)
    first = node.run(interceptor=own, gpu_client=client)
    assert (node.base / "nvidia/bin/gpu-client").read_bytes() == client.read_bytes()
    before = snapshot(node.base)
    image[1].mkdir()
    for f in (own, client):
        shutil.copy2(f, image[1] / f.name)  # the same bytes and mtime, another inode
    again = node.run(interceptor=image[1] / own.name, gpu_client=image[1] / client.name)
    assert not again.changed and not any(v.built for v in again.volumes)
    assert [v.tree for v in again.volumes] == [v.tree for v in first.volumes]
    assert snapshot(node.base) == before
    (image[1] / own.name).unlink()
    shutil.copyfile(node.store.interceptor(1), image[1] / own.name)  # other bytes: a new nvidia tree
    other = node.run(interceptor=image[1] / own.name, gpu_client=image[1] / client.name)
    assert [(v.name, v.built) for v in other.volumes] == [("nvidia", True), ("origin", False)]
    assert (node.base / "nvidia/lib64/libcuda.so.1").read_bytes() == node.store.interceptor(1).read_bytes()


def test_interceptor_errors(node: Node, tmp_path: Path) -> None:
    # They ended the whole build: no origin either, so whole GPUs got a mount source that did not exist.
    text = tmp_path / "libcuda-control.so"
    text.write_text("not a library")
    nvidia, origin = node.base / "nvidia", node.base / "origin"
    for lib, why in (
        (None, "no interceptor library (libcuda-control.so) was given"),
        (tmp_path / "nope.so", f"interceptor library {tmp_path}/nope.so: No such file or directory"),
        (text, f"interceptor library {text} is unusable: {text} is not an ELF file"),
    ):
        result = node.run(interceptor=lib)
        assert result.share_problem == (
            f"share mode has no interceptor: {why}; the share-mode tree {nvidia} is not built"
        ), lib
        assert not nvidia.exists() and not nvidia.is_symlink() and result.nvidia is None  # none without it
        assert [v.name for v in result.volumes] == ["origin"] and result.origin == origin
        assert origin.is_symlink() and (origin / "lib64" / "libcuda.so.1").is_file()
        assert result.driver_version is not None and result.driver_version.full == V1


def test_an_interceptor_gone_later_leaves_the_share_mode_tree_as_it_was(node: Node, tmp_path: Path) -> None:
    nvidia = node.base / "nvidia"
    node.run()
    published = os.readlink(nvidia)
    result = node.run(interceptor=tmp_path / "gone.so")
    assert result.share_problem == (
        f"share mode has no interceptor: interceptor library {tmp_path}/gone.so: No such file or directory; "
        f"the share-mode tree {nvidia} is left as it was"
    )
    assert os.readlink(nvidia) == published and (nvidia / "lib64" / "libcuda.so.1").is_file()  # nor removed
    assert result.nvidia == nvidia and result.origin == node.base / "origin" and not result.changed
    again = node.run(interceptor=1)  # an interceptor again: shares are served with it
    assert again.share_problem == "" and os.readlink(nvidia) != published
    assert (nvidia / "lib64/libcuda.so.1").read_bytes() == node.store.interceptor(1).read_bytes()


def test_an_interceptor_for_another_machine_still_builds_origin(node: Node, tmp_path: Path) -> None:
    arm = bytearray(node.store.interceptor(0).read_bytes())
    arm[18:20] = (183).to_bytes(2, "little")  # e_machine: EM_AARCH64
    lib = tmp_path / "libcuda-control.so"
    lib.write_bytes(bytes(arm))
    result = node.run(interceptor=lib, machine="x86_64")
    assert result.share_problem.startswith(
        f"share mode has no interceptor: interceptor library {lib} is built for EM_AARCH64, this host loads "
    )
    assert not (node.base / "nvidia").exists() and (node.base / "origin/lib64/libcuda.so.1").is_file()


def test_32_bit_interceptor_serves_the_lib_directory(node: Node) -> None:
    node.run(interceptor=node.store.files["interceptor32"])
    lib = node.base / "nvidia/lib"
    assert (lib / "libcuda.so.1").read_bytes() == node.store.files["interceptor32"].read_bytes()
    assert not any((node.base / "nvidia/lib64" / n).exists() for n in INTERCEPTED)


def test_broken_links_stale_cache_and_missing_binary(node: Node) -> None:
    lib64 = node.root / LIB64.lstrip("/")
    (lib64 / f"libnvidia-fbc.so.{V1}").unlink()  # libnvidia-fbc.so.1 now dangles
    (lib64 / "libnvidia-dangling.so.1").symlink_to("nowhere")  # a broken link ldconfig must skip
    run_ldconfig(node.root)
    (lib64 / f"libnvidia-encode.so.{V1}").unlink()
    (lib64 / f"libnvidia-encode.so.{V1}").write_text("replaced after ldconfig ran\n")  # stale cache: not ELF
    (lib64 / f"libvdpau_nvidia.so.{V1}").unlink()  # the cache still names it
    (node.root / "usr/bin/nvidia-smi").unlink()
    (node.root / "usr/bin/nvidia-smi").symlink_to("/opt/missing/nvidia-smi")
    result = node.run()
    warnings = "\n".join(result.warnings)
    assert f"libnvidia-encode.so.{V1} is not an ELF file" in warnings
    assert "libvdpau_nvidia.so.1" in warnings and "does not exist" in warnings
    assert "'nvidia-smi' not found" in warnings
    out = node.base / "nvidia"
    assert not (out / "bin/nvidia-smi").exists()
    assert not list(out.glob("lib64/libnvidia-encode*")) and not list(out.glob("lib64/libvdpau*"))
    assert not list(out.glob("lib64/libnvidia-fbc*"))
    assert (out / f"lib64/libcuda.so.{V1}").is_file()  # the rest is mirrored


@pytest.mark.parametrize("soname", ["../../../ESCAPED", "sub/libx.so.1", "..", ".", "1.2"])
def test_a_soname_that_is_no_file_name_makes_no_link_outside_the_tree(node: Node, soname: str) -> None:
    # The soname became a symlink's name: '../../../ESCAPED' left a link outside the tree (beside
    # the volume paths), the others made the whole build fail, so no volume had a mirror.
    lib = node.root / LIB64.lstrip("/") / f"libnvidia-fbc.so.{V1}"
    lib.unlink()
    build_shared(lib, soname, marker="odd soname")  # the cache still leads libnvidia-fbc.so.1 to it
    result = node.run()
    assert sorted(p.name for p in node.base.iterdir()) == [".trees", ".vdriver.lock", "nvidia", "origin"]
    assert not [p for p in node.base.rglob("*ESCAPED*")]
    for volume in ("nvidia", "origin"):
        tree = node.base / volume
        assert sorted(p.name for p in tree.iterdir()) == ["bin", "lib", "lib64"]
        assert not [p for p in tree.glob("*/*") if p.is_dir() and not p.is_symlink()]
        assert (tree / f"lib64/libnvidia-fbc.so.{V1}").read_bytes() == lib.read_bytes()  # the file is mirrored
        assert (tree / "lib64/libcuda.so.1").is_file()  # and so is the rest
        assert any(
            f"volume {volume}: {LIB64}/libnvidia-fbc.so.{V1} has the soname {soname!r}" in w for w in result.warnings
        )
    if soname == "1.2":  # a file name, but nothing is left once its version is taken off: only that link
        assert _is_link_to(node.base / "nvidia/lib64/1.2", f"libnvidia-fbc.so.{V1}")


def test_a_share_mode_tree_without_libcuda_is_a_share_problem(node: Node) -> None:
    assert node.run().share_problem == "" and node.run(share=False, interceptor=None).share_problem == ""
    remove_libcuda(node.root, LIB64)  # the 32-bit libcuda is left, but the interceptor is 64-bit
    result = node.run()
    tree, cache = result.volumes[0].tree, node.root / "etc/ld.so.cache"
    assert not (tree / "lib64/libcuda.so.1").exists()
    assert result.share_problem == (
        f"share mode has no interceptor: the share-mode tree {tree} has no libcuda.so.1 swapped for the "
        f"interceptor: {cache} has no libcuda.so.* for lib64/ (only for lib/, x32 (foreign here)), and the "
        f"interceptor {node.store.interceptor(0)} is 64-bit"
    )
    assert node.run(share=False, interceptor=None).share_problem == ""  # exclusive containers need none
    remove_libcuda(node.root, LIB32, LIBX32)
    result = node.run()
    assert result.share_problem.endswith(f"{result.volumes[0].tree} has no libcuda.so.1 swapped for the "
                                         f"interceptor: {cache} has no libcuda.so.* entry")  # fmt: skip
    assert not any("no libnvidia-ml.so.1 swapped" in w for w in result.warnings)  # that one still is
    remove_driver(node.root, V1)  # libnvidia-ml missing too: only warned about, libcuda is the problem
    result = node.run()
    assert "no libcuda.so.1 swapped" in result.share_problem
    assert any(f"{result.volumes[0].tree} has no libnvidia-ml.so.1 swapped" in w for w in result.warnings)


def test_the_cache_is_found_through_an_absolute_symlink_inside_the_root(node: Node) -> None:
    cache = node.root / "etc/ld.so.cache"
    (node.root / "var/cache").mkdir(parents=True)
    cache.rename(node.root / "var/cache/ld.so.cache")
    cache.symlink_to("/var/cache/ld.so.cache")  # the host's path, not the agent's
    result = node.run()
    assert result.share_problem == "" and result.driver_version is not None and result.driver_version.full == V1
    cache.unlink()
    cache.symlink_to("/etc/ld.so.cache")  # read through the agent's own files it was the agent's cache
    with pytest.raises(VolumeError, match=f"cannot read ld.so.cache {cache}: .*too many levels of symbolic links"):
        node.run()


def test_a_stale_driver_beside_the_preferred_one_stays_out_of_the_share_mode_tree(node: Node) -> None:
    # Both were in the nvidia tree, and the interceptor loads the newest libcuda.so.<version> beside it:
    # the stale 560 one, not the 550 one the cache prefers, the agent reports and origin links to.
    cache = node.root / "etc/ld.so.cache"
    read = read_ldcache(cache).entries
    entries = [(e.flags, e.key, e.value) for e in read]
    stale = []
    for name in ("libcuda", "libnvidia-ml"):
        flags = next(e.flags for e in read if e.key == f"{name}.so.1" and e.arch is CacheArch.X86_64)
        lib = node.root / f"usr/lib64/{name}.so.{V2}"
        os.link(node.store.files[f"{V2}:{LIB64}/{name}.so.{V2}"], lib)
        (lib.parent / f"{name}.so.1").symlink_to(lib.name)
        entries.append((flags, f"{name}.so.1", f"/usr/lib64/{name}.so.1"))  # after the preferred one
        stale.append(f"/usr/lib64/{name}.so.{V2}")
    cache.write_bytes(write_cache(entries))
    result = node.run()
    assert result.driver_version is not None and result.driver_version.full == V1
    lib64 = node.base / "nvidia/lib64"
    for name in ("libcuda", "libnvidia-ml"):
        assert (lib64 / f"{name}.so.{V1}").read_bytes() == node.built(f"{LIB64}/{name}.so.{V1}")
        assert not list(lib64.glob(f"{name}.so.{V2}*"))
        assert (lib64 / f"{name}.so.1").read_bytes() == node.store.interceptor(0).read_bytes()
        assert _is_link_to(node.base / f"origin/lib64/{name}.so.1", f"{name}.so.{V1}")
        assert any(
            f"volume nvidia: /usr/lib64/{name}.so.{V2} left out: lib64/ holds {LIB64}/{name}.so.{V1}" in w
            for w in result.warnings
        )
    assert not any(s in w for s in stale for w in result.warnings if w.startswith("volume origin"))
    assert result.volumes[0].files == len([p for p in lib64.parent.rglob("*") if p.is_file() and not p.is_symlink()])


def test_missing_or_corrupt_cache_leaves_the_current_trees(node: Node) -> None:
    node.run()
    current = os.readlink(node.base / "nvidia")
    cache = node.root / "etc/ld.so.cache"
    data = cache.read_bytes()
    cache.write_bytes(data[: len(data) // 2])
    with pytest.raises(VolumeError, match=f"ld.so.cache {cache} is truncated"):
        node.run()
    cache.unlink()
    with pytest.raises(VolumeError, match=f"cannot read ld.so.cache {cache}"):
        node.run()
    assert os.readlink(node.base / "nvidia") == current


def test_legacy_directories_from_tkestack_are_replaced(node: Node) -> None:
    for name in ("nvidia", "origin"):
        (node.base / name / "lib64").mkdir(parents=True)
        (node.base / name / "lib64" / "libcuda.so.1").write_bytes(b"old tkestack copy")
    result = node.run()
    assert (node.base / "nvidia").is_symlink() and (node.base / "origin").is_symlink()
    assert sorted(p.name.split("-legacy-")[0] for p in result.removed_trees) == ["nvidia", "origin"]
    assert not [p for p in (node.base / ".trees").iterdir() if "-legacy-" in p.name]
    assert (node.base / "nvidia/lib64/libcuda.so.1").read_bytes() == node.store.interceptor(0).read_bytes()


def _can_unshare() -> bool:
    unshare = shutil.which("unshare")
    return bool(unshare) and subprocess.run([unshare, "-m", "true"], capture_output=True).returncode == 0


class MountingChild:
    """A process in its own mount namespace that bind-mounts ``source``, as a container runtime does."""

    def __init__(self, source: Path, mountpoint: Path) -> None:
        mountpoint.mkdir(parents=True, exist_ok=True)
        script = f'mount --bind "{source}" "{mountpoint}" && echo ready && exec sleep 300'
        self.proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def __enter__(self) -> MountingChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.mark.skipif(not _can_unshare(), reason="needs unshare -m (CAP_SYS_ADMIN)")
def test_trees_mounted_in_another_mount_namespace_are_kept(node: Node, tmp_path: Path) -> None:
    """Real mount namespaces: a legacy directory and an old tree stay while a 'container' mounts them."""
    (node.base / "nvidia/lib64").mkdir(parents=True)
    (node.base / "nvidia/lib64/libcuda.so.1").write_bytes(b"old tkestack copy")
    with MountingChild(node.base / "nvidia", tmp_path / "c1") as legacy_user:
        node.watch(legacy_user.proc.pid)
        first = node.run(share=False, interceptor=None)
        # the kernel reports the mount under the directory's new name, so it is recognised
        assert len(first.kept_trees) == 1 and "-legacy-" in first.kept_trees[0][0].name
        assert "mounted by a container" in first.kept_trees[0][1]
        with MountingChild((node.base / "origin").resolve(), tmp_path / "c2") as origin_user:
            node.watch(origin_user.proc.pid)
            remove_driver(node.root, V1)
            install_driver(node.store, node.root, V2)
            second = node.run(share=False, interceptor=None)
            kept = sorted(t.name.split("-")[0] for t, _ in second.kept_trees)
            assert kept == ["nvidia", "origin"]  # the legacy directory and the old origin tree
            assert second.removed_trees == (first.volumes[0].tree,)
    third = node.run(share=False, interceptor=None)
    assert sorted(t.name.split("-")[0] for t in third.removed_trees) == ["nvidia", "origin"]


def test_old_tree_mounted_by_a_container_is_kept(node: Node) -> None:
    first = node.run()
    old = first.volumes[1].tree
    (node.proc / "77").mkdir()
    (node.proc / "77" / "maps").write_text("")
    (node.proc / "77" / "mountinfo").write_text(
        f"5 1 254:0 /etc/gpu-manager/vdriver/.trees/{old.name} /usr/local\\040nvidia ro - ext4 /dev/vda rw\n"
    )
    remove_driver(node.root, V1)
    install_driver(node.store, node.root, V2)
    result = node.run()
    assert (old, f"mounted by a container (/etc/gpu-manager/vdriver/.trees/{old.name})") in result.kept_trees
    assert first.volumes[0].tree in result.removed_trees


def test_damaged_tree_is_replaced_by_a_new_one(node: Node) -> None:
    first = node.run()
    (first.volumes[0].tree / f"lib64/libcuda.so.{V1}").unlink()
    second = node.run()
    assert second.volumes[0].changed and second.volumes[0].built
    assert second.volumes[0].tree.name == first.volumes[0].tree.name + "-1"
    assert (node.base / f"nvidia/lib64/libcuda.so.{V1}").is_file()
    assert second.removed_trees == (first.volumes[0].tree,)


def test_copy_mode_keeps_holes_modes_and_shares_inodes_between_volumes(node: Node) -> None:
    big = node.root / LIB64.lstrip("/") / f"libnvidia-opencl.so.{V1}"
    head = big.read_bytes()
    big.unlink()
    big.write_bytes(head)
    os.truncate(big, 256 << 20)  # a 256 MiB file that is mostly a hole
    big.chmod(0o751)
    node.run(allow_hardlinks=False)
    copies = [node.base / vol / f"lib64/libnvidia-opencl.so.{V1}" for vol in ("nvidia", "origin")]
    st = [c.stat() for c in copies]
    assert st[0].st_ino == st[1].st_ino != big.stat().st_ino  # copied once, then linked between trees
    assert st[0].st_size == 256 << 20 and st[0].st_blocks * 512 < 8 << 20
    assert (st[0].st_mode & 0o777) == 0o751
    with copies[0].open("rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        assert m[: len(head)] == head and m[-4096:] == bytes(4096)
    lib64 = node.base / "nvidia/lib64"
    assert (lib64 / f"libcuda.so.{V1}").stat().st_ino != (
        node.root / LIB64.lstrip("/") / f"libcuda.so.{V1}"
    ).stat().st_ino


def test_other_host_architecture(node: Node, driver_store: DriverStore) -> None:
    lib64 = node.root / LIB64.lstrip("/")
    (node.root / "etc/ld.so.cache").write_bytes(
        write_cache(
            [
                (CacheArch.X86_64.value | 3, "libcuda.so.1", f"{LIB64}/libcuda.so.1"),
                (CacheArch.AARCH64.value | 3, "libnvidia-ml.so.1", f"{LIB64}/libnvidia-ml.so.1"),
                (CacheArch.PPC64.value | 3, "libnvcuvid.so.1", f"{LIB64}/libnvcuvid.so.1"),
            ],
            fmt="compat",
        )
    )
    assert lib64.is_dir()
    node.run(machine="aarch64", share=False, interceptor=None)
    names = sorted(p.name for p in (node.base / "origin/lib64").iterdir())
    assert names == ["libnvidia-ml.so", "libnvidia-ml.so.1", f"libnvidia-ml.so.{V1}"]


def test_driver_root_resolution(tmp_path: Path) -> None:
    root = DriverRoot(tmp_path)
    (tmp_path / "usr/lib64").mkdir(parents=True)
    (tmp_path / "usr/lib64/libx.so.1.0").write_bytes(b"x")
    (tmp_path / "lib64").symlink_to("/usr/lib64")
    (tmp_path / "usr/lib64/libx.so.1").symlink_to("../../lib64/./libx.so.1.0")
    (tmp_path / "loop").symlink_to("/loop")
    assert root.resolve("/lib64/libx.so.1") == "/usr/lib64/libx.so.1.0"
    assert root.resolve("/../../lib64/libx.so.1") == "/usr/lib64/libx.so.1.0"  # never above the root
    with pytest.raises(ResolveError, match="too many levels"):
        root.resolve("/loop")
    with pytest.raises(ResolveError, match="does not exist"):
        root.resolve("/lib64/missing.so")


def test_scan_of_the_real_proc_finds_this_process_mapping(tmp_path: Path) -> None:
    f = tmp_path / "mapped.bin"
    f.write_bytes(b"x" * 8192)
    with f.open("rb") as stream, mmap.mmap(stream.fileno(), 0, prot=mmap.PROT_READ):
        scan = scan_proc(Path("/proc"))
        st = f.stat()
        assert scan.mapped.get((st.st_dev, st.st_ino)) == str(os.getpid())
        assert "/" in scan.mount_roots


def test_leftovers_of_an_interrupted_publish_are_tidied(node: Node) -> None:
    first = node.run()
    (node.base / ".nvidia.new-999").symlink_to(".trees/whatever")
    (node.base / ".origin.new-998" / "lib64").mkdir(parents=True)  # an exchanged old directory
    second = node.run()
    assert sorted(p.name for p in node.base.iterdir()) == [".trees", ".vdriver.lock", "nvidia", "origin"]
    assert [p.name.split("-legacy-")[0] for p in second.removed_trees] == ["origin"]
    assert [v.tree for v in second.volumes] == [v.tree for v in first.volumes]


def test_unwritable_base_is_a_clear_error(node: Node, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(VolumeError, match=f"cannot create the volume base {blocker}/vdriver"):
        build_vdriver(
            volume_config=DEFAULT_VOLUME_CONF,
            base_dir_override=blocker / "vdriver",
            driver_root=node.root,
            share_mode=False,
            interceptor=None,
            proc_root=node.proc,
        )
