"""``tencent.com/predicate-time`` read as upstream reads it: Go's ``strconv.ParseUint(s, 10, 64)``.

Python's int() also takes spaces around the digits, '_' between them, a sign and other scripts'
digits; such a value is malformed for upstream, and here it is ordered by the pod's creation time
(as every other malformed value) with a warning naming the pod, the annotation and the value.
"""

from __future__ import annotations

import logging

import pytest

from gpumanager.allocation import pods

CREATED = "1970-01-01T00:00:01Z"  # 10**9 ns


def pod(value: object, name: str = "p") -> dict[str, object]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "creationTimestamp": CREATED,
            "annotations": {"tencent.com/predicate-time": value},
        }
    }


@pytest.mark.parametrize(
    "value",
    [
        " 30",
        "30 ",
        "30\n",
        "3_0",
        "+30",
        "-30",
        "\u0663\u0660",  # Arabic-Indic digits
        "\uff13\uff10",  # fullwidth digits
        "18446744073709551616",  # 2**64: past uint64
        "",
        "soon",
    ],
)
def test_a_value_go_refuses_orders_by_creation_time_with_a_warning(
    value: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gpumanager.allocation.pods")
    name = f"bad-{abs(hash(value))}"
    assert pods.predicate_time(pod(value, name)) == 10**9
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"ns/{name}" in warnings[0] and "tencent.com/predicate-time" in warnings[0] and repr(value) in warnings[0]


def test_the_warning_is_given_once_per_pod_and_value(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpumanager.allocation.pods")
    for _ in range(5):
        assert pods.predicate_time(pod("3_1", "once")) == 10**9
    assert len([r for r in caplog.records if "once" in r.getMessage()]) == 1


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("30", 30),
        ("0", 0),
        ("007", 7),
        ("18446744073709551615", 2**64 - 1),
        ("1795867279000000000", 1795867279 * 10**9),
    ],
)
def test_what_go_reads_is_read(value: str, expected: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpumanager.allocation.pods")
    assert pods.predicate_time(pod(value)) == expected
    assert not caplog.records


@pytest.mark.parametrize(
    ("text", "expected"),
    [("42", 42), ("+42", None), ("-1", None), ("4_2", None), (" 42", None), ("\u0664\u0662", None), ("", None)],
)
def test_go_parse_uint(text: str, expected: int | None) -> None:
    assert pods.go_parse_uint(text) == expected
