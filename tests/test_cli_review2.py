"""gpu-manager v1.1 command lines as operators wrote them: Go/klog flag forms, klog's logging flags,
errors of one line, and extra-config.json files that are not text."""

from __future__ import annotations

import pytest

from gpumanager import cli
from gpumanager.config import Config


def parse(*argv: str) -> Config:
    args = cli.build_parser({}).parse_args(cli.normalize_argv(argv))
    return cli.config_from_args(args, {})


# -- flag forms -------------------------------------------------------------------------------------


def test_single_dash_flags_as_go_and_klog_take_them() -> None:
    """klog's ``-v=4``/``-v 4`` and Go's ``-flag=value``/``-flag value`` mean what ``--flag`` does."""
    c = parse("-v=4", "-logtostderr=false", "-log_dir", "/var/log/gpu-manager", "-share-mode", "-query-port", "1234")
    assert (c.v, c.logtostderr, c.log_dir, c.share_mode, c.query_port) == (4, False, "/var/log/gpu-manager", True, 1234)
    assert parse("-v", "3").v == 3
    assert parse("-alsologtostderr=true", "-share_mode=false").alsologtostderr is True
    assert parse("-share_mode=false").share_mode is False


def test_a_value_after_the_end_of_flags_is_left_alone() -> None:
    assert cli.normalize_argv(["--v=1", "--", "-v=4"]) == ["--v=1", "--", "-v=4"]
    assert cli.normalize_argv(["-unknown=1"]) == ["-unknown=1"]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--query-port=abc"], ["--query-port", "'abc'"]),
        (["--share-mode=maybe"], ["--share-mode", "'maybe'"]),
        (["--no-such-flag=1"], ["--no-such-flag=1"]),
        (["-query-port=abc"], ["--query-port", "'abc'"]),
    ],
)
def test_a_bad_flag_is_one_line_exit_2(argv: list[str], names: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert all(n in lines[0] for n in names), err


def test_a_bad_environment_variable_is_one_line_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GPU_MANAGER_SHARE_MODE", "sometimes")
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == cli.EXIT_CONFIG
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "GPU_MANAGER_SHARE_MODE='sometimes'" in lines[0], lines


@pytest.mark.parametrize("value", ["f", "F", "FALSE", "False", "0", "false"])
def test_version_false_in_any_of_gos_spellings_does_not_print_the_version(value: str) -> None:
    args = cli.build_parser({}).parse_args(cli.normalize_argv([f"--version={value}"]))
    assert args.version is False


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("T", True), ("1", True), ("raw", "raw")])
def test_version_true_or_raw_prints_it(value: str, expected: object) -> None:
    assert cli.build_parser({}).parse_args([f"--version={value}"]).version == expected
    assert cli.build_parser({}).parse_args(["--version"]).version is True


def test_a_version_value_that_is_no_boolean_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version=maybe"])
    assert exc.value.code == cli.EXIT_CONFIG
    assert "--version" in capsys.readouterr().err


def test_klogs_v_shorthand_with_its_value_attached() -> None:
    """pflag reads klog's one-letter -v as a shorthand: ``-v4`` is ``-v=4``."""
    assert parse("-v4").v == 4
    assert parse("-v10").v == 10
    assert cli.normalize_argv(["-vx"]) == ["-vx"]
