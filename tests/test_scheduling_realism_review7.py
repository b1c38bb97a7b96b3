"""Init containers on the multi-node simulated cluster, as the real kubelet handles them: its device
manager allocates them at admission (in order, before the app containers, an init container's devices
reusable by a later container) and calls PreStartContainer before each starts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gpumanager import names
from simnode.gpusim_state import load_spec, spec_dir
from simnode.multinode import MultiNodeCluster, pending_pod

PREFIX = names.PREDICATE_GPU_IDX_PREFIX
SPEC = "v100-pcie-x4"


def _with_init(name: str, init: tuple[int, int], app: tuple[int, int]) -> dict[str, Any]:
    pod = pending_pod(name, [app], node_selector={"kubernetes.io/hostname": "v"})
    cores, blocks = init
    limits = {names.VCORE_RESOURCE: str(cores), names.VMEMORY_RESOURCE: str(blocks)}
    pod["spec"]["initContainers"] = [
        {"name": "setup", "image": "cuda", "resources": {"limits": limits, "requests": limits}}
    ]
    return pod


def _visible(cluster: MultiNodeCluster, uid: str, container: str) -> str:
    records = cluster.nodes["v"].kubelet.allocations(uid)
    core = [r for r in records if r.resource == names.VCORE_RESOURCE and r.container_name == container]
    assert core, f"no vcuda-core Allocate for container {container}: {[r.container_name for r in records]}"
    return str(core[0].response.envs["NVIDIA_VISIBLE_DEVICES"])


def _assigned_annotations(cluster: MultiNodeCluster, name: str, timeout: float = 30.0) -> dict[str, str]:
    """The pod's annotations once the agent has written ``gpu-assigned=true`` and the GPU indices its
    containers were given (a patch queued after PreStartContainer; the start does not wait for it)."""
    deadline = time.monotonic() + timeout
    while True:
        ann: dict[str, str] = cluster.pod(name)["metadata"].get("annotations") or {}
        if ann.get(names.GPU_ASSIGNED) == "true" or time.monotonic() > deadline:
            return ann
        time.sleep(0.1)


def test_a_gpu_init_container_placed_by_the_extender_is_allocated_and_started_on_its_gpu(
    tmp_path: Path, sim_built: Path
) -> None:
    """The extender names the init container's GPU (``predicate-gpu-idx--1``) and the app container's
    (``predicate-gpu-idx-0``); the node allocates the init container first, then the app container, the
    agent gives each the GPU its annotation names, PreStartContainer runs for both, init first, and the
    pod runs with its init container completed."""
    gpus = [g.uuid for g in load_spec(spec_dir() / f"{SPEC}.json").gpus]
    cluster = MultiNodeCluster(tmp_path / "c", [("v", SPEC)], node_status_period=0.3, scheduler_backoff=(0.2, 1.0))
    with cluster:
        cluster.create(_with_init("p", init=(100, 0), app=(30, 4)))
        running = cluster.wait_phase("p", timeout=60)
        uid = str(running["metadata"]["uid"])
        ann = running["metadata"]["annotations"]
        kubelet = cluster.nodes["v"].kubelet
        records = kubelet.allocations(uid)
        order = [r.container_name for r in sorted(records, key=lambda r: r.timings.started_at)]
        assert order[0] == "setup" and "c0" in order, order
        assert _visible(cluster, uid, "setup") == gpus[int(ann[f"{PREFIX}-1"])]
        assert _visible(cluster, uid, "c0") == gpus[int(ann[f"{PREFIX}0"])]
        started = [c for _, u, c, _ in kubelet.pre_start_calls if u == uid]
        assert "setup" in started and "c0" in started
        assert started.index("setup") < started.index("c0")
        inits = running["status"].get("initContainerStatuses") or []
        assert [s["name"] for s in inits] == ["setup"]
        assert inits[0]["state"]["terminated"]["reason"] == "Completed"
        assert cluster.refusals() == []


def test_an_app_container_reusing_its_init_containers_devices_runs_on_the_gpu_its_annotation_names(
    tmp_path: Path, sim_built: Path
) -> None:
    """The init container and the app container ask for as much: the kubelet hands the init container's
    device IDs on to the app container (devicesToReuse). Each container runs on the GPU its pod's
    annotations name once the agent has written them (the extender's choice, unless the kubelet admitted
    the identical pods in the other order), and a second such pod fits beside the first without refusal."""
    gpus = [g.uuid for g in load_spec(spec_dir() / f"{SPEC}.json").gpus]
    cluster = MultiNodeCluster(tmp_path / "c", [("v", SPEC)], node_status_period=0.3, scheduler_backoff=(0.2, 1.0))
    with cluster:
        for name in ("p", "q"):
            cluster.create(_with_init(name, init=(60, 8), app=(60, 8)))
        for name in ("p", "q"):
            running = cluster.wait_phase(name, timeout=60)
            uid = str(running["metadata"]["uid"])
            records = cluster.nodes["v"].kubelet.allocations(uid)
            ids = {(r.container_name, r.resource): set(r.device_ids) for r in records}
            assert ids[("setup", names.VCORE_RESOURCE)] == ids[("c0", names.VCORE_RESOURCE)]  # reused
            # The two pods are identical and an Allocate names no pod: when the kubelet admits q before p,
            # q is given the IDs (and GPU) the agent chose for p, and the records are swapped at
            # PreStartContainer. So the extender's annotations need not name where a container runs; the
            # agent rewrites them after the start (gpu-assigned=true, not awaited by the start), and from
            # then on they must name the GPU each container, the init container included, really runs on.
            ann = _assigned_annotations(cluster, name)
            assert _visible(cluster, uid, "setup") == gpus[int(ann[f"{PREFIX}-1"])]
            assert _visible(cluster, uid, "c0") == gpus[int(ann[f"{PREFIX}0"])]
        assert cluster.refusals() == []
        assert cluster.over_committed() == {}


def test_a_gpu_sidecar_runs_beside_the_app_container_on_the_gpu_its_annotation_names(
    tmp_path: Path, sim_built: Path
) -> None:
    """An init container with ``restartPolicy: Always`` (a sidecar) keeps running beside the app container:
    its devices are its own (not handed on), it gets a process of its own, and its status says running."""
    gpus = [g.uuid for g in load_spec(spec_dir() / f"{SPEC}.json").gpus]
    cluster = MultiNodeCluster(tmp_path / "c", [("v", SPEC)], node_status_period=0.3, scheduler_backoff=(0.2, 1.0))
    with cluster:
        pod = _with_init("p", init=(40, 4), app=(40, 4))
        pod["spec"]["initContainers"][0]["restartPolicy"] = "Always"
        cluster.create(pod)
        running = cluster.wait_phase("p", timeout=60)
        uid = str(running["metadata"]["uid"])
        ann = running["metadata"]["annotations"]
        records = cluster.nodes["v"].kubelet.allocations(uid)
        ids = {(r.container_name, r.resource): set(r.device_ids) for r in records}
        assert not ids[("setup", names.VCORE_RESOURCE)] & ids[("c0", names.VCORE_RESOURCE)]
        assert _visible(cluster, uid, "setup") == gpus[int(ann[f"{PREFIX}-1"])]
        assert _visible(cluster, uid, "c0") == gpus[int(ann[f"{PREFIX}0"])]
        inits = running["status"]["initContainerStatuses"]
        assert [s["name"] for s in inits] == ["setup"] and "running" in inits[0]["state"]
        assert len(list((cluster.nodes["v"].cgroup_root / "kubepods" / f"pod{uid}").iterdir())) == 2
        assert cluster.refusals() == []
