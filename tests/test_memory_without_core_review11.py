"""A container asking for vcuda-memory without vcuda-core never starts, whatever else the node is doing:

- behind a lagging pod watch, beside a share of the same memory size that is allocated but not started
  (its own pod's, or another's admitted just before);
- when the kubelet tries its start again while our watch still lags;
- as an init container whose IDs the kubelet hands on to an app container asking for as much (the kubelet's
  records then name the app container as their holder).

Legitimate containers beside them (the share, the app container of a pod whose init container asks for
cores too) still start."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from simnode.cluster import PodRun, SimCluster, gpu_pod
from simnode.kubelet import KubeletSimError
from tests.battery_fixtures import gpu, write_spec

CORE, MEMORY = names.VCORE_RESOURCE, names.VMEMORY_RESOURCE


def _cluster(tmp_path: Path) -> SimCluster:
    return SimCluster(
        tmp_path / "node",
        write_spec(tmp_path / "two.json", [gpu(0, memory_mib=16384), gpu(1, memory_mib=16384)], lambda i, j: "PHB"),
        status_lag=0,
    )


def _start(cluster: SimCluster, run: PodRun, container: str, resource: str = MEMORY) -> str:
    """The PreStartContainer answer: "" when the start is let through, else the refusal."""
    try:
        cluster.kubelet.pre_start(resource, pod_uid=run.uid, container_name=container)
    except KubeletSimError as exc:
        return str(exc) or "refused"
    return ""


def _container(name: str, cores: int, blocks: int) -> dict[str, Any]:
    limits = {MEMORY: str(blocks)}
    if cores:
        limits[CORE] = str(cores)
    return {"name": name, "image": "cuda", "resources": {"limits": dict(limits), "requests": dict(limits)}}


def test_memory_only_beside_an_unstarted_share_of_another_pod_behind_a_lagging_watch(tmp_path: Path) -> None:
    with _cluster(tmp_path) as cluster:
        cluster.api.hold_watches(True)  # the agent's pod cache sees neither pod
        try:
            share = cluster.admit(gpu_pod("share", [("main", 50, 4)]))
            memory_only = cluster.admit(gpu_pod("memory-only", [("main", 0, 4)]))
            refused = _start(cluster, memory_only, "main")
            assert "default/memory-only" in refused and "main" in refused, refused
            assert f"4 {MEMORY}" in refused and CORE in refused, refused
            assert _start(cluster, share, "main", CORE) == ""
            assert _start(cluster, share, "main") == ""
        finally:
            cluster.api.hold_watches(False)


def test_memory_only_beside_a_share_of_its_own_pod_behind_a_lagging_watch(tmp_path: Path) -> None:
    manifest = gpu_pod("mixed", [])
    manifest["spec"]["containers"] = [_container("gpu", 50, 4), _container("mem", 0, 4)]
    with _cluster(tmp_path) as cluster:
        cluster.api.hold_watches(True)
        try:
            run = cluster.admit(manifest)
            assert _start(cluster, run, "gpu", CORE) == ""
            assert _start(cluster, run, "gpu") == ""
            refused = _start(cluster, run, "mem")
            assert "default/mixed" in refused and "container mem" in refused, refused
        finally:
            cluster.api.hold_watches(False)


def test_every_try_of_a_refused_start_is_refused_while_the_watch_lags(tmp_path: Path) -> None:
    with _cluster(tmp_path) as cluster:
        cluster.api.hold_watches(True)
        try:
            memory_only = cluster.admit(gpu_pod("memory-only", [("main", 0, 4)]))
            for attempt in range(3):
                refused = _start(cluster, memory_only, "main")
                assert "default/memory-only" in refused, (attempt, refused)
            # A share behind the same watch, started twice (a container restart), starts both times; once let
            # through, its memory's start asks the kubelet nothing more.
            share = cluster.admit(gpu_pod("share", [("main", 50, 4)]))
            asked = []
            for _ in range(2):
                assert _start(cluster, share, "main", CORE) == ""
                before = len(cluster.kubelet.pod_resources_calls)
                assert _start(cluster, share, "main") == ""
                asked.append(len(cluster.kubelet.pod_resources_calls) - before)
            assert asked[1] == 0, asked
        finally:
            cluster.api.hold_watches(False)


@pytest.mark.parametrize("lagging", [False, True], ids=["cached", "lagging-watch"])
def test_a_memory_only_init_container_handing_its_ids_to_a_share_is_refused(tmp_path: Path, lagging: bool) -> None:
    manifest = gpu_pod("init-memory", [])
    manifest["spec"]["initContainers"] = [_container("init", 0, 4)]
    manifest["spec"]["containers"] = [_container("app", 50, 4)]
    legit = gpu_pod("init-share", [])
    legit["spec"]["initContainers"] = [_container("init", 50, 4)]
    legit["spec"]["containers"] = [_container("app", 50, 4)]
    with _cluster(tmp_path) as cluster:
        if lagging:
            cluster.api.hold_watches(True)
        try:
            created = cluster.create(manifest)
            if not lagging:
                time.sleep(1.0)  # the agent's pod cache shows it, as it would before the kubelet admits it
            run = cluster.admit(created, create=False)
            refused = _start(cluster, run, "init")
            assert "default/init-memory" in refused and "container init" in refused, refused
            cluster.delete(run, wait=True)
            ok = cluster.admit(legit)
            for container in ("init", "app"):
                assert _start(cluster, ok, container, CORE) == "", container
                assert _start(cluster, ok, container) == "", container
        finally:
            cluster.api.hold_watches(False)


def test_a_share_given_the_ids_of_a_refused_memory_only_container_starts(tmp_path: Path) -> None:
    """The memory-only container's start is refused (its IDs stay noted for the kubelet's next try), its pod is
    deleted, and the kubelet gives the same IDs to a share, behind the same lagging watch: the share starts,
    judged on the kubelet's records since its own Allocate."""
    spec = write_spec(tmp_path / "two.json", [gpu(0, memory_mib=16384), gpu(1, memory_mib=16384)], lambda i, j: "PHB")
    with SimCluster(tmp_path / "node", spec, status_lag=0, fill="sorted") as cluster:
        cluster.api.hold_watches(True)
        try:
            memory_only = cluster.admit(gpu_pod("memory-only", [("main", 0, 4)]))
            assert "default/memory-only" in _start(cluster, memory_only, "main")
            given = memory_only.memory["main"].device_ids
            cluster.api.hold_watches(False)
            cluster.delete(memory_only, wait=True)
            cluster.api.hold_watches(True)
            share = cluster.admit(gpu_pod("share", [("main", 50, 4)]))
            assert share.memory["main"].device_ids == given, "the kubelet gives the freed IDs on"
            assert _start(cluster, share, "main", CORE) == ""
            assert _start(cluster, share, "main") == ""
        finally:
            cluster.api.hold_watches(False)


@pytest.mark.parametrize("lagging", [False, True], ids=["cached", "lagging-watch"])
def test_an_init_container_with_cores_before_a_memory_only_app_container_is_refused_naming_both(
    tmp_path: Path, lagging: bool
) -> None:
    """The pod cannot run as written (its app container asks for memory alone and would get no GPU). The kubelet
    hands the init container's IDs on to that app container, so its records name the app container at the init
    container's start: the refusal says which start it refuses and which container is at fault."""
    manifest = gpu_pod("init-then-memory", [])
    manifest["spec"]["initContainers"] = [_container("init", 50, 4)]
    manifest["spec"]["containers"] = [_container("app", 0, 4)]
    with _cluster(tmp_path) as cluster:
        if lagging:
            cluster.api.hold_watches(True)
        try:
            created = cluster.create(manifest)
            if not lagging:
                time.sleep(1.0)
            run = cluster.admit(created, create=False)
            assert _start(cluster, run, "init", CORE) == ""
            refused = _start(cluster, run, "init")
            assert "default/init-then-memory container app asks for 4" in refused, refused
            assert "init container init" in refused, refused
        finally:
            cluster.api.hold_watches(False)
