"""A host root whose NVIDIA driver is the simulated one, for the driver mirror on the simulated node.

``install_sim_driver(root)`` lays ``libcuda.so.<version>`` and ``libnvidia-ml.so.<version>``
(built by ``make -C vcuda``) out as the NVIDIA installer does and builds the root's
``/etc/ld.so.cache`` with the real ``ldconfig``; ``volume_conf`` writes a copy of the shipped
``volume.conf`` whose volumes live under a chosen base directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from simnode.gpusim_state import repo_root

SIM_DRIVER_VERSION = "550.54.15"  # vcuda/Makefile's SIM_DRIVER_VERSION
LIB_DIR = "usr/lib/x86_64-linux-gnu"
SIM_LIBRARIES = ("libcuda", "libnvidia-ml")


def _ldconfig() -> str:
    for candidate in ("/sbin/ldconfig", "/usr/sbin/ldconfig"):
        if Path(candidate).exists():
            return candidate
    found = shutil.which("ldconfig")
    if found is None:
        raise FileNotFoundError("ldconfig not found")
    return found


def install_sim_driver(
    root: Path,
    version: str = SIM_DRIVER_VERSION,
    *,
    libraries: Sequence[str] = SIM_LIBRARIES,
    ldconfig: bool = True,
) -> Path:
    """Install the simulated driver under ``root`` (a host ``/``); returns its library directory.

    As NVIDIA's installer does, an install over an earlier one removes the other versions' files
    and replaces files and links (new inodes, never rewritten in place): a driver tree
    hard-linked from the old files, and the containers mapping it, keep what they had.

    ``libraries`` (some of :data:`SIM_LIBRARIES`) installs only those, and ``ldconfig=False``
    leaves ``/etc/ld.so.cache`` as it was: the root is then as an installer or a package manager
    leaves it midway (some libraries of the new version, the cache not yet rebuilt, or rebuilt
    before the other libraries are written).
    """
    unknown = sorted(set(libraries) - set(SIM_LIBRARIES))
    if unknown:
        raise ValueError(f"no simulated driver library {unknown} (known: {', '.join(SIM_LIBRARIES)})")
    libdir = root / LIB_DIR
    libdir.mkdir(parents=True, exist_ok=True)
    built = repo_root() / "vcuda" / "build" / "sim"
    for name in libraries:
        target = f"{name}.so.{version}"
        tmp = libdir / f".{target}.installing"
        tmp.unlink(missing_ok=True)
        shutil.copy2(built / target, tmp)
        os.replace(tmp, libdir / target)
        link_tmp = libdir / f".{name}.so.1.installing"
        link_tmp.unlink(missing_ok=True)
        link_tmp.symlink_to(target)
        os.replace(link_tmp, libdir / f"{name}.so.1")
        for old in libdir.glob(f"{name}.so.*.*"):
            if old.name != target and not old.is_symlink():
                old.unlink()
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc" / "ld.so.conf").write_text(f"/{LIB_DIR}\n")
    if not ldconfig:
        return libdir
    subprocess.run(
        [_ldconfig(), "-r", str(root), "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache"],
        check=True,
        capture_output=True,
    )
    return libdir


def volume_conf(base: Path, path: Path) -> Path:
    """Write the shipped volume.conf to ``path`` with every volume under ``base``."""
    conf = json.loads((repo_root() / "deploy" / "volume.conf").read_text())
    for volume in conf["volume"]:
        volume["base"] = str(base)
    path.write_text(json.dumps(conf, indent=2))
    return path
