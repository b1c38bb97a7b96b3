"""The node name the agent watches pods of is the kubelet's: the kubelet lower-cases (and trims) the host
name and its own --hostname-override, and node names are lower-case DNS subdomains."""

from __future__ import annotations

import socket

import pytest

from gpumanager import cli
from gpumanager.config import Config


def parse(*argv: str, env: dict[str, str] | None = None) -> Config:
    args = cli.build_parser({}).parse_args(cli.normalize_argv(argv))
    return cli.config_from_args(args, env or {})


def test_the_host_name_is_the_kubelets_node_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "GPU-Node-07.Example.COM ")
    assert parse().resolved_node_name() == "gpu-node-07.example.com"


def test_an_override_is_read_as_the_kubelet_reads_its_own() -> None:
    assert parse("--hostname-override=GPU-Node-07").resolved_node_name() == "gpu-node-07"
    assert parse("--hostname-override= node-1 ").resolved_node_name() == "node-1"


def test_node_name_from_the_downward_api_is_used_as_given() -> None:
    assert parse(env={"NODE_NAME": "node-3"}).resolved_node_name() == "node-3"
