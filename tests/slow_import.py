"""Run an installed command while one standard-library module it imports loads slowly, and stop it then.

The command is run as its installed script runs it (its entry point read from pyproject.toml). A stand-in
for ``module``, put first on the module path, marks that loading has begun and stays for seconds before it
loads the real module: a stop signal sent at the mark arrives at a known moment of the command's start, as it
can on a busy node."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_STAND_IN = """
import os, sys, time, importlib.machinery
open(os.environ["SLOW_IMPORT_MARK"], "w").close()
time.sleep(20)
_spec = importlib.machinery.PathFinder.find_spec({module!r}, [os.path.dirname(os.__file__)])
exec(compile(open(_spec.origin).read(), _spec.origin, "exec"), globals())
"""


def command(script: str, *args: str) -> list[str]:
    """The installed ``script``'s way of running: its entry point from pyproject.toml."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts[script].partition(":")
    return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())", *args]


def stopped_while_loading(tmp_path: Path, argv: list[str], module: str, signum: signal.Signals) -> tuple[int, str]:
    """Start ``argv`` with ``module`` loading slowly, send ``signum`` once it loads: (exit status, stderr)."""
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / f"{module}.py").write_text(_STAND_IN.format(module=module))
    mark = tmp_path / "loading"
    env = {**os.environ, "PYTHONPATH": f"{slow}:{REPO}", "SLOW_IMPORT_MARK": str(mark)}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not mark.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"the command never began loading {module}"
            time.sleep(0.01)
        proc.send_signal(signum)
        _out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err
