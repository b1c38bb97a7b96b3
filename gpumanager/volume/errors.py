"""The one exception type of the driver mirror."""

from __future__ import annotations


class VolumeError(Exception):
    """The driver mirror cannot be built; the message names the file or value at fault."""


class NotElfError(VolumeError):
    """A file that should be an ELF object is not one (or is unreadable as one)."""


class SourceChangedError(VolumeError):
    """A driver file changed while the mirror read it (a driver being installed): worth trying again soon."""
