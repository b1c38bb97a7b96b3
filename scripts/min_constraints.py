"""Print pip constraints pinning every runtime dependency of pyproject.toml to its declared minimum.

    python scripts/min_constraints.py > constraints.txt
    pip install -c constraints.txt '.[dev]'
    python scripts/min_constraints.py --verify   # exit 1 unless those versions are installed

Used by `make test-min-deps`, which runs the end-to-end tests on those versions: a minimum
that does not work fails there.
"""

from __future__ import annotations

import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def minimums() -> list[str]:
    """``name==version`` for each dependency, from its ``>=`` bound."""
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    pins = []
    for text in deps:
        req = Requirement(text)
        lower = [s.version for s in req.specifier if s.operator == ">="]
        if len(lower) != 1:
            raise SystemExit(f"{PYPROJECT}: {text!r} must declare exactly one minimum (>=)")
        pins.append(f"{req.name}=={lower[0]}")
    return pins


def verify() -> int:
    """Print the installed version of each dependency; 1 if one is not its declared minimum."""
    wrong = 0
    for pin in minimums():
        name, wanted = pin.split("==")
        installed = metadata.version(name)
        print(f"{name} {installed} (declared minimum {wanted})")
        wrong += installed != wanted
    return 1 if wrong else 0


if __name__ == "__main__":
    if "--verify" in sys.argv[1:]:
        sys.exit(verify())
    sys.stdout.write("".join(f"{pin}\n" for pin in minimums()))
