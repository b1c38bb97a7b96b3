"""Command-line flags map to Config with gpu-manager's names and meanings; bad values are refused clearly."""

from __future__ import annotations

import json
import logging
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import gpumanager
from gpumanager import buildinfo, cli, flagspec
from gpumanager.config import Config, ConfigError, parse_node_labels


def parse(*argv: str, env: dict[str, str] | None = None) -> Config:
    args = cli.build_parser(env or {}).parse_args(cli.normalize_argv(argv))
    return cli.config_from_args(args, env or {})


def test_defaults_match_gpu_manager() -> None:
    c = parse()
    assert c.query_port == 5678
    assert c.query_addr == "localhost"
    assert c.device_plugin_path == "/var/lib/kubelet/device-plugins/"
    assert c.virtual_manager_path == "/etc/gpu-manager/vm"
    assert c.checkpoint_path == "/etc/gpu-manager/checkpoint"
    assert c.share_mode is False
    assert c.allocation_check_period == 30
    assert c.display_socket == "/var/run/gpu-manager.sock"
    assert c.ignored_xids == (13, 31, 43, 45, 68, 109)
    assert c.health_quiet_period == 300.0


def test_upstream_command_line_is_accepted() -> None:
    c = parse(
        "--extra-config=/etc/gpu-manager/extra-config.json",
        "--v=2",
        "--hostname-override=node-1",
        "--share-mode=true",
        "--volume-config=/etc/gpu-manager/volume.conf",
        "--log-dir=",
        "--query-addr=0.0.0.0",
        "--wait_timeout=2m",
    )
    assert c.share_mode is True
    assert c.hostname_override == "node-1"
    assert c.query_addr == "0.0.0.0"
    assert c.wait_timeout == 120.0


def test_bare_boolean_flag_and_underscores() -> None:
    assert parse("--share_mode").share_mode is True
    assert parse("--share-mode=false").share_mode is False


def test_node_name_resolution_order() -> None:
    assert parse("--hostname-override=a", env={"NODE_NAME": "b"}).resolved_node_name() == "a"
    assert parse(env={"NODE_NAME": "b"}).resolved_node_name() == "b"
    assert parse().resolved_node_name()  # falls back to the host name


def test_ignored_xids_flag() -> None:
    assert parse("--ignored-xids=79,13").ignored_xids == (13, 79)
    assert parse("--ignored-xids=").ignored_xids == ()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--query-port=70000"], "--query-port=70000"),
        (["--cgroup-driver=foo"], "--cgroup-driver='foo'"),
        (["--allocation-check-period=0"], "--allocation-check-period=0"),
        (["--node-labels=a=1,broken"], "'broken'"),
        (["--driver=amd"], "--driver='amd'"),
        (["--display-socket=/" + "x" * 120], "--display-socket"),
    ],
)
def test_invalid_values_name_flag_and_value(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(*argv)
    assert message in str(err.value)


@pytest.mark.parametrize("argv", [["--share-mode=maybe"], ["--ignored-xids=a,b"], ["--wait-timeout=soon"]])
def test_unparseable_values_exit_with_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert argv[0].split("=")[1] in capsys.readouterr().err


def test_node_labels() -> None:
    assert parse_node_labels("a=1, b=2,") == {"a": "1", "b": "2"}
    assert parse_node_labels("") == {}


def test_version_flag_prints_version_and_commit(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert f"gpu-manager {gpumanager.__version__} (commit {buildinfo.commit()}," in out
    assert re.fullmatch(r"[0-9a-f]{40}", buildinfo.commit())  # this checkout's HEAD


def test_every_flag_is_read_from_its_environment_variable() -> None:
    fields = list(flagspec.flag_fields(Config))
    assert {f.env for f in fields} >= {"GPU_MANAGER_SHARE_MODE", "GPU_MANAGER_DEVICE_PLUGIN_PATH", "GPU_MANAGER_V"}
    samples = {int: "7", float: "90s", str: "/x/y", tuple: "79,13"}
    # String flags with a grammar of their own (klog's).
    special = {"--vmodule": "allocator=4", "--log-backtrace-at": "allocator.py:12"}
    for f in fields:
        other_choice = next((c for c in f.spec.choices if c != f.default), None)
        raw = special.get(f.flag) or other_choice or samples.get(type(f.default), str(not f.default).lower())
        args = cli.build_parser({f.env: raw}).parse_args([])
        assert getattr(args, f.name) == f.spec.parse(raw) != f.default, f.flag


def test_flag_wins_over_environment() -> None:
    env = {"GPU_MANAGER_QUERY_PORT": "6000", "GPU_MANAGER_SHARE_MODE": "true", "GPU_MANAGER_IGNORED_XIDS": "79"}
    c = parse("--query-port=7000", "--share-mode=false", env=env)
    assert (c.query_port, c.share_mode, c.ignored_xids) == (7000, False, (79,))
    assert parse("--share_mode", env={"GPU_MANAGER_SHARE_MODE": "false"}).share_mode is True


def test_bad_environment_value_exits_2_naming_variable_and_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.build_parser({"GPU_MANAGER_WAIT_TIMEOUT": "soon"})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "GPU_MANAGER_WAIT_TIMEOUT='soon'" in err and "--wait-timeout" in err


def test_bad_environment_value_from_main_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_MANAGER_QUERY_PORT", "many")
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 2


def test_help_shows_every_default_as_typed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for f in flagspec.flag_fields(Config):
        assert f"{f.flag} " in out
        assert f"(default: {f.default_text()}; env {f.env})" in out, f.flag
    assert "(13, 31" not in out  # a list, not a Python tuple
    assert "default: 13,31,43,45,68,109;" in out
    assert "default: 5m;" in out and "default: 5s;" in out


@pytest.mark.parametrize(
    ("seconds", "text"), [(300.0, "5m"), (0.1, "100ms"), (1.0, "1s"), (60.0, "1m"), (7200.0, "2h"), (1.5, "1500ms")]
)
def test_durations_are_shown_as_typed(seconds: float, text: str) -> None:
    assert flagspec.format_duration(seconds) == text
    assert flagspec.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["\u00b2s", "5\u00b2ms", "x", "nan", "1e999s"])
def test_a_duration_that_is_not_one_is_refused_by_name(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    # A superscript digit passes str.isdigit(), and float() then raised its own message.
    with pytest.raises(SystemExit) as exc:
        cli.build_parser({}).parse_args([f"--wait-timeout={text}"])
    assert exc.value.code == 2
    assert f"argument --wait-timeout: {text!r} is not a duration" in capsys.readouterr().err


def test_readme_flags_table_is_current() -> None:
    script = runpy.run_path(str(Path(__file__).resolve().parent.parent / "scripts" / "flags_table.py"))
    readme = script["README"].read_text()
    assert script["replace_block"](readme) == readme, "README flags table: run python scripts/flags_table.py"
    for f in flagspec.flag_fields(Config):
        assert f"| `{f.flag}` |" in readme


def test_log_format_json_writes_one_object_per_line(tmp_path: Path) -> None:
    args = cli.build_parser().parse_args(["--log-format=json", f"--log-dir={tmp_path}", "--logtostderr=false"])
    try:
        cli.setup_logging(args)
        logging.getLogger("gpumanager.test").info("hello %s", "world")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("gpumanager.test").exception("failed")
    finally:
        _reset_logging()
    lines = (tmp_path / "gpu-manager.log").read_text().splitlines()
    first, second = (json.loads(line) for line in lines)
    assert first["msg"] == "hello world" and first["level"] == "info" and first["logger"] == "gpumanager.test"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["ts"])
    assert second["level"] == "error" and "RuntimeError: boom" in second["exc"]


def test_a_stack_asked_for_is_written(tmp_path: Path) -> None:
    args = cli.build_parser().parse_args([f"--log-dir={tmp_path}", "--logtostderr=false"])
    try:
        cli.setup_logging(args)
        logging.getLogger("gpumanager.test").warning("here", stack_info=True)
    finally:
        _reset_logging()
    text = (tmp_path / "gpu-manager.log").read_text()
    assert "WARNING gpumanager.test: here\nStack (most recent call last):" in text
    assert "test_a_stack_asked_for_is_written" in text


def test_a_crash_in_native_code_writes_the_python_stacks() -> None:
    # A fault in NVML or gRPC's C code ends the process at once: what each thread was doing is the
    # operator's only clue.
    code = (
        "import ctypes\n"
        "from gpumanager import cli\n"
        "cli.setup_logging(cli.build_parser({}).parse_args([]))\n"
        "def probe_gpu():\n"
        "    ctypes.string_at(0)\n"
        "probe_gpu()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode < 0, done.stderr
    assert "Fatal Python error: Segmentation fault" in done.stderr
    assert "in probe_gpu" in done.stderr


def test_log_format_rejects_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["--log-format=xml"])
    assert exc.value.code == 2
    assert "'xml'" in capsys.readouterr().err


def test_log_file_is_rotated(tmp_path: Path) -> None:
    args = cli.build_parser().parse_args([f"--log-dir={tmp_path}", "--log-file-max-size=1", "--logtostderr=false"])
    try:
        cli.setup_logging(args)
        line = "x" * 1000
        for _ in range(5000):  # about 5 MiB
            logging.getLogger("gpumanager.test").info(line)
    finally:
        _reset_logging()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["gpu-manager.log", "gpu-manager.log.1", "gpu-manager.log.2", "gpu-manager.log.3"]
    assert all((tmp_path / f).stat().st_size <= (1 << 20) for f in files)


def test_no_log_file_without_log_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    try:
        cli.setup_logging(cli.build_parser().parse_args([]))
        handlers = logging.getLogger().handlers
        assert [type(h) for h in handlers] == [logging.StreamHandler]
    finally:
        _reset_logging()


def test_unusable_log_dir_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    assert cli.main([f"--log-dir={tmp_path / 'file' / 'sub'}"]) == cli.EXIT_CONFIG
    assert f"--log-dir={tmp_path / 'file' / 'sub'}" in capsys.readouterr().err


def _reset_logging() -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = True


def test_dra_flags() -> None:
    c = parse("--mode=dra", "--dra-driver-name=gpu.example.com")
    assert (c.mode, c.dra_driver_name) == ("dra", "gpu.example.com")
    assert str(c.dra_socket_dir) == "/var/lib/kubelet/plugins/gpu.example.com"
    assert (c.plugin_registry_path, c.cdi_root) == ("/var/lib/kubelet/plugins_registry", "/var/run/cdi")
    assert parse().mode == "device-plugin"


def test_bad_dra_flags_name_the_flag_and_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"--dra-driver-name='Not_A_Name'"):
        parse("--mode=dra", "--dra-driver-name=Not_A_Name")
    with pytest.raises(ConfigError, match="--dra-plugin-path"):
        parse("--mode=dra", "--dra-plugin-path=/" + "d" * 110)
    with pytest.raises(SystemExit) as exc:
        parse("--mode=gpu")
    assert exc.value.code == 2
    assert "--mode" in capsys.readouterr().err
