"""The driver version, read from the name of the real ``libcuda.so.<version>``."""

from __future__ import annotations

import re
from dataclasses import dataclass

_LIBCUDA = re.compile(r"^libcuda\.so\.(\d+(?:\.[0-9A-Za-z]+)*)\Z")


@dataclass(frozen=True)
class DriverVersion:
    """``full`` as in the file name (``550.54.15``); ``major``/``minor`` its first two numbers."""

    full: str
    major: int
    minor: int

    def __str__(self) -> str:
        return self.full


def version_from_libcuda(basename: str) -> DriverVersion | None:
    """``libcuda.so.550.54.15`` -> 550.54.15; None for ``libcuda.so``, ``libcuda.so.1`` and other names.

    Unlike upstream (which read ``470.82.01`` as minor 0), the minor number is the second
    component as an integer.
    """
    match = _LIBCUDA.match(basename)
    if match is None:
        return None
    full = match.group(1)
    parts = full.split(".")
    if len(parts) < 2:  # "libcuda.so.1" is the soname, not a version
        return None
    major = int(parts[0])
    minor = int(parts[1]) if parts[1].isascii() and parts[1].isdigit() else 0
    return DriverVersion(full, major, minor)
