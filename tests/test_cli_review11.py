"""The gpu-manager command line refuses what Go's flag package refuses, naming what was given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpumanager.cli import build_parser, normalize_argv


def _refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as stop:
        build_parser({}).parse_args(normalize_argv(argv))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "arg",
    [
        "--share=true",  # a prefix of --share-mode: Go refuses "flag provided but not defined: -share"
        "--hostname=node1",  # of --hostname-override
        "--volume=/etc/gpu-manager/volume.conf",  # of --volume-config
        "-share=true",
        "--node-label=a=b",  # a typo of --node-labels
    ],
)
def test_a_prefix_of_a_flag_is_not_that_flag(capsys: pytest.CaptureFixture[str], arg: str) -> None:
    err = _refusal(capsys, [arg])
    assert arg.split("=", 1)[0].lstrip("-") in err, err


def test_klog_log_file_is_refused_as_itself_not_as_log_file_max_size(capsys: pytest.CaptureFixture[str]) -> None:
    # klog's --log_file (a flag gpu-manager does not have) must not be read as --log-file-max-size.
    err = _refusal(capsys, ["--log_file=/var/log/gpu-manager.log"])
    assert "--log-file-max-size" not in err, err
    assert "log-file" in err, err


def test_whole_flag_names_still_work() -> None:
    args = build_parser({}).parse_args(
        normalize_argv(["--share_mode=true", "-v=4", "--log-file-max-size=5", "--hostname-override=node1"])
    )
    assert args.share_mode is True and args.v == 4 and args.log_file_max_size == 5
    assert args.hostname_override == "node1"


def test_selftest_refuses_a_prefix_of_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from gpumanager.selftest.command import build_parser as selftest_parser

    with pytest.raises(SystemExit) as stop:
        selftest_parser().parse_args(["--mem=100"])  # not --memory-mib
    assert stop.value.code == 2
    assert "--mem=100" in capsys.readouterr().err


def test_a_gpu_client_path_too_long_for_the_kernel_is_one_config_error() -> None:
    from gpumanager.config import Config, ConfigError

    with pytest.raises(ConfigError, match=r"^--gpu-client=x+: File name too long$"):
        Config(gpu_client="x" * 5000, node_name="node1").validate()


def test_a_gpu_client_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    from gpumanager.config import Config, ConfigError

    with pytest.raises(ConfigError, match=r"--gpu-client=.*: not a regular file"):
        Config(gpu_client=str(tmp_path), node_name="node1").validate()


def test_a_value_with_a_line_break_is_refused_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpumanager.cli", "--checkpoint-path=relative\nINFO forged line", "--v=0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--checkpoint-path=relative\\nINFO forged line" in done.stderr, done.stderr


def test_a_path_that_is_not_utf8_is_logged_to_the_log_file(tmp_path: Path) -> None:
    # A host path with a byte that is not UTF-8 (a driver directory named in Latin-1) reaches the
    # log as a surrogate escape; the file must get the line, not a "Logging error" traceback.
    script = (
        "import logging, sys\n"
        "from gpumanager.cli import build_parser, normalize_argv, setup_logging\n"
        "setup_logging(build_parser({}).parse_args(normalize_argv(sys.argv[1:])))\n"
        "logging.getLogger('gpumanager.volume.keeper').warning('mirrored %s', "
        "b'/usr/lib/caf\\xe9/libcuda.so.1'.decode('utf-8', 'surrogateescape'))\n"
    )
    for fmt in ("text", "json"):
        log_dir = tmp_path / fmt
        done = subprocess.run(
            [sys.executable, "-c", script, f"--log-dir={log_dir}", f"--log-format={fmt}"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0 and "Logging error" not in done.stderr, done.stderr
        written = (log_dir / "gpu-manager.log").read_text(encoding="utf-8")
        assert "mirrored /usr/lib/caf" in written and "libcuda.so.1" in written, written


def test_a_misspelled_flag_variable_is_warned_about() -> None:
    # GPU_MANAGER_SHARE_MOD (for GPU_MANAGER_SHARE_MODE) changes nothing: the operator must be told.
    env = {**os.environ, "GPU_MANAGER_SHARE_MOD": "true", "GPU_MANAGER_COMMIT": "abc"}
    done = subprocess.run(
        [sys.executable, "-m", "gpumanager.cli", "--query-port=99999"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    warned = [line for line in done.stderr.splitlines() if "GPU_MANAGER_SHARE_MOD" in line]
    assert len(warned) == 1 and "GPU_MANAGER_SHARE_MODE" in warned[0] and "WARNING" in warned[0], done.stderr
    assert "GPU_MANAGER_COMMIT" not in done.stderr, done.stderr  # the build's own variable is no flag's
