"""The order of candidate pods: ``predicate-time``, else the creation timestamp, read as upstream reads it."""

from __future__ import annotations

import calendar
import time

import pytest

from gpumanager.allocation import pods
from tests.fresh_python import run_json


def pod(created: object, annotations: dict[str, str] | None = None) -> dict[str, object]:
    return {
        "metadata": {"name": "p", "namespace": "ns", "creationTimestamp": created, "annotations": annotations or {}}
    }


@pytest.mark.parametrize(
    "stamp",
    [
        "1970-01-01T00:00:00Z",
        "2024-02-29T23:59:59Z",
        "2026-11-28T12:01:19Z",
        "2038-01-19T03:14:08Z",
        "9999-12-31T23:59:59Z",
    ],
)
def test_a_creation_timestamp_is_read_in_ns(stamp: str) -> None:
    expected = calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")) * 1_000_000_000
    assert pods.predicate_time(pod(stamp)) == expected


@pytest.mark.parametrize(
    "stamp",
    [
        "",
        "yesterday",
        "2023-02-29T00:00:00Z",  # no such day
        "2024-13-01T00:00:00Z",
        "2024-01-01T24:00:00Z",
        "2024-01-01 00:00:00Z",
        "2024-01-01T00:00:00",
        "2024-01-01T00:00:00+01:00",
        "2024-01-01T00:00:00.5Z",
        "2024-01-0\uff11T00:00:00Z",  # a digit of another script (fullwidth one)
        "+024-01-01T00:00:00Z",
        None,
        12345,
    ],
)
def test_an_unreadable_creation_timestamp_orders_first(stamp: object) -> None:
    assert pods.predicate_time(pod(stamp)) == 0


def test_the_predicate_time_annotation_comes_before_the_creation_time() -> None:
    assert pods.predicate_time(pod("2026-11-28T12:01:19Z", {"tencent.com/predicate-time": "42"})) == 42
    assert pods.predicate_time(pod("1970-01-01T00:00:01Z", {"tencent.com/predicate-time": "soon"})) == 10**9


def test_reading_a_creation_time_loads_no_date_parsing_machinery() -> None:
    # time.strptime imports _strptime and compiles its locale's patterns on first use: about 2 ms
    # that the first Allocate after every start paid.
    loaded = run_json(
        "import json, sys\n"
        "from gpumanager.allocation import pods\n"
        "before = '_strptime' in sys.modules\n"
        "value = pods.predicate_time({'metadata': {'creationTimestamp': '2026-11-28T12:01:19Z'}})\n"
        "print(json.dumps([before, '_strptime' in sys.modules, value]))"
    )
    assert loaded == [False, False, 1795867279 * 10**9]
