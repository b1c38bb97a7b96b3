"""``gpu-manager-extender``'s command line as an operator meets it: flags named whole, a bad one reported
in one line, and a stop signal while the command still loads answered with one line and status 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

SLOW_SSL = """
import os, sys, time, importlib.machinery
open(os.environ["SLOW_IMPORT_MARK"], "w").close()
time.sleep(20)
_spec = importlib.machinery.PathFinder.find_spec("ssl", [os.path.dirname(os.__file__)])
exec(compile(open(_spec.origin).read(), _spec.origin, "exec"), globals())
"""


def _command(*args: str) -> list[str]:
    """The installed script's way of running the extender: its entry point from pyproject.toml."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["gpu-manager-extender"].partition(":")
    return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())", *args]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_command(*args), capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(
    ("flag", "named"),
    [("--assume=30", "--assume"), ("--bind=5", "--bind"), ("--pol=spread", "--pol")],
)
def test_a_prefix_of_a_flag_is_refused_as_given(flag: str, named: str) -> None:
    got = _run(flag, "--version")
    assert got.returncode == 2, (got.returncode, got.stdout, got.stderr)
    assert named in got.stderr, got.stderr
    assert len(got.stderr.strip().splitlines()) == 1, got.stderr


@pytest.mark.parametrize("args", [["--policy=tightest"], ["--bind-timeout=soon"], ["--no-such-flag"]])
def test_a_bad_flag_is_one_line(args: list[str]) -> None:
    got = _run(*args)
    assert got.returncode == 2, (got.returncode, got.stderr)
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1, got.stderr
    assert lines[0].startswith("gpu-manager-extender: "), got.stderr
    assert "Traceback" not in got.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_while_the_command_loads_exits_0_with_one_line(tmp_path: Path, signum: signal.Signals) -> None:
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "ssl.py").write_text(SLOW_SSL)
    mark = tmp_path / "loading"
    env = {**os.environ, "PYTHONPATH": f"{slow}:{REPO}", "SLOW_IMPORT_MARK": str(mark)}
    proc = subprocess.Popen(_command("--version"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not mark.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the command never began loading"
            time.sleep(0.01)
        proc.send_signal(signum)
        _out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "Traceback" not in err, err
    assert proc.returncode == 0, (proc.returncode, err)
    assert err.strip() == f"gpu-manager-extender: received {signum.name} while starting; exiting", err


SLOW_CSV = SLOW_SSL.replace('"ssl"', '"csv"')
KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_while_the_extender_loads_its_service_exits_0_with_one_line(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """After the flags are read, the service and the API client load (hundreds of ms): a stop then is
    answered the same way."""
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "csv.py").write_text(SLOW_CSV)
    mark = tmp_path / "loading"
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)
    env = {**os.environ, "PYTHONPATH": f"{slow}:{REPO}", "SLOW_IMPORT_MARK": str(mark)}
    proc = subprocess.Popen(
        _command(f"--kubeconfig={kubeconfig}", "--listen=127.0.0.1:0"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not mark.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the extender never began loading its service"
            time.sleep(0.01)
        proc.send_signal(signum)
        _out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "Traceback" not in err, err
    assert proc.returncode == 0, (proc.returncode, err)
    assert err.strip().endswith(f"gpu-manager-extender: received {signum.name} while starting; exiting"), err
