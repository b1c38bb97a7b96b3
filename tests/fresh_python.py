"""Running a piece of Python in a fresh interpreter: what it loads there is its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any


def run_json(code: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = 60.0) -> Any:
    """Run ``code`` with ``args`` (its ``sys.argv[1:]``) in a new interpreter like this one, with this
    environment plus ``env``; the JSON document on the last line it prints. A failure shows its stderr."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])
