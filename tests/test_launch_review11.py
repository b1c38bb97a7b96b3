"""A stop signal while the ``gpu-manager`` command is still loading its modules: one line, status 0.

The command's entry point is read from pyproject.toml and run as the installed script runs it. A
stand-in for a standard-library module the command line imports (``textwrap``) is put first on the
module path: it marks that loading has begun and stays there for seconds, so the signal arrives at a
known moment of the load, as it can on a busy node."""

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

SLOW_TEXTWRAP = """
import os, sys, time, importlib.machinery
open(os.environ["SLOW_IMPORT_MARK"], "w").close()
time.sleep(20)
_spec = importlib.machinery.PathFinder.find_spec("textwrap", [os.path.dirname(os.__file__)])
exec(compile(open(_spec.origin).read(), _spec.origin, "exec"), globals())
"""


def _entry_point() -> tuple[str, str]:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["gpu-manager"].partition(":")
    return module, func


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_while_the_command_loads_exits_0_with_one_line(tmp_path: Path, signum: signal.Signals) -> None:
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "textwrap.py").write_text(SLOW_TEXTWRAP)
    mark = tmp_path / "loading"
    module, func = _entry_point()
    env = {**os.environ, "PYTHONPATH": f"{slow}:{REPO}", "SLOW_IMPORT_MARK": str(mark)}
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())", "--version"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not mark.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the command never began loading the command line"
            time.sleep(0.01)
        proc.send_signal(signum)
        _out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "Traceback" not in err, err
    assert proc.returncode == 0, (proc.returncode, err)
    assert err.strip() == f"gpu-manager: received {signum.name} while starting; exiting", err
