"""Reading a Prometheus text page in tests: every sample by name and labels, or one of them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

#: Every sample of a page: ``(name, sorted labels) -> value``.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    """Every sample of a /metrics page."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(got: Samples, name: str, *, absent: float | None = None, **labels: str) -> float:
    """The sample of ``name`` with exactly ``labels``; ``absent`` when there is none (a counter with
    labels appears only once counted), or KeyError when ``absent`` is None."""
    key = (name, tuple(sorted(labels.items())))
    if absent is not None and key not in got:
        return absent
    return got[key]
