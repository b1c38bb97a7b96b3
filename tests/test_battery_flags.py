"""Battery: operator errors on the agent's flags exit 2 naming the flag and the value, never a traceback.

Each case starts the real ``gpu-manager`` command on a simulated one-GPU node with one bad
value; everything else points into the test's own directory.
"""

from __future__ import annotations

import ctypes.util
import subprocess
import sys
from pathlib import Path

import pytest

from simnode.agent_process import vm_path_for
from simnode.gpusim_state import sim_env
from tests.battery_fixtures import spec_one_gpu

EXIT_CONFIG = 2


def _run(tmp_path: Path, *flags: str, timeout: float = 30.0) -> tuple[int | None, str]:
    spec = spec_one_gpu(tmp_path / "spec.json")
    args = [
        sys.executable,
        "-m",
        "gpumanager.cli",
        f"--device-plugin-path={tmp_path / 'dp'}",
        f"--display-socket={tmp_path / 'gm.sock'}",
        "--query-addr=127.0.0.1",
        "--query-port=0",
        f"--kubeconfig={tmp_path / 'no-kubeconfig'}",
        f"--checkpoint-path={tmp_path / 'ck'}",
        f"--virtual-manager-path={vm_path_for(tmp_path)}",
        f"--pod-resources-socket={tmp_path / 'pr.sock'}",
        f"--plugin-registry-path={tmp_path / 'reg'}",
        f"--dra-plugin-path={tmp_path / 'dra'}",
        f"--cdi-root={tmp_path / 'cdi'}",
        "--hostname-override=battery-node",
        *flags,
    ]
    (tmp_path / "dp").mkdir(exist_ok=True)
    with subprocess.Popen(
        args,
        env=sim_env(spec, tmp_path / "state"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    ) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
            return proc.returncode, out
        except subprocess.TimeoutExpired:
            proc.terminate()  # still running: a clean stop
            out, _ = proc.communicate(timeout=30)
            return None, out


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--wait-timeout", "inf"),
        ("--wait-timeout", "nan"),
        ("--health-probe-period", "nan"),
        ("--health-probe-period", "inf"),
        ("--kubelet-watch-period", "nan"),
        ("--health-quiet-period", "nan"),
        ("--runtime-request-timeout", "1e999"),
        ("--checkpoint-path", "relative/checkpoint"),
        ("--checkpoint-path", ""),
        ("--virtual-manager-path", "relative/vm"),
        ("--virtual-manager-path", ""),
        ("--query-addr", "999.1.1.1"),
        ("--query-addr", "no-such-host.invalid"),
    ],
)
def test_bad_value_exits_2_naming_flag_and_value(tmp_path: Path, flag: str, value: str) -> None:
    rc, out = _run(tmp_path, f"{flag}={value}", timeout=10)
    assert rc == EXIT_CONFIG, f"{flag}={value!r}: exit {rc}\n{out[-3000:]}"
    assert "Traceback" not in out, out
    assert flag in out and (value in out or repr(value) in out), out


def test_malformed_kubeconfig_is_reported_not_a_traceback(tmp_path: Path) -> None:
    """A kubeconfig that is not YAML is like a missing one: named in the log, the agent serves on."""
    bad = tmp_path / "kubeconfig"
    bad.write_text("apiVersion: v1\nclusters: [\n")
    rc, out = _run(tmp_path, f"--kubeconfig={bad}", timeout=8)
    assert rc is None, f"exited {rc}:\n{out[-3000:]}"
    assert "Traceback" not in out, out
    assert str(bad) in out, out


@pytest.mark.parametrize(
    ("flag", "content"),
    [
        ("--nvml-lib", "not a library"),
        ("--nvml-lib", None),
    ],
)
def test_bad_file_exits_2_naming_flag_and_path(tmp_path: Path, flag: str, content: str | None) -> None:
    path = tmp_path / "given"
    if content is not None:
        path.write_text(content)
    rc, out = _run(tmp_path, f"{flag}={path}", timeout=10)
    assert rc == EXIT_CONFIG, f"{flag}={path}: exit {rc}\n{out[-3000:]}"
    assert "Traceback" not in out, out
    assert f"{flag}={path}" in out, out


def test_nvml_lib_that_is_not_nvml_exits_2(tmp_path: Path) -> None:
    """A real shared library without NVML's entry points is refused (pynvml would load another one)."""
    libc = ctypes.util.find_library("c")
    assert libc
    rc, out = _run(tmp_path, f"--nvml-lib={libc}", timeout=10)
    assert rc == EXIT_CONFIG, f"exit {rc}\n{out[-3000:]}"
    assert f"--nvml-lib={libc}" in out and "nvmlInit" in out, out
