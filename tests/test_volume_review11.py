"""The driver mirror, as shipped: what the default volume.conf gives containers."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpumanager.selftest.mirror import HELPER_PREFIXES
from gpumanager.volume import tree
from gpumanager.volume.config import load_volume_config
from gpumanager.volume.keeper import MirrorKeeper
from tests.volume_fixtures import LIB64, V1, DriverStore, driver_store, install_driver

__all__ = ["driver_store"]  # the session fixture, used by name

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("volume", ["nvidia", "origin"])
@pytest.mark.parametrize("helper", HELPER_PREFIXES)
def test_shipped_volumes_hold_the_helpers_libcuda_opens(volume: str, helper: str) -> None:
    # libcuda dlopens these by soname (PTX JIT and its compiler back end: libnvidia-gpucomp from
    # driver 545, libnvidia-nvvm for JIT LTO); a container finds them only in the mirror it mounts,
    # shared (nvidia) and whole-GPU (origin) alike, or cuModuleLoadData fails.
    config = load_volume_config(ROOT / "deploy" / "volume.conf")
    spec = next(v for v in config.volumes if v.name == volume)
    assert any(helper.startswith(prefix) for prefix in spec.libraries), (volume, helper, spec.libraries)


def _keeper_on(tmp_path: Path, driver_store: DriverStore) -> tuple[MirrorKeeper, Path]:
    root = tmp_path / "host"
    install_driver(driver_store, root)
    conf = json.loads((ROOT / "deploy" / "volume.conf").read_text())
    for volume in conf["volume"]:
        volume["base"] = str(tmp_path / "vdriver")
    (tmp_path / "volume.conf").write_text(json.dumps(conf))
    keeper = MirrorKeeper(
        volume_config=str(tmp_path / "volume.conf"),
        driver_root=str(root),
        share_mode=True,
        interceptor=str(driver_store.interceptor()),
        period=300.0,
        retry=10.0,
        settle=0.0,
    )
    return keeper, root / LIB64.lstrip("/") / f"libcuda.so.{V1}"


def test_a_driver_file_changed_while_copied_is_read_again_soon(
    tmp_path: Path, driver_store: DriverStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In the agent's pod the host's driver and the vdriver trees are two mounts: every file is
    # copied. An installer writing libcuda while it is copied fails the build; the next try must
    # come at the install retry (seconds), not after the 5-minute period with no tree to serve.
    keeper, libcuda = _keeper_on(tmp_path, driver_store)
    link = os.link
    host = str(tmp_path / "host")

    def across_mounts(src: str | Path, dst: str | Path) -> None:
        if str(src).startswith(host):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        link(src, dst)

    monkeypatch.setattr(tree.os, "link", across_mounts)
    copy_data = tree._copy_data
    written: list[bool] = []

    def installer_writes(src: int, dst: int, size: int) -> None:
        if not written and os.readlink(f"/proc/self/fd/{src}") == str(libcuda):
            written.append(True)
            with libcuda.open("r+b") as stream:
                stream.write(b"\x7fELF")  # same bytes, a new mtime: the file is being rewritten
            os.utime(libcuda, ns=(time.time_ns(), time.time_ns() + 1_000_000))
        copy_data(src, dst, size)

    monkeypatch.setattr(tree, "_copy_data", installer_writes)
    assert keeper.build() is False and written
    assert "changed while the driver mirror read it" in keeper.error
    assert keeper.next_check == 10.0
    assert keeper.build() is True, keeper.error
    assert keeper.share_problem == ""
    assert keeper.next_check == 300.0


def test_a_mirror_error_of_the_start_leaves_the_probe_body_once_a_build_succeeds(
    tmp_path: Path, driver_store: DriverStore
) -> None:
    # The first build fails (a broken volume.conf); the operator repairs it and sends SIGHUP. The
    # rebuilt mirror must not be reported as "not built" by /healthz and /readyz for ever after.
    root = tmp_path / "host"
    install_driver(driver_store, root)
    conf_file = tmp_path / "volume.conf"
    conf_file.write_text("{not json")
    sim = ROOT / "vcuda" / "build" / "sim"
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(sim),
        "GPUSIM_SPEC": str(ROOT / "deploy" / "sim" / "t4-x1.json"),
        "GPUSIM_STATE": str(tmp_path / "gpusim.state"),
    }
    kubelet = subprocess.Popen(
        [sys.executable, "-m", "simnode.kubelet", "--plugin-dir", str(tmp_path / "dp")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    log_file = tmp_path / "agent.log"
    vm = Path(tempfile.mkdtemp(prefix="vm", dir="/tmp"))  # pods' vcuda.sock paths must fit a unix socket
    agent = None
    try:
        agent = subprocess.Popen(
            [
                sys.executable, "-m", "gpumanager.cli", "--hostname-override=node1", "--query-port=0",
                f"--device-plugin-path={tmp_path / 'dp'}", f"--display-socket={tmp_path / 'gm.sock'}",
                f"--checkpoint-path={tmp_path / 'cp'}", f"--virtual-manager-path={vm}",
                f"--volume-config={conf_file}", f"--driver-root={root}", f"--proc-root={tmp_path / 'noproc'}",
            ],
            env=env,
            stdout=log_file.open("w"),
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        port = _wait_for(lambda: re.search(r"HTTP on 127\.0\.0\.1:(\d+)", log_file.read_text()), 60, log_file)
        url = f"http://127.0.0.1:{port.group(1)}/healthz"
        _wait_for(lambda: "volume" in _errors(url), 30, log_file)
        conf = json.loads((ROOT / "deploy" / "volume.conf").read_text())
        for volume in conf["volume"]:
            volume["base"] = str(tmp_path / "vdriver")
        conf_file.write_text(json.dumps(conf))
        agent.send_signal(signal.SIGHUP)
        _wait_for(lambda: (tmp_path / "vdriver" / "origin").is_symlink(), 30, log_file)
        _wait_for(lambda: "volume" not in _errors(url), 10, log_file)
    finally:
        for process in (agent, kubelet):
            if process is not None:
                process.terminate()
                process.wait(10)
        shutil.rmtree(vm, ignore_errors=True)


def _errors(url: str) -> dict[str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            body = answer.read()
    except urllib.error.HTTPError as refused:
        body = refused.read()
    errors: dict[str, str] = json.loads(body)["errors"]
    return errors


def _wait_for(probe: Callable[[], Any], seconds: float, log_file: Path) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"not within {seconds} s; agent log:\n{log_file.read_text()[-3000:]}")
