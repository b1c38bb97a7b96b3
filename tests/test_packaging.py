"""What is shipped: the sdist, the wheel built from it (the product only), and a clean install of it.

`python -m build` makes the sdist from the checkout, then the wheel from the unpacked sdist (no
.git there): the wheel must still know its commit. The wheel is installed into a fresh venv
outside the checkout, where `gpu-manager --help` and `--version` must work.
"""

from __future__ import annotations

import fcntl
import os
import runpy
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpumanager
from gpumanager import buildinfo

ROOT = Path(__file__).resolve().parent.parent
NAME = f"gpumanager-{gpumanager.__version__}"


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("dist")
    # The sdist is made in the checkout (its build/ and egg-info directories): pytest-xdist may run this
    # module's tests in two workers, each with this fixture, and two builds there at once break each other.
    lock_path = Path(tempfile.gettempdir()) / f"gpu-manager-build-{os.getuid()}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run(
            [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
            capture_output=True,
            text=True,
            timeout=600,
            env={k: v for k, v in os.environ.items() if k != "GPU_MANAGER_COMMIT"},
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    yield out


def wheel_names(dist: Path) -> list[str]:
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def test_wheel_holds_the_product_only(dist: Path) -> None:
    names = wheel_names(dist)
    outside = [n for n in names if not n.startswith(("gpumanager/", f"{NAME}.dist-info/"))]
    assert outside == []  # no simnode/, tests/, bench/, vcuda/
    assert "gpumanager/py.typed" in names and "gpumanager/cli.py" in names
    assert "gpumanager/api/deviceplugin_v1beta1_pb2.pyi" in names
    assert f"{NAME}.dist-info/licenses/LICENSE" in names


def test_wheel_built_from_the_sdist_knows_its_commit(dist: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert z.read("gpumanager/COMMIT").decode().strip() == buildinfo.commit()
        metadata = z.read(f"{NAME}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "Requires-Dist: kubernetes>=36.0.0" in metadata


def test_sdist_carries_what_a_build_needs(dist: Path) -> None:
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"pyproject.toml", "setup.py", "README.md", "LICENSE", "gpumanager/COMMIT", "gpumanager/py.typed"} <= names
    assert not any(n.startswith(("simnode/", "tests/")) for n in names)


def test_commit_comes_from_the_environment_without_git(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    hooks = runpy.run_path(str(ROOT / "setup.py"))  # not __main__: defines the hooks, builds nothing
    monkeypatch.setenv("GPU_MANAGER_COMMIT", "0123abc")
    assert hooks["source_commit"]() == "0123abc"


def test_product_never_imports_the_test_world() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "gpumanager").rglob("*.py")
        if "simnode" in p.read_text() or "from tests" in p.read_text()
    ]
    assert offenders == []


def test_clean_install_outside_the_checkout(dist: Path, tmp_path: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "GPU_MANAGER_COMMIT")}
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)

    version = run(str(venv / "bin" / "gpu-manager"), "--version")
    assert version.returncode == 0, version.stderr
    assert f"gpu-manager {gpumanager.__version__} (commit {buildinfo.commit()}," in version.stdout
    help_text = run(str(venv / "bin" / "gpu-manager"), "--help")
    assert help_text.returncode == 0 and "--device-plugin-path" in help_text.stdout
    # Every module of the product imports in the installed copy (none needs the checkout).
    imports = run(
        str(venv / "bin" / "python"),
        "-c",
        "import pkgutil, importlib, gpumanager\n"
        "assert 'site-packages' in gpumanager.__file__, gpumanager.__file__\n"
        "for m in pkgutil.walk_packages(gpumanager.__path__, 'gpumanager.'): importlib.import_module(m.name)\n"
        "import sys; assert not any(n.startswith('simnode') for n in sys.modules)",
    )
    assert imports.returncode == 0, imports.stderr[-3000:]
