"""The API-server simulator and the cluster harnesses are as unkind as a real cluster by default.

The agent (device-plugin and DRA mode) and the extender talk to the API server as the service
account their shipped manifest binds, and are refused (403) what its rules do not grant, unless a
test turns that off explicitly (``agent_rules=None``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.config
import pytest
import yaml

from simnode.apiserver_rbac import SHIPPED, resolve_rules, shipped_account, shipped_rules


def _core(kubeconfig: Path) -> Any:
    cfg = kubernetes.client.Configuration()
    loaded = yaml.safe_load(kubeconfig.read_text())
    kubernetes.config.load_kube_config_from_dict(config_dict=loaded, client_configuration=cfg)  # type: ignore[no-untyped-call]
    return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(cfg))


def _refused(call: Any) -> bool:
    try:
        call()
    except kubernetes.client.exceptions.ApiException as exc:
        return bool(exc.status == 403)
    return False


def test_the_device_plugin_agent_is_held_to_the_charts_rules_by_default(tmp_path: Path) -> None:
    from simnode.cluster import NODE, SimCluster

    c = SimCluster(tmp_path, "t4-x1", driver_mirror=False).start(agent=False)
    try:
        assert c.agent_kubeconfig != c.kubeconfig
        agent = _core(c.agent_kubeconfig)
        assert agent.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={NODE}").items == []
        assert _refused(lambda: agent.delete_node(NODE))  # not granted by deploy/daemonset.yaml
        assert _refused(lambda: agent.read_node(NODE))
        users = {u for u, _a in c.api.authorized()}
        assert users == {f"system:serviceaccount:kube-system:{shipped_account('device-plugin')}"}
        # the harness's own identity (admin, kubelet, scheduler) is not restricted
        _core(c.kubeconfig).read_node(NODE)
    finally:
        c.stop()


def test_the_agent_may_be_unrestricted_when_a_test_says_so(tmp_path: Path) -> None:
    from simnode.cluster import NODE, SimCluster

    c = SimCluster(tmp_path, "t4-x1", driver_mirror=False, agent_rules=None).start(agent=False)
    try:
        assert c.agent_kubeconfig == c.kubeconfig
        _core(c.agent_kubeconfig).read_node(NODE)
    finally:
        c.stop()


def test_the_dra_agent_is_held_to_the_dra_manifests_rules_by_default(tmp_path: Path) -> None:
    from simnode.dra_cluster import DRACluster

    c = DRACluster(tmp_path)
    assert c.agent_rules == shipped_rules("dra")


def test_the_extender_and_the_agents_of_a_multinode_cluster_are_held_to_their_manifests(tmp_path: Path) -> None:
    from simnode.multinode import MultiNodeCluster

    c = MultiNodeCluster(tmp_path, [])
    assert c.agent_rules == shipped_rules("device-plugin")
    assert c.extender_rules == shipped_rules("extender")


def test_agent_rules_other_than_shipped_none_or_a_list_are_refused() -> None:
    assert resolve_rules(SHIPPED, "extender") == shipped_rules("extender")
    assert resolve_rules(None, "dra") is None
    with pytest.raises(ValueError, match="'chart'"):
        resolve_rules("chart", "dra")


def test_a_watch_without_timeout_seconds_is_ended_by_the_server_as_min_request_timeout_ends_it() -> None:
    import urllib3

    from simnode.apiserver import ApiServerSimulator

    with ApiServerSimulator(min_request_timeout=0.2) as sim:
        sim.add_node("n1")
        http = urllib3.PoolManager()
        response = http.request(
            "GET", f"{sim.url}/api/v1/nodes?watch=true", preload_content=False, timeout=urllib3.Timeout(read=30)
        )
        lines = b"".join(response.stream(1024)).splitlines()  # returns only once the server ends the stream
        assert response.status == 200
        assert [json.loads(line)["type"] for line in lines] == ["ADDED"]
        # timeoutSeconds, when given, is what ends it
        response = http.request(
            "GET",
            f"{sim.url}/api/v1/nodes?watch=true&timeoutSeconds=1&resourceVersion={sim.resource_version}",
            preload_content=False,
            timeout=urllib3.Timeout(read=30),
        )
        assert b"".join(response.stream(1024)) == b""


def test_the_api_server_in_its_own_process_holds_the_agent_to_the_charts_rules_too(tmp_path: Path) -> None:
    from simnode.cluster import NODE, SimCluster

    c = SimCluster(tmp_path, "t4-x1", driver_mirror=False, api_process=True).start(agent=False)
    try:
        agent = _core(c.agent_kubeconfig)
        assert agent.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={NODE}").items == []
        assert _refused(lambda: agent.read_node(NODE))
        assert _core(c.kubeconfig).read_node(NODE).metadata.name == NODE
    finally:
        c.stop()


def test_a_service_account_is_refused_a_resource_the_simulator_does_not_serve_before_it_is_told_404() -> None:
    """The real server authorizes a request before it looks for its resource: a service account that
    may not read secrets is answered 403 naming them, not 404; one that may is answered 404 here."""
    from simnode.apiserver import ApiServerSimulator

    with ApiServerSimulator() as sim:
        user = "system:serviceaccount:kube-system:sa"
        token = sim.add_service_account("kube-system", "sa", [])
        core = kubernetes.client.CoreV1Api(sim.client(token=token))
        with pytest.raises(kubernetes.client.exceptions.ApiException) as info:
            core.list_namespaced_secret("kube-system")
        assert info.value.status == 403
        assert json.loads(info.value.body or "")["message"] == (
            f'secrets is forbidden: User "{user}" cannot list resource "secrets" in API group "" '
            'in the namespace "kube-system"'
        )
        events = kubernetes.client.EventsV1Api(core.api_client)
        with pytest.raises(kubernetes.client.exceptions.ApiException) as info:
            events.list_namespaced_event("default", watch=False)
        assert info.value.status == 403
        assert (
            'cannot list resource "events" in API group "events.k8s.io"' in json.loads(info.value.body or "")["message"]
        )
        with pytest.raises(kubernetes.client.exceptions.ApiException) as info:
            core.read_namespace("kube-system")
        assert json.loads(info.value.body or "")["message"] == (
            f'namespaces "kube-system" is forbidden: User "{user}" cannot get resource "namespaces" '
            'in API group "" in the namespace "kube-system"'
        )
        reader = sim.add_service_account(
            "kube-system", "reader", [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]
        )
        with pytest.raises(kubernetes.client.exceptions.ApiException) as info:
            kubernetes.client.CoreV1Api(sim.client(token=reader)).read_namespaced_secret("s", "kube-system")
        assert info.value.status == 404
        refused = [(a.verb, a.group, a.combined, a.namespace, a.name) for _u, a in sim.forbidden()]
        assert refused == [
            ("list", "", "secrets", "kube-system", ""),
            ("list", "events.k8s.io", "events", "default", ""),
            ("get", "", "namespaces", "kube-system", "kube-system"),
        ]


def test_a_bearer_token_the_server_does_not_know_is_answered_401() -> None:
    """A real server answers 401 to a token no authenticator accepts (revoked, of a deleted service
    account, made up); only a request without credentials is the simulator's own user."""
    from simnode.apiserver import ApiServerSimulator

    with ApiServerSimulator() as sim:
        sim.add_node("n1")
        core = kubernetes.client.CoreV1Api(sim.client(token="made-up"))
        with pytest.raises(kubernetes.client.exceptions.ApiException) as info:
            core.read_node("n1")
        assert info.value.status == 401
        assert json.loads(info.value.body or "")["reason"] == "Unauthorized"
        node: Any = kubernetes.client.CoreV1Api(sim.client()).read_node("n1")
        assert node.metadata.name == "n1"
