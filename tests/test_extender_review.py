"""The extender against what the API server and the kube-scheduler may send it."""

from __future__ import annotations

import http.client
import json
import socket
import time
import types
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from gpumanager import names
from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.extender.api import BadRequestError, parse_args, parse_binding
from gpumanager.extender.metrics import ExtenderMetrics
from gpumanager.extender.server import ExtenderServer, Routes, parse_listen
from gpumanager.extender.state import ClusterState
from gpumanager.kube.gpu_inventory import ANNOTATION, encode
from tests.extender_fixtures import PREFIX, World, gpu_pod, held, http_error, inventory, wait_for, with_inits, world

__all__ = ["world"]

GIB = 1 << 30


def _inventory(count: int) -> str:
    gpus = [GPUInfo(i, f"GPU-{i:08x}", "A800", i, 80 * GIB, f"0000:{i:02x}:00.0", 0) for i in range(count)]
    levels = tuple(tuple(0 if a == b else 20 for b in range(count)) for a in range(count))
    return encode(gpus, NodeTopology(levels=levels, nvlink=()), {}, share_mode=True)


def _node(name: str, uid: str, count: int) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "uid": uid, "annotations": {ANNOTATION: _inventory(count)}},
        "status": {"capacity": {names.VCORE_RESOURCE: str(100 * count), names.VMEMORY_RESOURCE: str(320 * count)}},
    }


def test_node_recreated_under_its_name_survives_the_old_ones_deletion_after_a_relist() -> None:
    # After a watch gap, a relist reports the node recreated under the same name (new UID) first,
    # then the deletion of the object it replaced.
    state = ClusterState()
    state.node_event("ADDED", _node("n1", "uid-old", 2))
    state.node_event("ADDED", _node("n1", "uid-new", 4))
    state.node_event("DELETED", _node("n1", "uid-old", 2))
    gpus = state.node("n1")
    assert gpus is not None, "the recreated node n1 was dropped by the old object's deletion"
    assert gpus.gpu_count == 4


def test_node_recreated_with_the_same_gpus_survives_the_old_ones_deletion() -> None:
    state = ClusterState()
    state.node_event("ADDED", _node("n1", "uid-old", 2))
    state.node_event("ADDED", _node("n1", "uid-new", 2))
    state.node_event("DELETED", _node("n1", "uid-old", 2))
    assert state.node_names() == ["n1"]
    state.node_event("DELETED", _node("n1", "uid-new", 2))
    assert state.node_names() == []


def test_deeply_nested_request_body_is_refused_by_name() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    body = b'{"Pod":{"metadata":{"name":"a"},"x":' + deep + b'},"NodeNames":["n1"]}'
    with pytest.raises(BadRequestError, match=r"ExtenderArgs: .*nested too deeply"):
        parse_args(body)
    binding = b'{"PodName":"a","PodNamespace":"default","PodUID":"u","Node":"n1","X":' + deep + b"}"
    with pytest.raises(BadRequestError, match="ExtenderBindingArgs"):
        parse_binding(binding)


@pytest.mark.skipif(not socket.has_dualstack_ipv6(), reason="this host has no dual-stack IPv6")
@pytest.mark.parametrize("listen", [":0", "0.0.0.0:0"])
def test_wildcard_listen_answers_over_ipv6_and_ipv4(listen: str) -> None:
    # An IPv6 cluster reaches the extender's pod (the scheduler, the kubelet's probes) over IPv6.
    host, port = parse_listen(listen)
    routes = Routes(verbs={}, ready=lambda: (True, {}), version={"version": "test"})
    server = ExtenderServer(host, port, routes, ExtenderMetrics(dict), idle_timeout=5)
    server.start()
    try:
        for address in ("::1", "127.0.0.1"):
            conn = http.client.HTTPConnection(address, server.port, timeout=5)
            try:
                conn.request("GET", "/healthz")
                response = conn.getresponse()
                assert (response.status, response.read()) == (200, b"ok"), address
            finally:
                conn.close()
    finally:
        server.stop()


def test_bind_failures_of_deleted_pods_are_not_remembered_for_ever(monkeypatch: pytest.MonkeyPatch) -> None:
    # A pod deleted between filter and bind: the watch shows its end, then bind's patch answers 404.
    state = ClusterState(assume_ttl=10)
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    for k in range(100):
        pod = {"metadata": {"name": f"p{k}", "namespace": "default", "uid": f"u{k}"}, "spec": {}}
        state.pod_event("ADDED", pod)
        state.pod_event("DELETED", pod)
        state.given_up(f"u{k}", "123")
        state.assumed_bound(f"u{k}", bound=False, node="n1")
    clock[0] += 11
    state.expire()
    assert state._given_up == {}
    assert state._unanswered == {}


def _one_gpu_world(world: World, **settings: Any) -> None:
    world.add_node("n1", inventory([80]), gpus=1)
    world.start_extender(**settings)


def test_a_made_binding_keeps_its_gpus_while_the_pod_watch_lags_past_the_ttl(world: World) -> None:
    _one_gpu_world(world, assume_ttl=1)
    world.api.hold_watches(True)
    a = world.create(gpu_pod("a", [(60, 8)]))
    assert world.bind(a, "n1") == ""
    time.sleep(1.3)
    world.extender.state.expire()
    b = world.create(gpu_pod("b", [(60, 8)]))
    assert world.passed(b, ["n1"]) == [], "pod a's GPUs were handed out again while the watch lagged"
    world.api.hold_watches(False)
    wait_for(lambda: world.extender.state.assumed_count() == 0, what="the watch showing pod a bound")
    assert world.passed(b, ["n1"]) == []


def test_a_relist_without_a_bound_pod_releases_its_gpus(world: World) -> None:
    _one_gpu_world(world, assume_ttl=600)
    world.api.hold_watches(True)
    a = world.create(gpu_pod("a", [(60, 8)]))  # never shown by the watch
    assert world.bind(a, "n1") == ""
    world.api.set_down(True, "refuse")
    world.api.hold_watches(False)
    world.api.delete_pod("default", "a")
    world.api.compact()
    lists = world.extender.pods.lists
    world.api.set_down(False)
    wait_for(lambda: world.extender.pods.lists > lists, what="a relist of the pods")
    wait_for(lambda: world.extender.state.assumed_count() == 0, what="pod a released")
    b = world.create(gpu_pod("b", [(60, 8)]))
    assert world.passed(b, ["n1"]) == ["n1"]


def _html_reads(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    page = b"<html><body>" + b"Sign in to continue. " * 400 + b"</body></html>"
    monkeypatch.setattr(
        world.extender.binder._core,
        "read_namespaced_pod",
        lambda *_a, **_k: types.SimpleNamespace(status=200, data=page),
    )


def test_a_pod_read_answered_with_html_is_a_clear_bind_error(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    _one_gpu_world(world)
    world.api.hold_watches(True)  # the pod is not in the watch cache: bind reads it
    a = world.create(gpu_pod("a", [(60, 8)]))
    _html_reads(world, monkeypatch)
    status, answer = http_error(
        world, "bind", json.dumps({"PodName": "a", "PodNamespace": "default", "PodUID": "uid-a", "Node": "n1"}).encode()
    )
    assert status == 200
    assert "default/a" in answer["Error"] and "<html><body>Sign in" in answer["Error"]
    assert len(answer["Error"]) < 600
    assert world.extender.state.assumption(a["metadata"]["uid"]) is None


def test_an_unreadable_pod_after_a_failed_binding_leaves_no_endless_assumption(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    _one_gpu_world(world)
    a = world.create(gpu_pod("a", [(60, 8)]))
    wait_for(lambda: world.extender.pods.get("uid-a") is not None, what="the watch showing pod a")
    world.api.hold_watches(True)
    _html_reads(world, monkeypatch)
    world.api.fail_next("POST", r"/binding$", 409, message="the object has been modified")
    error = world.bind(a, "n1")
    assert "default/a" in error and "<html>" in error
    found = world.extender.state.assumption("uid-a")
    assert found is None or found.expires < float("inf"), "the failed bind's GPUs are held for ever"


def test_a_binding_refused_for_a_recreated_pod_releases_its_gpus_at_once(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    _one_gpu_world(world, assume_ttl=600)
    a = world.create(gpu_pod("a", [(60, 8)]))
    wait_for(lambda: world.extender.pods.get("uid-a") is not None, what="the watch showing pod a")

    def recreated_meanwhile(name: str, namespace: str, body: Any, **_kw: Any) -> None:
        world.api.delete_pod(namespace, name)
        again = gpu_pod(name, [(10, 1)])
        again["metadata"]["uid"] = "uid-a2"
        world.api.create_pod(again)
        exc = ApiException(status=409, reason="Conflict")
        exc.body = json.dumps(
            {
                "kind": "Status",
                "code": 409,
                "message": f'Operation cannot be fulfilled on pods/binding "{name}": Precondition failed: '
                f"UID in precondition: {body['metadata']['uid']}, UID in object meta: uid-a2",
            }
        )
        raise exc

    world.api.hold_watches(True)
    monkeypatch.setattr(world.extender.binder._core, "create_namespaced_pod_binding", recreated_meanwhile)
    error = world.bind(a, "n1")
    assert "recreated" in error and "released" in error and "may still be made" not in error, error
    assert world.extender.state.assumption("uid-a") is None
    b = world.create(gpu_pod("b", [(60, 8)]))
    assert world.passed(b, ["n1"]) == ["n1"]


def _readyz(world: World) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", world.extender.server.port, timeout=5)
    try:
        conn.request("GET", "/readyz")
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_readyz_reports_a_failing_pod_watch_and_recovers(world: World) -> None:
    _one_gpu_world(world, assume_ttl=1)
    assert _readyz(world)[0] == 200
    world.api.set_down(True, "503")
    wait_for(lambda: _readyz(world)[0] == 503, timeout=30, what="/readyz answering 503")
    # The node watch may pass its grace first (it says 503 alone then): wait for the pod watch's.
    wait_for(lambda: "pods_watch_error" in _readyz(world)[1], timeout=30, what="/readyz naming the pod watch")
    status, detail = _readyz(world)
    assert status == 503 and detail["ready"] is False and "503" in str(detail["pods_watch_error"]), detail
    world.api.set_down(False)
    wait_for(lambda: _readyz(world)[0] == 200, timeout=30, what="/readyz answering 200 again")


def test_readyz_reports_a_hung_api_server_whose_open_watches_went_silent(world: World) -> None:
    """A hung API server answers nothing, not even its open watches' bookmarks or their end: a watch
    silent past its own timeout is broken, and /readyz says so; it recovers when the server does."""
    _one_gpu_world(world, assume_ttl=1, watch_timeout=2)
    assert _readyz(world)[0] == 200
    world.api.set_down(True, "hang")
    try:
        wait_for(lambda: _readyz(world)[0] == 503, timeout=30, what="/readyz answering 503")
        detail = _readyz(world)[1]
        errors = [str(v).lower() for k, v in detail.items() if k.endswith("_watch_error")]  # either may be first
        assert errors and all("timed out" in e for e in errors), detail
    finally:
        world.api.set_down(False)
    wait_for(lambda: _readyz(world)[0] == 200, timeout=30, what="/readyz answering 200 again")


def test_charges_on_gpus_a_node_does_not_have_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    # The node's inventory cannot be read: judged from its capacity as GPUs 0 and 1, while the
    # pod holds GPU 3 (the node's minors are not contiguous).
    state = ClusterState()
    node = _node("n1", "uid-n1", 2)
    node["metadata"]["annotations"][ANNOTATION] = "not an inventory"
    state.node_event("ADDED", node)
    pod = gpu_pod("a", [(50, 8)], node="n1", annotations={**held("n1", [[3]])}, phase="Running")
    with caplog.at_level("WARNING", logger="gpumanager.extender"):
        state.pod_event("ADDED", pod)
        pod["metadata"]["resourceVersion"] = "2"
        state.pod_event("MODIFIED", pod)
    found = [r.getMessage() for r in caplog.records if "GPU 3" in r.getMessage()]
    assert len(found) == 1, found
    assert "default/a" in found[0] and "n1" in found[0]


def test_a_pod_whose_only_gpu_containers_are_init_containers_is_placed(world: World) -> None:
    """Ordinary init containers asking for GPUs, app containers asking none: filter refuses a node
    where they cannot run, and bind names their GPUs as for any GPU init container (the agent places
    them there); they stay charged while the pod runs, as the agent counts them."""
    world.add_node("roomy", inventory([80, 80]), gpus=2)
    world.add_node("full", inventory([80]), gpus=1)
    world.create(gpu_pod("whole", [(100, 0)], node="full", annotations=held("full", [[0]])))
    world.start_extender()
    world.wait_seen(1)
    pod = world.create(with_inits(gpu_pod("only-init", [(0, 0)]), [("setup", 50, 8, False), ("warm", 100, 0, False)]))
    answer = world.filter(pod)
    assert [n["metadata"]["name"] for n in answer["Nodes"]["items"]] == ["roomy"], answer
    assert "init container 'setup'" in answer["FailedNodes"]["full"], answer
    scores = world.scores(pod)
    assert scores["roomy"] >= scores["full"], scores
    error = world.bind(pod, "full")
    assert "no longer fits on node full" in error and "init container 'setup'" in error, error
    assert f"{PREFIX}-1" not in world.annotations(pod)
    assert world.bind(pod, "roomy") == ""
    annotations = world.annotations(pod)
    assert annotations.get(f"{PREFIX}-1") in ("0", "1"), annotations
    assert annotations.get(f"{PREFIX}-2") in ("0", "1"), annotations
    assert annotations[names.PREDICATE_NODE] == "roomy"
    assert annotations[names.GPU_ASSIGNED] == "false" and annotations[names.PREDICATE_TIME], annotations
    assert not any(k == f"{PREFIX}0" for k in annotations), annotations
    # The agent keeps an init container's charge until the pod ends (as the kubelet counts its devices):
    # the GPU of the whole-GPU init container stays held, so a pod of two whole GPUs does not fit roomy.
    wait_for(lambda: world.extender.state.assumed_count() == 0, what="the watch showing the pod bound")
    gpus = world.extender.state.node("roomy")
    assert gpus is not None and gpus.tree.leaf_by_minor(int(annotations[f"{PREFIX}-2"])).allocatable_cores == 0
    assert world.passed(world.create(gpu_pod("two", [(200, 0)])), ["roomy"]) == []
    assert world.extender.state.over_committed() == {}
