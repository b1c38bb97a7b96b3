"""--node-labels: a label the API server would refuse is an operator error of the flag, said at start."""

from __future__ import annotations

import pytest

from gpumanager import cli
from gpumanager.config import Config, ConfigError, parse_node_labels


def parse(*argv: str) -> Config:
    args = cli.build_parser({}).parse_args(cli.normalize_argv(argv))
    return cli.config_from_args(args, {})


@pytest.mark.parametrize(
    ("labels", "named"),
    [
        ("bad key=v", "'bad key'"),
        ("ok=a b", "'a b'"),
        ("x/y/z=1", "'x/y/z'"),
        ("Example.COM/gpu=1", "'Example.COM/gpu'"),
        ("/gpu=1", "'/gpu'"),
        ("gpu-=1", "'gpu-'"),
        ("k=" + "v" * 64, "v" * 64),
        ("k" * 64 + "=v", "k" * 64),
        ("k=-v", "'-v'"),
    ],
)
def test_a_label_the_api_server_refuses_is_refused_naming_the_flag(labels: str, named: str) -> None:
    with pytest.raises(ConfigError, match="--node-labels") as exc:
        parse(f"--node-labels={labels}")
    assert named in str(exc.value)


def test_valid_labels_are_accepted() -> None:
    text = "nvidia-device-enable=enable,example.com/gpu=yes,empty=,A_b.c=X-y_z.1,gaia.tencent.com/gpu-model=auto"
    assert parse_node_labels(text) == {
        "nvidia-device-enable": "enable",
        "example.com/gpu": "yes",
        "empty": "",
        "A_b.c": "X-y_z.1",
        "gaia.tencent.com/gpu-model": "auto",
    }
    # The GPU model label's value is replaced by the model: what is given there is not sent.
    assert parse_node_labels("gaia.tencent.com/gpu-model=any thing") == {"gaia.tencent.com/gpu-model": "any thing"}
