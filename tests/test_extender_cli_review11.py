"""``gpu-manager-extender``'s command line as an operator meets it: flags named whole, a bad one reported
in one line, and a stop signal while the command still loads answered with one line and status 0."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.slow_import import command, stopped_while_loading


def _command(*args: str) -> list[str]:
    return command("gpu-manager-extender", *args)


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
    status, err = stopped_while_loading(tmp_path, _command("--version"), "ssl", signum)
    assert "Traceback" not in err, err
    assert status == 0, (status, err)
    assert err.strip() == f"gpu-manager-extender: received {signum.name} while starting; exiting", err


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
    """After the flags are read, the service and the API client load (hundreds of ms, ``csv`` among their
    modules): a stop then is answered the same way."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)
    argv = _command(f"--kubeconfig={kubeconfig}", "--listen=127.0.0.1:0")
    status, err = stopped_while_loading(tmp_path, argv, "csv", signum)
    assert "Traceback" not in err, err
    assert status == 0, (status, err)
    assert err.strip().endswith(f"gpu-manager-extender: received {signum.name} while starting; exiting"), err
