"""gpu-manager v1.1 command lines as operators wrote them: Go/klog flag forms, klog's logging flags,
errors of one line, and extra-config.json files that are not text."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gpumanager import cli
from tests.test_cli_review2 import parse

# -- klog's flags ---------------------------------------------------------------------------------


def test_every_klog_flag_of_gpu_manager_is_accepted() -> None:
    c = parse("--stderrthreshold=WARNING", "--vmodule=allocator=4,serv*=2", "--log-backtrace-at=check.py:12")
    assert (c.stderrthreshold, c.vmodule, c.log_backtrace_at) == ("WARNING", "allocator=4,serv*=2", "check.py:12")
    c = parse("--stderrthreshold=0", "--log_backtrace_at=app.py:1", "-vmodule=x=1")
    assert (c.stderrthreshold, c.log_backtrace_at, c.vmodule) == ("INFO", "app.py:1", "x=1")
    assert parse().stderrthreshold == "ERROR"  # klog's default


@pytest.mark.parametrize(
    ("arg", "flag"),
    [
        ("--stderrthreshold=LOUD", "--stderrthreshold"),
        ("--stderrthreshold=7", "--stderrthreshold"),
        ("--vmodule=allocator", "--vmodule"),
        ("--vmodule=allocator=x", "--vmodule"),
        ("--log-backtrace-at=server.go", "--log-backtrace-at"),
        ("--log-backtrace-at=server.go:0", "--log-backtrace-at"),
    ],
)
def test_a_bad_klog_flag_value_is_refused_by_name(arg: str, flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(arg)
    assert exc.value.code == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert flag in err and arg.split("=", 1)[1] in err, err


def test_errors_reach_stderr_when_the_log_goes_to_a_file(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], clean_logging: None
) -> None:
    """upstream's DaemonSet runs ``--logtostderr=false --log-dir=...``: klog still writes ERROR and above
    to stderr (--stderrthreshold), so `kubectl logs` shows why the agent failed."""
    rc = cli.main(["--logtostderr=false", f"--log-dir={tmp_path}", "--query-port=99999"])
    assert rc == cli.EXIT_CONFIG
    err = capfd.readouterr().err
    assert "--query-port=99999" in err, err
    assert "--query-port=99999" in (tmp_path / "gpu-manager.log").read_text()


def test_stderrthreshold_chooses_what_else_reaches_stderr(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], clean_logging: None
) -> None:
    args = cli.build_parser({}).parse_args(
        ["--logtostderr=false", f"--log-dir={tmp_path}", "--stderrthreshold=WARNING"]
    )
    cli.setup_logging(args)
    logging.getLogger("gpumanager.t").info("an info line")
    logging.getLogger("gpumanager.t").warning("a warning line")
    err = capfd.readouterr().err
    assert "a warning line" in err and "an info line" not in err
    assert "an info line" in (tmp_path / "gpu-manager.log").read_text()


def test_vmodule_turns_on_debug_messages_of_matching_modules(tmp_path: Path, clean_logging: None) -> None:
    args = cli.build_parser({}).parse_args(
        [f"--log-dir={tmp_path}", "--logtostderr=false", "--stderrthreshold=FATAL", "--vmodule=test_cli_rev*_klog=4"]
    )
    cli.setup_logging(args)
    logging.getLogger("gpumanager.t").debug("debug from this module")
    text = (tmp_path / "gpu-manager.log").read_text()
    assert "debug from this module" in text


def test_vmodule_below_4_silences_debug_of_a_module_under_v4(tmp_path: Path, clean_logging: None) -> None:
    args = cli.build_parser({}).parse_args(
        [f"--log-dir={tmp_path}", "--logtostderr=false", "--v=4", "--vmodule=test_cli_review2_klog=0"]
    )
    cli.setup_logging(args)
    logging.getLogger("gpumanager.t").debug("quiet debug")
    logging.getLogger("gpumanager.t").info("loud info")
    text = (tmp_path / "gpu-manager.log").read_text()
    assert "loud info" in text and "quiet debug" not in text


def test_log_backtrace_at_writes_the_stack_of_that_line(tmp_path: Path, clean_logging: None) -> None:
    import inspect

    line = inspect.currentframe().f_lineno + 6  # type: ignore[union-attr]
    args = cli.build_parser({}).parse_args(
        [f"--log-dir={tmp_path}", "--logtostderr=false", f"--log-backtrace-at=test_cli_review2_klog.py:{line}"]
    )
    cli.setup_logging(args)
    logging.getLogger("gpumanager.t").info("other line")
    logging.getLogger("gpumanager.t").info("the traced line")
    text = (tmp_path / "gpu-manager.log").read_text()
    assert "the traced line\nStack (most recent call last):" in text
    assert "test_log_backtrace_at_writes_the_stack_of_that_line" in text
    assert "other line\nStack" not in text
