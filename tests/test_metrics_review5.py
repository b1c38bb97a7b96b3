"""Metrics: upstream's legacy families and the per-container families for containers the agent knows
only from its checkpoint, DRA containers before the pod list, and the page's labels."""

from __future__ import annotations

from dataclasses import replace

from gpumanager import names
from gpumanager.metrics import legacy, usage
from gpumanager.metrics.usage import ContainerUsage, DeviceUsage
from tests.test_metrics import GPUS, alloc, pod


def _unmeasured(index: int) -> DeviceUsage:
    return DeviceUsage(GPUS[index], 0, 0.0, 0.0, (), measured=False)


def test_a_container_kept_from_the_checkpoint_has_its_legacy_request_series() -> None:
    share = replace(alloc("uid-a", "main", (3,), 50, 8 * names.MEMORY_BLOCK_BYTES), namespace="ml", pod_name="train")
    listed = pod("train", "ml", "uid-a", ["main"])
    # The same container, once with its pod listed, once while the agent has only its checkpoint.
    known = legacy.render([ContainerUsage(listed, share, [_unmeasured(3)])], node="sim-node")
    kept = legacy.render([ContainerUsage(usage._standin(share), share, [_unmeasured(3)])], node="sim-node")
    assert 'container_request_gpu_utilization{container_name="main",namespace="ml",node="sim-node"' in known
    assert kept == known
