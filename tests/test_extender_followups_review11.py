"""The extender's flags, request bounds, filter reasons and unanswered Bindings."""

from __future__ import annotations

import subprocess
import sys

import pytest

CMD = [sys.executable, "-m", "gpumanager.extender.cli"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("args", "ttl", "bind"),
    [
        (["--assume-ttl=2", "--bind-timeout=4"], "2", "4"),
        (["--assume-ttl=3"], "3", "4"),  # the default --bind-timeout
        (["--assume-ttl=10", "--bind-timeout=10.5"], "10", "10.5"),
    ],
)
def test_an_assume_ttl_below_the_bind_timeout_is_refused_at_start(args: list[str], ttl: str, bind: str) -> None:
    """An assumption could lapse while its bind still runs: refused, exit 2, one line naming both flags."""
    done = _run(*args, "--kubeconfig=/nonexistent")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"--assume-ttl={ttl}" in lines[0] and f"--bind-timeout={bind}" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_an_assume_ttl_equal_to_the_bind_timeout_is_taken() -> None:
    done = _run("--assume-ttl=4", "--bind-timeout=4", "--kubeconfig=/nonexistent")
    assert done.returncode == 2 and "--kubeconfig=/nonexistent: no such file" in done.stderr, done.stderr
