"""Small packages a test writes under its own directory and imports while it runs."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def importable(root: Path, prefix: str) -> Iterator[Path]:
    """``root`` on ``sys.path``; afterwards the modules named ``prefix...`` it loaded are forgotten."""
    before = set(sys.modules)
    sys.path.insert(0, str(root))
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        for name in set(sys.modules) - before:
            if name.split(".")[0].startswith(prefix):
                del sys.modules[name]


def write(root: Path, files: dict[str, str]) -> None:
    """Write each of ``files`` (path under ``root`` -> text, dedented)."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
