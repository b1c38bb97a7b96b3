"""The scheduler extender against the RBAC deploy/extender.yaml grants (see tests/test_rbac_review.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpumanager import names
from gpumanager.kube.gpu_inventory import ANNOTATION
from simnode.apiserver import ApiServerSimulator
from simnode.extender_process import ExtenderProcess
from tests.extender_fixtures import GIB, gpu_pod, inventory
from tests.test_rbac_review import DEPLOY, JSON, _refusals_logged, granted, manifest_rules, used, wait_until

ACCOUNT = "gpu-manager-extender"


def extender_rules() -> list[JSON]:
    return manifest_rules(DEPLOY / "extender.yaml", ACCOUNT)


def _start(sim: ApiServerSimulator, workdir: Path, rules: list[JSON], *, wait: bool = True) -> ExtenderProcess:
    token = sim.add_service_account("kube-system", ACCOUNT, rules)
    kubeconfig = sim.write_kubeconfig(workdir / "extender.kubeconfig", token=token)
    return ExtenderProcess(workdir, kubeconfig).start(wait=wait)


def test_extender_filters_and_binds_under_the_manifests_rbac(tmp_path: Path) -> None:
    with ApiServerSimulator() as sim:
        capacity = {names.VCORE_RESOURCE: "400", names.VMEMORY_RESOURCE: str(4 * 16 * GIB // names.MEMORY_BLOCK_BYTES)}
        sim.add_node("gpu-1", capacity=capacity, annotations={ANNOTATION: inventory([16] * 4)})
        ext = _start(sim, tmp_path, extender_rules())
        try:
            # the extender's watch lags (a loaded API server's watch cache): bind reads the pod by GET
            sim.hold_watches(True)
            pod = sim.create_pod(gpu_pod("p", [(50, 4)]))
            items = sim.nodes()
            answer: Any = ext.post("filter", {"Pod": pod, "Nodes": {"items": items}, "NodeNames": None})
            assert answer["Error"] == "" and [n["metadata"]["name"] for n in answer["Nodes"]["items"]] == ["gpu-1"]
            assert ext.post("prioritize", {"Pod": pod, "Nodes": {"items": items}, "NodeNames": None})
            md = pod["metadata"]
            args = {"PodName": md["name"], "PodNamespace": "default", "PodUID": md["uid"], "Node": "gpu-1"}
            answer = ext.post("bind", args)
            sim.hold_watches(False)
            assert answer["Error"] == "", answer
            stored = sim.get_pod("default", "p")
            assert stored is not None and stored["spec"]["nodeName"] == "gpu-1"
            assert stored["metadata"]["annotations"][names.PREDICATE_NODE] == "gpu-1"
        finally:
            sim.hold_watches(False)
            ext.stop()
        log = ext.log_text()
        assert not sim.forbidden(), (sim.forbidden(), log[-3000:])
        unused = granted(extender_rules()) - used(sim)
        assert not unused, f"granted but never used: {unused}"


def test_extender_logs_each_refusal_naming_the_account_verb_and_resource(tmp_path: Path) -> None:
    with ApiServerSimulator() as sim:
        ext = _start(sim, tmp_path, [], wait=False)
        try:
            needed = ('cannot list resource "nodes"', 'cannot list resource "pods"')
            wait_until(lambda: all(n in ext.log_text() for n in needed), "the refusals")
        finally:
            ext.stop()
        _refusals_logged(ext.log_text(), needed, f"system:serviceaccount:kube-system:{ACCOUNT}")
