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
