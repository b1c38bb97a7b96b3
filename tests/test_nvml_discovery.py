"""Discovery and topology on the simulated node when one GPU answers NVML with an error."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.gpusim_fixtures import SimNode, gpusim_lib, sim_node

__all__ = ["gpusim_lib", "sim_node"]  # fixtures

MakeNode = Callable[[str | Path], SimNode]

# GPU <bad> answers <code> for its handle (at discovery, or only at the topology's read with "late").
DISCOVER = r"""
import json, logging, sys
import pynvml
from gpumanager.device import nvml

bad, code, when = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
orig = pynvml.nvmlDeviceGetHandleByIndex
phase = {"topology": False}

def handle(i, *a):
    if i == bad and (when == "early" or phase["topology"]):
        raise pynvml.NVMLError(code)
    return orig(i, *a)

pynvml.nvmlDeviceGetHandleByIndex = handle
nvml.init()
gpus, lost = nvml.discover()
phase["topology"] = True
topo = nvml.topology(gpus, lost)
print(json.dumps({"uuids": [g.uuid for g in gpus], "lost": lost, "levels": topo.levels}))
"""


@pytest.mark.parametrize("code", [999, 10, 4])
@pytest.mark.parametrize("when", ["early", "late"])
def test_one_gpu_with_an_nvml_error_is_counted_like_a_lost_one(sim_node: MakeNode, code: int, when: str) -> None:
    node = sim_node("v100-pcie-x4")
    done = node.python(DISCOVER, "1", str(code), when)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert len(out["uuids"]) == 4
    healthy = [g.uuid for g in node.spec.gpus]
    if when == "early":
        assert out["lost"] == [1]
        assert out["uuids"][0] == healthy[0] and out["uuids"][2:] == healthy[2:]
        assert "GPU 1" in done.stderr and "Unhealthy" in done.stderr
    else:
        assert out["lost"] == []
        assert out["levels"][0][1] == 50 and out["levels"][1][2] == 50  # its pairs count as SYSTEM
        assert "GPU 1" in done.stderr


def test_a_failing_gpu_count_still_fails_the_start(sim_node: MakeNode) -> None:
    node = sim_node("t4-x1")
    code = (
        "import pynvml\nfrom gpumanager.device import nvml\nnvml.init()\n"
        "def count():\n    raise pynvml.NVMLError(999)\n"
        "pynvml.nvmlDeviceGetCount = count\n"
        "try:\n    nvml.discover()\nexcept pynvml.NVMLError as e:\n    print('raised', e.value)\n"
    )
    done = node.python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "raised 999"
