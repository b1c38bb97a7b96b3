"""How a Config field becomes a command-line flag and an environment variable.

A field declared with one of the helpers below (``text``, ``parsed_text``, ``choice``,
``severity``, ``number``, ``switch``, ``duration``, ``xid_list``) is a flag: ``--<name with - for _>``, also read from
``GPU_MANAGER_<NAME IN UPPER CASE>`` (the flag wins over the variable). The
helper carries the help text, the parser of a value and how the default is shown,
so adding a flag is one field in :class:`gpumanager.config.Config`; ``--help``
and the README's flags table are built from the same declaration.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "GPU_MANAGER_"
_META_KEY = "flag"


@dataclass(frozen=True)
class FlagSpec:
    """What turns one Config field into a flag."""

    help: str
    parse: Callable[[str], Any]
    shown_default: Callable[[Any], str]
    #: bool flags accept a bare ``--flag`` (meaning true), as Go's flag package does.
    bare_means_true: bool = False
    metavar: str = ""
    #: False when the shown default is a description ("none", "in-cluster") rather than a value.
    literal_default: bool = True
    #: The values a choice flag takes (empty for other flags).
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class FlagField:
    """A Config field that is a flag."""

    name: str
    default: Any
    spec: FlagSpec

    @property
    def flag(self) -> str:
        """``--device-plugin-path`` for ``device_plugin_path``."""
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        """``GPU_MANAGER_DEVICE_PLUGIN_PATH`` for ``device_plugin_path``."""
        return ENV_PREFIX + self.name.upper()

    def default_text(self) -> str:
        """The default as an operator would type it (``5m``, ``13,31``, ``false``)."""
        return self.spec.shown_default(self.default)


def parse_bool(text: str) -> bool:
    """Go's strconv.ParseBool plus yes/no/on/off."""
    value = text.strip().lower()
    if value in ("1", "t", "true", "yes", "y", "on"):
        return True
    if value in ("0", "f", "false", "no", "n", "off"):
        return False
    raise ValueError(f"{text!r} is not a boolean")


#: How much of a refused value an error shows.
_SHOWN_CHARS = 80
#: The int64 range of Go's flag integers (strconv.ParseInt's "value out of range" beyond it).
_INT64 = range(-(2**63), 2**63)
#: Whole seconds of Go's longest duration (2^63-1 ns, about 292 years), also threading.TIMEOUT_MAX: a
#: longer wait raises OverflowError.
MAX_SECONDS = 9223372036


def _shown(text: str) -> str:
    return repr(text) if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]!r}... ({len(text)} characters)"


def parse_int(text: str) -> int:
    """A decimal integer in the int64 range, of ASCII digits (int() alone also reads other scripts' digits)."""
    value = text.strip()
    digits = value.lstrip("+-").replace("_", "")
    if not (digits.isascii() and digits.isdigit()):
        raise ValueError(f"{_shown(text)} is not an integer")
    try:
        number = int(value) if len(digits) <= 19 else None  # int() refuses more than 4300 digits
    except ValueError:
        raise ValueError(f"{_shown(text)} is not an integer") from None
    if number is None or number not in _INT64:
        raise ValueError(f"{_shown(text)} is out of range (a 64-bit integer)")
    return number


_DURATION_UNITS = (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0))
#: Go's time.ParseDuration units (``µs`` in both of its spellings).
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_PART = r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:ns|us|\u00b5s|\u03bcs|ms|s|m|h)"
_GO_DURATION = re.compile(rf"[-+]?(?:{_GO_PART})+")
#: A plain number of seconds (not Python's own extras: ``1_000``, ``nan``, ``infinity``).
_SECONDS = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_GO_PARTS = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")


def parse_duration(text: str) -> float:
    """A Go duration as time.ParseDuration reads it (500ms, 5s, 1m0s, 1h30m, 1.5h), or a number of
    seconds; a finite number (not nan, inf or 1e999) of at most :data:`MAX_SECONDS`. A negative one is
    parsed (and refused by the flag)."""
    value = text.strip()
    seconds: float | None = None
    if _GO_DURATION.fullmatch(value):
        seconds = sum(float(number) * _GO_UNITS[unit] for number, unit in _GO_PARTS.findall(value))
        if value.startswith("-"):
            seconds = -seconds
    elif _SECONDS.fullmatch(value):
        seconds = float(value)
    if seconds is None or not math.isfinite(seconds):
        raise ValueError(f"{_shown(text)} is not a duration (e.g. 30s, 5m, 1m30s)")
    if abs(seconds) > MAX_SECONDS:
        raise ValueError(f"{_shown(text)} is longer than any duration ({MAX_SECONDS} s, about 292 years)")
    return seconds


def format_duration(seconds: float) -> str:
    """The shortest Go-style spelling of a whole number of hours, minutes, seconds or milliseconds."""
    for suffix, scale in reversed(_DURATION_UNITS):
        count = seconds / scale
        if count >= 1 and abs(count - round(count)) < 1e-9:
            return f"{round(count)}{suffix}"
    return f"{seconds:g}s"


def parse_xids(text: str) -> tuple[int, ...]:
    """A comma-separated list of XID numbers, sorted and without repeats."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    for item in items:
        if not (item.isascii() and item.isdigit()):
            raise ValueError(f"{item!r} is not an XID number (in {text!r}: a comma-separated list of XID numbers)")
    return tuple(sorted({int(t) for t in items}))


#: klog's severities, by name and by number (--stderrthreshold takes either).
SEVERITIES = ("INFO", "WARNING", "ERROR", "FATAL")


def parse_severity(text: str) -> str:
    """A klog severity: INFO, WARNING, ERROR or FATAL (any case), or its number 0-3; returned by name."""
    value = text.strip().upper()
    if value in SEVERITIES:
        return value
    if value.isascii() and value.isdigit() and int(value) < len(SEVERITIES):
        return SEVERITIES[int(value)]
    raise ValueError(f"{text!r} is not a severity (INFO, WARNING, ERROR, FATAL or 0-3)")


def vmodule_settings(text: str) -> tuple[tuple[str, int], ...]:
    """klog's --vmodule: ``pattern=N,...`` (a glob on the module's file name without its extension, or
    on its path when the pattern holds a ``/``), in the order given."""
    settings = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        pattern, sep, level = item.rpartition("=")
        if not sep or not pattern or not (level.isascii() and level.isdigit()):
            raise ValueError(f"{item!r} is not pattern=N (in {text!r}: a comma-separated list of pattern=N)")
        settings.append((pattern, int(level)))
    return tuple(settings)


def parse_vmodule(text: str) -> str:
    """--vmodule, checked and kept as typed."""
    vmodule_settings(text)
    return text


def parse_trace_location(text: str) -> str:
    """klog's --log-backtrace-at: empty, or ``file:N`` with N a positive line number."""
    if not text:
        return text
    file, sep, line = text.rpartition(":")
    if not sep or not file or not (line.isascii() and line.isdigit()) or int(line) <= 0:
        raise ValueError(f"{text!r} is not file:line (e.g. allocator.py:120)")
    return text


def _declare(default: Any, spec: FlagSpec) -> Any:
    return field(default=default, metadata={_META_KEY: spec})


def text(default: str, help: str, *, shown: str | None = None, metavar: str = "") -> Any:
    """A string flag; ``shown`` replaces the default in help (e.g. ``none`` for an empty path)."""
    return parsed_text(default, help, str, shown=shown, metavar=metavar)


def choice(default: str, options: tuple[str, ...], help: str) -> Any:
    """A string flag that takes one of ``options``."""

    def parse(value: str) -> str:
        if value not in options:
            raise ValueError(f"{value!r} is not one of {', '.join(options)}")
        return value

    return _declare(default, FlagSpec(help, parse, str, metavar="{" + ",".join(options) + "}", choices=options))


def parsed_text(
    default: str, help: str, parse: Callable[[str], str], *, shown: str | None = None, metavar: str = ""
) -> Any:
    """A string flag whose value ``parse`` checks (and may spell canonically)."""
    return _declare(
        default,
        FlagSpec(
            help,
            parse,
            lambda v: shown if shown is not None else str(v),
            metavar=metavar,
            literal_default=shown is None,
        ),
    )


def severity(default: str, help: str) -> Any:
    """A klog severity flag (``--stderrthreshold``): a name of :data:`SEVERITIES` in any case, or its number."""
    return _declare(default, FlagSpec(help, parse_severity, str, metavar="SEVERITY", choices=SEVERITIES))


def number(default: int, help: str, *, metavar: str = "N") -> Any:
    """An integer flag."""
    return _declare(default, FlagSpec(help, parse_int, str, metavar=metavar))


def switch(default: bool, help: str) -> Any:
    """A boolean flag (``--flag``, ``--flag=true|false``)."""
    return _declare(
        default, FlagSpec(help, parse_bool, lambda v: "true" if v else "false", bare_means_true=True, metavar="BOOL")
    )


def duration(default: float, help: str) -> Any:
    """A duration flag, stored in seconds (``30``, ``30s``, ``500ms``, ``5m``)."""
    return _declare(default, FlagSpec(help, parse_duration, format_duration, metavar="DURATION"))


def xid_list(default: tuple[int, ...], help: str) -> Any:
    """A comma-separated list of XIDs."""
    return _declare(
        default, FlagSpec(help, parse_xids, lambda v: ",".join(str(x) for x in v) or "none", metavar="XIDS")
    )


def flag_fields(cls: type) -> Iterator[FlagField]:
    """The flags of a dataclass, in declaration order."""
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_META_KEY)
        if isinstance(spec, FlagSpec):
            yield FlagField(f.name, f.default, spec)
