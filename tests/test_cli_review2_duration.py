"""Durations as Go's time.ParseDuration reads them: gpu-manager v1.1's --wait-timeout and
--runtime-request-timeout are Go durations, and pflag shows their defaults as ``1m0s`` and ``5s``."""

from __future__ import annotations

import pytest

from gpumanager import cli, flagspec
from gpumanager.config import Config, ConfigError


def parse(*argv: str) -> Config:
    args = cli.build_parser({}).parse_args(cli.normalize_argv(argv))
    return cli.config_from_args(args, {})


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1m0s", 60.0),
        ("2m30s", 150.0),
        ("1h0m0s", 3600.0),
        ("1h30m", 5400.0),
        ("1.5m", 90.0),
        ("1m0.5s", 60.5),
        ("1500us", 0.0015),
        ("1500µs", 0.0015),
        ("2000000ns", 0.002),
        ("+30s", 30.0),
        ("30", 30.0),
        ("0.5", 0.5),
    ],
)
def test_go_durations_are_read_as_go_reads_them(text: str, seconds: float) -> None:
    assert flagspec.parse_duration(text) == pytest.approx(seconds)


def test_upstream_defaults_as_pflag_prints_them_are_accepted() -> None:
    c = parse("--wait-timeout=1m0s", "--runtime-request-timeout=2m0s")
    assert (c.wait_timeout, c.runtime_request_timeout) == (60.0, 120.0)


@pytest.mark.parametrize(
    "text", ["1m0", "m", "1x", "1s1", "--1s", "1.2.3s", "\u0665s", "1 m", ".s", "1_000", "infinity"]
)
def test_what_go_refuses_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        flagspec.parse_duration(text)


def test_a_negative_duration_is_refused_by_the_flag() -> None:
    with pytest.raises(ConfigError, match="--wait-timeout=-60"):
        parse("--wait-timeout=-1m")
