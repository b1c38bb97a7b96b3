"""The shipped RBAC against what the agent (device-plugin and DRA mode) and the extender really ask.

The API-server simulator enforces the rules the shipped manifests bind to each service account
(:mod:`simnode.apiserver_rbac`): a request they do not grant is answered 403, as a real cluster
answers it. Each component then lives a pod's whole life against it: nothing may be refused, and
every permission granted must have been used (least privilege).
"""

from __future__ import annotations

import json
import runpy
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.config
import pytest
import yaml

from gpumanager.kube.gpu_inventory import ANNOTATION
from simnode.apiserver import ApiServerSimulator
from simnode.apiserver_objects import pod_manifest
from simnode.apiserver_rbac import Attributes, rules_of

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
RENDER = runpy.run_path(str(ROOT / "scripts" / "render_manifests.py"))

JSON = dict[str, Any]


def chart_rules(values: Mapping[str, Any] | None = None) -> list[JSON]:
    """What the chart (rendered as deploy/daemonset.yaml is) grants the agent's service account."""
    return rules_of(RENDER["documents"](dict(values or {})), "kube-system", "gpu-manager")


def manifest_rules(path: Path, name: str) -> list[JSON]:
    """What a plain manifest grants the service account kube-system/<name>."""
    return rules_of(yaml.safe_load_all(path.read_text()), "kube-system", name)


def granted(rules: Sequence[Mapping[str, Any]]) -> set[tuple[str, str, str]]:
    """(verb, group, resource) of every permission the rules give (no wildcard is shipped)."""
    out = set()
    for rule in rules:
        assert not rule.get("resourceNames"), rule
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, res, verb), rule
                    out.add((verb, group, res))
    return out


def used(sim: ApiServerSimulator) -> set[tuple[str, str, str]]:
    return {(a.verb, a.group, a.combined) for _user, a in sim.authorized()}


def wait_until(check: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# -- the simulator's RBAC -----------------------------------------------------------------------------


def _core(sim: ApiServerSimulator, token: str) -> Any:
    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config_from_dict(config_dict=sim.kubeconfig(token=token), client_configuration=cfg)  # type: ignore[no-untyped-call]
    return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(cfg))


def _refusal(call: Callable[[], object]) -> JSON:
    with pytest.raises(kubernetes.client.exceptions.ApiException) as info:
        call()
    assert info.value.status == 403
    body: JSON = json.loads(info.value.body or "")
    return body


def test_simulator_refuses_what_the_rules_do_not_grant_with_the_real_status() -> None:
    with ApiServerSimulator() as sim:
        sim.add_node("n1")
        sim.create_pod(pod_manifest("p", node="n1"))
        token = sim.add_service_account(
            "kube-system",
            "sa",
            [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
                {"apiGroups": [""], "resources": ["*/status"], "verbs": ["get"]},
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"], "resourceNames": ["n1"]},
            ],
        )
        core = _core(sim, token)
        assert core.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1").items[0].metadata.name == "p"
        assert core.read_namespaced_pod_status("p", "default").metadata.name == "p"  # */status
        assert core.read_node("n1").metadata.name == "n1"  # resourceNames
        user = "system:serviceaccount:kube-system:sa"
        body = _refusal(lambda: core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"a": "b"}}}))
        assert body == {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": f'pods "p" is forbidden: User "{user}" cannot patch resource "pods" in API group "" '
            'in the namespace "default"',
            "reason": "Forbidden",
            "details": {"name": "p", "kind": "pods"},
            "code": 403,
        }
        body = _refusal(lambda: core.read_node("n2"))
        why = f'User "{user}" cannot get resource "nodes" in API group "" at the cluster scope'
        assert body["message"] == f'nodes "n2" is forbidden: {why}'
        binding = {"metadata": {"name": "p"}, "target": {"kind": "Node", "name": "n1"}}
        body = _refusal(lambda: core.create_namespaced_pod_binding("p", "default", binding))
        assert 'cannot create resource "pods/binding" in API group ""' in body["message"]
        assert body["details"] == {"name": "p", "kind": "pods"}
        resource = kubernetes.client.ResourceV1Api(core.api_client)
        body = _refusal(lambda: resource.list_resource_slice())
        assert body["message"] == (
            f'resourceslices.resource.k8s.io is forbidden: User "{user}" cannot list resource "resourceslices" '
            'in API group "resource.k8s.io" at the cluster scope'
        )
        assert body["details"] == {"group": "resource.k8s.io", "kind": "resourceslices"}
        # the simulator's own user (no token) may still do anything
        kubernetes.client.CoreV1Api(sim.client()).patch_namespaced_pod(
            "p", "default", {"metadata": {"labels": {"a": "b"}}}
        )
        assert [a.verb for _u, a in sim.forbidden()] == ["patch", "get", "create", "list"]
        assert Attributes("list", "", "pods") in [a for _u, a in sim.authorized()]


# -- device-plugin mode under the chart's ClusterRole ------------------------------------------------


def _failed_start(pod: JSON) -> JSON:
    pod["metadata"]["ownerReferences"] = [
        {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "uid": "rs-uid", "controller": True}
    ]
    return pod


def test_device_plugin_agent_lives_a_pods_life_under_the_charts_rbac(tmp_path: Path, sim_built: Path) -> None:
    from simnode.cluster import NODE, SimCluster, gpu_pod

    flags = ["--node-labels=gaia.tencent.com/gpu-model=auto,team=ml", "--allocation-check-period=1"]
    with SimCluster(tmp_path, "v100-pcie-x4", agent_flags=flags, agent_rules=chart_rules()) as c:
        api = c.api

        def node_meta() -> JSON:
            return dict((api.get_node(NODE) or {}).get("metadata") or {})

        wait_until(lambda: node_meta().get("labels", {}).get("team") == "ml", "the node labels")
        wait_until(lambda: ANNOTATION in node_meta().get("annotations", {}), "the inventory annotation")
        run = c.run_pod(gpu_pod("share", [("c", 50, 4)]))
        c.wait_annotations(run, {"tencent.com/gpu-assigned": "true"})
        # a pod whose start failed on its GPUs, owned by a controller: the agent deletes it
        failed = c.admit(_failed_start(gpu_pod("owned", [("c", 100, 0)])))
        waiting = {"reason": "CreateContainerConfigError", "message": "PreStartContainer check failed"}
        status = {
            "name": "c",
            "ready": False,
            "restartCount": 0,
            "image": "cuda",
            "imageID": "",
            "state": {"waiting": waiting},
        }
        api.set_pod_phase(failed.namespace, failed.name, "Pending", containerStatuses=[status])
        wait_until(
            lambda: (api.get_pod("default", "owned") or {}).get("metadata", {}).get("deletionTimestamp"), "the delete"
        )
        c.delete(run, wait=True)
        assert c.agent is not None
        log = c.agent.log_text()
        assert not api.forbidden(), (api.forbidden(), log[-3000:])
        assert "is forbidden: User" not in log, log[-3000:]  # no refusal reported (a bare "403" may be a timestamp)
        unused = granted(chart_rules()) - used(api)
        assert not unused, f"granted but never used: {unused}"


# -- a refusal is logged as what it is ------------------------------------------------------------------


def _refusals_logged(log: str, needed: Sequence[str], user: str) -> None:
    """Each refused request is one log line naming the service account, the verb and the resource."""
    lines = log.splitlines()
    for what in needed:
        hits = [line for line in lines if what in line]
        assert hits, f"no log line says {what!r}:\n{log[-4000:]}"
        assert all(user in line for line in hits), hits
    assert "Traceback" not in log and "HTTP response headers" not in log, log[-4000:]


def test_agent_logs_each_refusal_naming_the_account_verb_and_resource(tmp_path: Path, sim_built: Path) -> None:
    from simnode.cluster import SimCluster

    with SimCluster(tmp_path, "v100-pcie-x4", agent_flags=["--node-labels=team=ml"], agent_rules=[]) as c:
        assert c.agent is not None
        agent = c.agent
        needed = ('cannot list resource "pods"', 'cannot patch resource "nodes"')
        wait_until(
            lambda: all(n in agent.log_text() for n in needed) and "gpu-inventory" in agent.log_text(), "the refusals"
        )
        time.sleep(0.5)  # nothing else to wait for: the agent goes on retrying
        log = agent.log_text()
        _refusals_logged(log, needed, "system:serviceaccount:kube-system:gpu-manager")
        (inventory,) = {line.split(" WARNING ")[-1] for line in log.splitlines() if "cannot publish" in line}
        assert 'cannot patch resource "nodes"' in inventory, inventory


def test_an_allocate_refused_for_a_forbidden_pod_list_says_so_in_one_line(tmp_path: Path, sim_built: Path) -> None:
    from simnode.cluster import SimCluster, gpu_pod
    from simnode.kubelet import KubeletSimError

    with SimCluster(tmp_path, "v100-pcie-x4", agent_rules=[]) as c:
        with pytest.raises(KubeletSimError) as info:
            c.admit(gpu_pod("p", [("c", 50, 4)]))
        message = str(info.value)
        assert 'cannot list resource "pods"' in message, message
        assert "system:serviceaccount:kube-system:gpu-manager" in message, message
        assert "HTTP response headers" not in message and "\n" not in message, message
