"""``--nvml-lib`` as the shipped DaemonSet and image give it: a library of the driver mirror, which on a
node the agent has never run on does not exist until the agent has built it (after NVML has started)."""

from __future__ import annotations

import json
from pathlib import Path

from gpumanager import names
from simnode.cluster import SimCluster


def _origin_library(node: Path) -> Path:
    """The path the shipped manifests give --nvml-lib, in the simulated node's mirror."""
    return node / "vdriver" / "origin" / "lib64" / "libnvidia-ml.so.1"


def test_a_new_node_starts_with_nvml_lib_in_the_mirror_not_built_yet(tmp_path: Path, sim_built: Path) -> None:
    node = tmp_path / "node"
    nvml_lib = _origin_library(node)
    with SimCluster(node, "t4-x1", agent_flags=[f"--nvml-lib={nvml_lib}"]) as c:
        assert c.agent is not None
        assert c.agent.proc is not None and c.agent.proc.poll() is None
        assert c.kubelet.healthy_ids(names.VCORE_RESOURCE)
        log = c.agent.log_text()
        assert f"--nvml-lib={nvml_lib}" in log, log  # the operator is told what was loaded instead
        assert nvml_lib.exists()  # the mirror built it: the next start loads it


def test_a_missing_nvml_lib_outside_the_mirror_is_still_refused(tmp_path: Path, sim_built: Path) -> None:
    node = tmp_path / "node"
    missing = tmp_path / "elsewhere" / "libnvidia-ml.so.1"
    c = SimCluster(node, "t4-x1", agent_flags=[f"--nvml-lib={missing}"])
    try:
        c.start(wait=False)
        assert c.agent is not None
        assert c.agent.wait(30) == 2
        assert f"--nvml-lib={missing}" in c.agent.log_text()
    finally:
        c.stop()
    assert json.loads((node / "volume.conf").read_text())  # the mirror was configured all along
