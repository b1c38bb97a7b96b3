"""Command-line flags map to Config with gpu-manager's names and meanings; bad values are refused clearly."""

from __future__ import annotations

import pytest

from gpumanager import cli
from gpumanager.config import Config, ConfigError, parse_node_labels


def parse(*argv: str, env: dict[str, str] | None = None) -> Config:
    args = cli.build_parser().parse_args(cli.normalize_argv(argv))
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


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert "gpu-manager" in capsys.readouterr().out
