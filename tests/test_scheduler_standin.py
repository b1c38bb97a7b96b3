"""The kube-scheduler stand-in reads a KubeSchedulerConfiguration as kube-scheduler does."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumanager import names
from simnode.multinode import pending_pod
from simnode.scheduler import ExtenderConfig, go_duration, load_configuration

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "scheduler"


@pytest.mark.parametrize(
    ("text", "seconds"), [("10s", 10.0), ("500ms", 0.5), ("1m30s", 90.0), ("2h", 7200.0), (3, 3.0)]
)
def test_go_durations(text: str | int, seconds: float) -> None:
    assert go_duration(text) == seconds


@pytest.mark.parametrize("text", ["10", "s", "1x", "5 s"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        go_duration(text)


def test_shipped_configurations_load() -> None:
    name, (ext,) = load_configuration(DEPLOY / "default-scheduler.yaml", url_prefix="http://127.0.0.1:1/scheduler")
    assert name == "default-scheduler"
    assert ext == ExtenderConfig(
        url_prefix="http://127.0.0.1:1/scheduler",
        filter_verb="filter",
        prioritize_verb="prioritize",
        bind_verb="bind",
        weight=5,
        node_cache_capable=False,
        http_timeout=10.0,
        ignorable=False,
        managed_resources=(names.VCORE_RESOURCE, names.VMEMORY_RESOURCE),
    )
    assert load_configuration(DEPLOY / "gpu-scheduler.yaml")[0] == "gpu-scheduler"


def test_extender_is_interested_only_in_pods_asking_for_its_resources() -> None:
    _, (ext,) = load_configuration(DEPLOY / "default-scheduler.yaml")
    assert ext.interested(pending_pod("gpu", [(50, 4)]))
    assert ext.interested(pending_pod("whole", [(100, 0)]))
    assert not ext.interested(pending_pod("web", [(0, 0)]))
    assert ExtenderConfig(url_prefix="http://x").interested(pending_pod("web", [(0, 0)]))
