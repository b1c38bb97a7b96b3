"""Upgrade: a container answered by the previous version (its Allocate answer, which the kubelet keeps and
never asks again, mounts the pod's directory alone at /etc/vcuda) whose PreStartContainer comes after the
upgrade. That version writes a container's files at PreStart, so none lay in <pod dir>/<container> yet:
taken for one of this version's answers, its vcuda.config went to configs/<pod uid>/<container>, which its
answer does not mount, and the interceptor found no config: the container ran without limits.

Where the answer puts the files is kept with the record ("Layout"): absent in the previous version's
records (and in answers whose mounts lack the container's own directory), "unknown" for a record rebuilt
without its answer (the files then go to both places). The container's view is made from its answer's
mounts, applied as a runtime does (simnode/mounts.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import uuid
from pathlib import Path
from types import ModuleType

import pytest

from gpumanager import names
from gpumanager.allocation import records
from gpumanager.allocation.response import Mount, ResponseSettings, build_response
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.device.types import GPUInfo
from gpumanager.kube.kubelet_checkpoint import KubeletEntry
from gpumanager.recovery import from_kubelet_checkpoint
from gpumanager.vmanager import files
from simnode.gpusim_state import repo_root
from simnode.mounts import materialize
from tests.test_vmanager_register import GIB, Node, node, pod_object

__all__ = ["node"]  # fixture

PREVIOUS = "7eaef095"


def _previous_answer_mounts(vm: Path, uid: str) -> list[Mount]:
    """The previous version's answer: the pod's directory alone at /etc/vcuda."""
    return [Mount(names.VCUDA_MOUNTPOINT, str(vm / uid), True)]


def _this_answer_mounts(vm: Path, a: records.ContainerAllocation) -> list[Mount]:
    gpus = [GPUInfo(0, "GPU-0", "T4", 0, 16 << 30, "0000:00:04.0")]
    return list(build_response(a, gpus, ResponseSettings("/vd/nvidia", "/vd/origin", str(vm))).mounts[1:])


def _seen(node: Node, mounts: list[Mount], name: str, what: str) -> Path:
    view = materialize(mounts, names.VCUDA_MOUNTPOINT, node.vm.parent / f"view-{what}")
    return view / name


def _previous_record(uid: str, name: str) -> records.ContainerAllocation:
    """The previous version's checkpoint entry of an answered, not yet started container."""
    doc = {"PodGPUMapping": {uid: {name: {"Devices": ["/dev/nvidia0"], "Cores": 30, "Memory": GIB, "Index": 0}}}}
    parsed = records.from_json(json.loads(json.dumps(doc)))
    assert not parsed.problems
    (a,) = parsed.allocations
    return a


def test_a_container_answered_before_the_upgrade_reads_its_config_after_it(node: Node) -> None:
    uid, cid = str(uuid.uuid4()), "d" * 64
    node.pods[uid] = pod_object(uid, ["main", "side"], ids={"main": cid})
    node.cgroup(uid, cid)
    a = node.allocs[(uid, "main")] = _previous_record(uid, "main")
    node.v.prepare(a)  # this version's PreStartContainer
    mine = _seen(node, _previous_answer_mounts(node.vm, uid), "main", "prestart")
    config = mine / names.VCUDA_CONFIG_FILE
    assert config.is_file(), f"the container's view {sorted(p.name for p in mine.iterdir())} has no vcuda.config"
    assert files.unpack(config.read_bytes()).gpu_memory == GIB
    # A registration by its name and the refresh write its pids.config where it looks, too.
    node.register(uid, pod_uid=uid, container_name="main")
    node.v.refresh_pids(node.allocs.values())
    again = _seen(node, _previous_answer_mounts(node.vm, uid), "main", "registered")
    assert (again / names.PIDS_CONFIG_FILE).is_file()


def test_a_record_rebuilt_from_the_kubelets_answer_keeps_its_layout(node: Node) -> None:
    uid = str(uuid.uuid4())
    node.pods[uid] = pod_object(uid, ["main"])
    old = pb.ContainerAllocateResponse(
        envs={names.VCUDA_CONFIG_ENV: f"{names.VCUDA_MOUNTPOINT}/main/{names.VCUDA_CONFIG_FILE}"},
        mounts=[
            pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=True)
            for m in _previous_answer_mounts(node.vm, uid)
        ],
        annotations={
            names.VDEVICE_ANNOTATION: "/dev/nvidia0",
            names.VCORE_RESOURCE: "30",
            names.VMEMORY_RESOURCE: str(GIB // names.MEMORY_BLOCK_BYTES),
        },
    )
    new = pb.ContainerAllocateResponse()
    new.CopyFrom(old)
    new.mounts.append(pb.Mount(container_path="/etc/vcuda/main", host_path=str(node.vm / "configs" / uid / "main")))
    got = {}
    for what, resp in (("previous", old), ("this", new)):
        entry = KubeletEntry(
            pod_uid=uid,
            container="main",
            resource=names.VCORE_RESOURCE,
            device_ids=("x",) * 30,
            alloc_resp=resp.SerializeToString(),
        )
        (got[what],) = from_kubelet_checkpoint([entry])
    assert got["previous"].layout == records.LAYOUT_POD and got["this"].layout == records.LAYOUT_OWN
    node.allocs[(uid, "main")] = got["previous"]
    node.v.prepare(got["previous"])
    assert (_seen(node, _previous_answer_mounts(node.vm, uid), "main", "kubelet") / names.VCUDA_CONFIG_FILE).is_file()


def test_a_record_rebuilt_without_its_answer_gives_the_config_to_either_answer(node: Node) -> None:
    uid = str(uuid.uuid4())
    node.pods[uid] = pod_object(uid, ["main"])
    a = node.allocs[(uid, "main")] = records.ContainerAllocation(
        pod_uid=uid, container="main", minors=(0,), cores=30, memory=GIB, layout=records.LAYOUT_UNKNOWN
    )
    node.v.prepare(a)
    for what, mounts in (
        ("previous", _previous_answer_mounts(node.vm, uid)),
        ("this", _this_answer_mounts(node.vm, a)),
    ):
        assert (_seen(node, mounts, "main", what) / names.VCUDA_CONFIG_FILE).is_file(), what


def test_this_versions_answer_alone_in_its_own_directory(node: Node) -> None:
    uid = str(uuid.uuid4())
    node.pods[uid] = pod_object(uid, ["main"])
    a = node.allocs[(uid, "main")] = records.ContainerAllocation(
        pod_uid=uid, container="main", minors=(0,), cores=30, memory=GIB
    )
    node.v.prepare(a)
    assert list((node.vm / uid / "main").iterdir()) == []
    assert (_seen(node, _this_answer_mounts(node.vm, a), "main", "own") / names.VCUDA_CONFIG_FILE).is_file()


def _previous_records_module(tmp_path: Path) -> ModuleType:
    """The previous version's records.py (its reader of the checkpoint and journal entries)."""
    text = subprocess.run(
        ["git", "-C", str(repo_root()), "show", f"{PREVIOUS}:gpumanager/allocation/records.py"],
        capture_output=True,
        text=True,
        check=False,
    )
    if text.returncode != 0:
        pytest.skip(f"{PREVIOUS} is not in this checkout: {text.stderr.strip()}")
    path = tmp_path / "previous_records.py"
    path.write_text(text.stdout)
    spec = importlib.util.spec_from_file_location("previous_records", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["previous_records"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("layout", [records.LAYOUT_OWN, records.LAYOUT_POD, records.LAYOUT_UNKNOWN])
def test_the_layout_is_kept_and_the_previous_version_still_reads_the_record(tmp_path: Path, layout: str) -> None:
    a = records.ContainerAllocation(
        pod_uid=str(uuid.uuid4()), container="main", minors=(0,), cores=30, memory=GIB, layout=layout
    )
    entry = a.to_json()
    assert a.to_json_text() == json.dumps(entry, sort_keys=True, separators=(",", ":"))
    (back,) = records.from_json(records.to_json([a])).allocations
    assert back == a
    previous = _previous_records_module(tmp_path)
    parsed = previous.from_json(records.to_json([a]))
    assert not parsed.problems and parsed.allocations[0].memory == GIB


def test_a_bad_layout_is_refused_by_name() -> None:
    uid = str(uuid.uuid4())
    parsed = records.from_json(
        {"PodGPUMapping": {uid: {"main": {"Devices": ["/dev/nvidia0"], "Cores": 30, "Memory": 1, "Layout": 7}}}}
    )
    assert parsed.untrusted == [(uid, "main")]
    assert parsed.problems == [f"pod {uid} container main: Layout 7 is not 'own' or 'unknown'"]
