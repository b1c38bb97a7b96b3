"""What an operator new to the project meets: relative DRA paths, which the kubelet and the container
runtime could not find, are refused at start; a value that a ``GPU_MANAGER_*`` variable set (as
deploy/dra/daemonset.yaml sets its paths) and that the agent refuses is named by that variable, not only
by a flag the manifest does not hold; ``gpu-manager-extender --help`` shows every default."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gpumanager import cli
from gpumanager.config import ConfigError
from gpumanager.extender import cli as extender_cli


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


def _agent(tmp_path: Path, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The agent's command, with every directory it would write in under ``tmp_path``."""
    own = [
        f"--checkpoint-path={tmp_path / 'checkpoint'}",
        f"--device-plugin-path={tmp_path / 'dp'}",
        # Short: each pod's vcuda.sock below it must fit a unix socket address (xdist's tmp_path does not).
        f"--virtual-manager-path={tempfile.mkdtemp(prefix='vm', dir='/tmp')}",
        f"--display-socket={tmp_path / 'gm.sock'}",
        "--hostname-override=sim-node",
    ]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPU_MANAGER_")}
    return subprocess.run(
        [sys.executable, "-m", "gpumanager.cli", *own, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env={**clean, **env, "PYTHONPATH": str(Path(cli.__file__).parents[1])},
        check=False,
    )


def test_a_value_refused_at_validation_names_the_variable_that_set_it(tmp_path: Path) -> None:
    done = _agent(tmp_path, [], {"GPU_MANAGER_QUERY_PORT": "70000"})
    assert done.returncode == cli.EXIT_CONFIG, done.stderr[-2000:]
    line = next(line for line in done.stderr.splitlines() if "70000" in line)
    assert "GPU_MANAGER_QUERY_PORT" in line, line
    assert "Traceback" not in done.stderr


def test_a_value_refused_at_start_names_the_variable_that_set_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-libnvidia-ml.so.1"
    done = _agent(tmp_path, [], {"GPU_MANAGER_NVML_LIB": str(missing)})
    assert done.returncode == cli.EXIT_CONFIG, done.stderr[-2000:]
    line = next(line for line in done.stderr.splitlines() if str(missing) in line)
    assert "GPU_MANAGER_NVML_LIB" in line, line


def test_a_relative_path_from_a_variable_names_the_variable(tmp_path: Path) -> None:
    done = _agent(tmp_path, [], {"GPU_MANAGER_CDI_ROOT": "var/run/cdi", "GPU_MANAGER_MODE": "dra"})
    assert done.returncode == cli.EXIT_CONFIG, done.stderr[-2000:]
    line = next(line for line in done.stderr.splitlines() if "var/run/cdi" in line)
    assert "GPU_MANAGER_CDI_ROOT" in line, line


def test_a_value_given_as_a_flag_is_named_as_the_flag_alone(tmp_path: Path) -> None:
    # The flag wins over the variable: the refused value is the flag's, and the variable is not blamed.
    done = _agent(tmp_path, ["--query-port=70000"], {"GPU_MANAGER_QUERY_PORT": "5678"})
    assert done.returncode == cli.EXIT_CONFIG, done.stderr[-2000:]
    line = next(line for line in done.stderr.splitlines() if "70000" in line)
    assert "--query-port=70000" in line and "GPU_MANAGER_QUERY_PORT" not in line, line


def test_the_variable_is_named_for_every_spelling_of_the_flag_on_the_command_line() -> None:
    # -query_port on the command line is --query-port: the variable did not set it.
    message = "--query-port=70000: must be between 0 and 65535"
    environ = {"GPU_MANAGER_QUERY_PORT": "70000"}
    assert cli.name_variables(message, ["-query_port=70000"], environ) == message
    assert cli.name_variables(message, ["--query_port", "70000"], environ) == message
    named = cli.name_variables(message, [], environ)
    assert named.startswith(message) and "GPU_MANAGER_QUERY_PORT='70000'" in named, named


@pytest.mark.parametrize(("flag", "default"), [("--policy", "binpack"), ("--v", "0"), ("--listen", ":3456")])
def test_extender_help_shows_each_default(flag: str, default: str) -> None:
    text = " ".join(extender_cli.build_parser().format_help().split())
    start = text.index(f" {flag} ", text.index("options:"))
    entry = text[start : start + 400]
    following = entry.find(" --", 2)
    entry = entry if following < 0 else entry[:following]
    assert f"default {default}" in entry, entry


def _chart_notes(values: dict[str, object]) -> str:
    import runpy

    render = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "render_manifests.py"))["render"]
    return str(render(values)["NOTES.txt"])


def test_chart_notes_name_the_labels_its_node_selector_asks_for() -> None:
    # Helm merges the map: null takes the default label out.
    notes = _chart_notes({"nodeSelector": {"nvidia-device-enable": None, "gpu-pool": "a100"}})
    assert "kubectl label node <node> gpu-pool=a100" in notes, notes
    assert "nvidia-device-enable" not in notes, notes


def test_chart_notes_keep_the_upstream_label_by_default() -> None:
    assert "kubectl label node <node> nvidia-device-enable=enable" in _chart_notes({})


def test_extender_metrics_carry_no_created_series() -> None:
    # As the agent's page: a counter's start is the process's; a _created gauge per label set is clutter
    # that no dashboard reads. A fresh process, since the switch is process-wide.
    code = (
        "from prometheus_client.exposition import generate_latest\n"
        "from gpumanager.extender.metrics import ExtenderMetrics\n"
        "m = ExtenderMetrics(lambda: {})\n"
        "m.requests.labels('filter', '200').inc()\n"
        "m.latency.labels('filter').observe(0.01)\n"
        "m.decisions.labels('filter', 'pass').inc()\n"
        "print(generate_latest(m.registry).decode())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "gpu_extender_requests_total" in done.stdout
    assert "_created" not in done.stdout, done.stdout
