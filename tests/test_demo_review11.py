"""README's first command for a newcomer, `make demo`, runs to its end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_make_demo_runs_to_the_end() -> None:
    # `make demo` is `python -m simnode.demo` after the build this suite already needs.
    done = subprocess.run(
        [sys.executable, "-m", "simnode.demo"], cwd=ROOT, capture_output=True, text=True, timeout=280, check=False
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "its vcuda.config: gpu_memory=4096 MiB" in out, out[-3000:]
