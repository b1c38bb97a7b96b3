"""Prometheus text exposition format 0.0.4, written directly for the large per-container families.

``prometheus_client.generate_latest`` formats every label of every sample on every
scrape; with hundreds of containers that alone takes longer than the whole scrape
should. Here a container's label set is rendered once and reused while the
container lives, so a scrape only formats numbers. The output is the same text
format (``promtool check metrics`` reads both alike).

``FamilyText`` writes the families of a registry the same way, with the same caching.

``go_float`` spells a number as Go's ``strconv.FormatFloat(f, 'g', -1, 64)``, which
is what tkestack gpu-manager's client library wrote; the legacy families use it to
stay byte for byte the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from decimal import Decimal

from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString


def escape_label(value: str) -> str:
    """A label value escaped for the text format (backslash, double quote, newline)."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value


def escape_help(text: str) -> str:
    """A HELP text escaped for the text format (backslash, newline)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def labels(names: Sequence[str], values: Sequence[str]) -> str:
    """``{a="1",b="2"}`` (empty string for no labels)."""
    if not names:
        return ""
    return "{" + ",".join(f'{n}="{escape_label(v)}"' for n, v in zip(names, values, strict=True)) + "}"


def header(name: str, help_text: str, kind: str) -> str:
    """The ``# HELP`` and ``# TYPE`` lines of a family."""
    return f"# HELP {name} {escape_help(help_text)}\n# TYPE {name} {kind}\n"


def go_float(value: float) -> str:
    """``strconv.FormatFloat(value, 'g', -1, 64)``: shortest digits, exponent form below 1e-4 or from 1e6."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if value == 0:  # client_golang writes 0 for -0 too
        return "0"
    # repr() gives the shortest digits that read back to the same float, as Go's -1 precision does.
    sign, digits, exponent = Decimal(repr(float(value))).normalize().as_tuple()
    assert isinstance(exponent, int)
    text = "".join(map(str, digits))
    point = len(text) + exponent  # position of the decimal point relative to the digits
    x = point - 1  # exponent in scientific notation
    out = "-" if sign else ""
    # Go: %e when x < -4 || x >= eprec, and eprec is 6 for the shortest form ('g', -1).
    if x < -4 or x >= 6:
        mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
        return f"{out}{mantissa}e{'-' if x < 0 else '+'}{abs(x):02d}"
    if point <= 0:
        return f"{out}0.{'0' * -point}{text}"
    if point >= len(text):
        return f"{out}{text}{'0' * (point - len(text))}"
    return f"{out}{text[:point]}.{text[point:]}"


_KINDS = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}


class FamilyText:
    """The text of a registry's families, as ``prometheus_client.generate_latest`` writes it.

    Each series' name and label set is rendered once and kept while the series exists, and its
    line while its value stays the same, so a scrape formats only values that changed. The page
    carries no ``_created`` series (they are disabled).
    """

    def __init__(self) -> None:
        self._lines: dict[_SeriesKey, tuple[str, float, object, str]] = {}  # prefix, value, timestamp, line
        self._headers: dict[tuple[str, str, str], str] = {}

    def render(self, families: Iterable[Metric]) -> str:
        """Every family: ``# HELP``, ``# TYPE`` and one line per sample."""
        known = self._lines
        current: dict[_SeriesKey, tuple[str, float, object, str]] = {}
        out: list[str] = []
        for metric in families:
            head_key = (metric.name, metric.type, metric.documentation)
            head = self._headers.get(head_key)
            if head is None:
                suffix = "_total" if metric.type == "counter" else "_info" if metric.type == "info" else ""
                kind = _KINDS.get(metric.type, metric.type)
                head = self._headers[head_key] = header(metric.name + suffix, metric.documentation, kind)
            out.append(head)
            for s in metric.samples:
                key = (s.name, tuple(s.labels.items()))
                entry = known.get(key)
                value = float(s.value)
                if entry is None or not _same(entry[1], value) or entry[2] != s.timestamp:
                    if entry is None:
                        items = sorted(s.labels.items())
                        prefix = s.name + labels([k for k, _ in items], [v for _, v in items])
                    else:
                        prefix = entry[0]
                    stamp = "" if s.timestamp is None else f" {int(float(s.timestamp) * 1000):d}"
                    text = floatToGoString(value)  # type: ignore[no-untyped-call]
                    entry = (prefix, value, s.timestamp, f"{prefix} {text}{stamp}\n")
                current[key] = entry
                out.append(entry[3])
        self._lines = current
        return "".join(out)


_SeriesKey = tuple[str, tuple[tuple[str, str], ...]]


def _same(a: float, b: float) -> bool:
    """Whether two values are written alike (0.0 and -0.0 are not; NaN never equals, so is written again)."""
    return a == b and (a != 0 or math.copysign(1.0, a) == math.copysign(1.0, b))
