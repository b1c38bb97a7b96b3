"""What an operator new to the project meets: relative DRA paths, which the kubelet and the container
runtime could not find, are refused at start."""

from __future__ import annotations

import pytest

from gpumanager import cli
from gpumanager.config import ConfigError


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--plugin-registry-path", "plugins_registry"), ("--dra-plugin-path", "plugins/x"), ("--cdi-root", "run/cdi")],
)
def test_dra_mode_refuses_a_relative_path_others_must_find(flag: str, value: str) -> None:
    # The kubelet finds the registration socket in its own plugins_registry and dials the endpoint it
    # names; the runtime reads CDI specs from its own directory: a path relative to the agent's working
    # directory reaches none of them.
    args = cli.build_parser({}).parse_args(cli.normalize_argv(["--mode=dra", f"{flag}={value}"]))
    with pytest.raises(ConfigError) as info:
        cli.config_from_args(args, {})
    assert f"{flag}={value}" in str(info.value) and "absolute" in str(info.value)


def test_device_plugin_mode_leaves_the_dra_paths_alone() -> None:
    args = cli.build_parser({}).parse_args(cli.normalize_argv(["--cdi-root=run/cdi"]))
    assert cli.config_from_args(args, {}).cdi_root == "run/cdi"
