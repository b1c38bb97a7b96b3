"""The simulated host's driver install behaves like NVIDIA's installer: files are replaced, never
rewritten in place, so driver trees hard-linked from them (and containers mapping those) keep
what they had when the simulated driver is installed again after a rebuild."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import simnode.simhost as simhost
from tests.volume_fixtures import build_shared


def _fake_repo(repo: Path, version: str, marker: str) -> None:
    built = repo / "vcuda" / "build" / "sim"
    for name, soname in (("libcuda", "libcuda.so.1"), ("libnvidia-ml", "libnvidia-ml.so.1")):
        out = built / f"{name}.so.{version}"
        out.unlink(missing_ok=True)
        build_shared(out, soname, marker=f"{marker} {name}")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_installing_again_replaces_the_files_instead_of_rewriting_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "repo"
    monkeypatch.setattr(simhost, "repo_root", lambda: repo)
    version = simhost.SIM_DRIVER_VERSION
    _fake_repo(repo, version, "first build")
    libdir = simhost.install_sim_driver(tmp_path / "host", version)
    lib = libdir / f"libcuda.so.{version}"
    tree_file = tmp_path / "tree-libcuda.so"
    os.link(lib, tree_file)  # what the driver mirror does on one file system
    first = tree_file.read_bytes()

    _fake_repo(repo, version, "second build, a longer marker than the first one")
    simhost.install_sim_driver(tmp_path / "host", version)
    assert lib.read_bytes() != first
    assert tree_file.read_bytes() == first


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_installing_another_version_points_the_soname_link_at_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A downgrade too: the installer points libcuda.so.1 at the version it installs."""
    repo = tmp_path / "repo"
    monkeypatch.setattr(simhost, "repo_root", lambda: repo)
    _fake_repo(repo, "560.35.03", "newer")
    _fake_repo(repo, "550.54.15", "older")
    root = tmp_path / "host"
    libdir = simhost.install_sim_driver(root, "560.35.03")
    simhost.install_sim_driver(root, "550.54.15")
    for name in ("libcuda", "libnvidia-ml"):
        assert os.readlink(libdir / f"{name}.so.1") == f"{name}.so.550.54.15"
        assert not (libdir / f"{name}.so.560.35.03").exists()
    listing = subprocess.run(
        [simhost._ldconfig(), "-p", "-C", str(root / "etc/ld.so.cache")], capture_output=True, text=True, check=True
    ).stdout
    assert f"{simhost.LIB_DIR}/libcuda.so.1" in listing
