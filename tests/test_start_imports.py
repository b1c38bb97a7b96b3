"""What the agent loads before it registers with the kubelet: only what registration needs.

Every module loaded before the first Register is time the kubelet waits for; the Kubernetes client
alone takes about half a second. These checks run the import in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys

# Loaded later, in the background, once the device plugin is registered.
NOT_BEFORE_REGISTRATION = (
    "kubernetes",
    "prometheus_client",
    "yaml",
    "pydantic",
    "gpumanager.allocation.allocator",
    "gpumanager.topology",
    "gpumanager.vmanager.manager",
    "gpumanager.volume.keeper",
    "gpumanager.recovery",
)


def loaded_by(statement: str) -> set[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(done.stdout))


def test_the_agent_module_loads_neither_the_kubernetes_client_nor_the_allocation_state() -> None:
    loaded = loaded_by("import gpumanager.app")
    assert not [m for m in NOT_BEFORE_REGISTRATION if m in loaded]


# Loaded by the libraries the start path uses (grpc, protobuf) or by the standard library, unless
# the agent defers them (gpumanager.cli.DEFERRED_AT_START) or imports them only where used.
NOT_LOADED_AT_START = (
    "ssl",  # by asyncio, through grpc.aio
    "asyncio.base_events",
    "google.protobuf.text_format",  # by protobuf's pure-Python messages
    "pickle",
    "logging.handlers",  # only with --log-dir
    "importlib.resources",
)


def test_what_the_agent_defers_at_start_stays_unloaded_through_its_start_path_imports() -> None:
    loaded = loaded_by(
        "from gpumanager import cli, lazy_package\n"
        "lazy_package.defer(*cli.DEFERRED_AT_START)\n"
        "cli.setup_logging(cli.build_parser({}).parse_args([]))\n"
        "import gpumanager.app\n"
        "from gpumanager.deviceplugin import registration, server\n"
        "import grpc._server, grpc._channel\n"
        "assert all(lazy_package.is_deferred(name) for name in cli.DEFERRED_AT_START)"
    )
    assert [m for m in NOT_LOADED_AT_START if m in loaded] == []
