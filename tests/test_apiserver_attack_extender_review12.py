"""The scheduler extender's watches against an API server sending objects of unexpected shape."""

from __future__ import annotations

import logging
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpumanager.extender.state import ClusterState
from gpumanager.extender.watches import Watch
from gpumanager.kube.client import api_client
from simnode.apiserver import ApiServerSimulator
from tests.test_apiserver_attack_review12 import RawApi


@pytest.fixture()
def raw() -> Any:
    server = RawApi()
    yield server
    server.close()


def _node(name: str, **meta: Any) -> dict[str, Any]:
    return {
        "kind": "Node",
        "metadata": {"name": name, "uid": f"u-{name}", "resourceVersion": "3", **meta},
        "status": {"capacity": {"tencent.com/vcuda-core": "200", "tencent.com/vcuda-memory": "64"}},
    }


def test_node_watch_survives_nodes_of_unexpected_shape(
    raw: RawApi, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A node whose annotations were a list failed the state's listener with a traceback (and the node was
    never judged); a node whose metadata was null failed every later list (the relist compared it with
    what the first list held), so the watch listed again every 10 s for ever and missed every change.
    Each is now judged or skipped with a warning naming it, and the good nodes stay known."""
    odd_notes = _node("odd-notes", annotations=["tencent.com/gpu-inventory"])
    odd_status = _node("odd-status")
    odd_status["status"] = ["capacity"]
    no_meta = {"kind": "Node", "metadata": None}
    items = [_node("good"), odd_notes, odd_status, no_meta, "node"]
    raw.list_body = lambda _h: {"metadata": {"resourceVersion": "10"}, "items": items}

    def expire(handler: BaseHTTPRequestHandler) -> None:
        raw.start_stream(handler)
        if raw.watches == 1:  # the first watch: 410, a list again
            raw.event(handler, {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}})
            handler.wfile.write(b"0\r\n\r\n")
            return
        raw.stopping.wait(60)

    raw.watch = expire
    caplog.set_level(logging.INFO)
    state = ClusterState(assume_ttl=30)
    api = api_client(raw.kubeconfig(tmp_path / "kc"), wait_as_told=False)
    watch = Watch("nodes", client.CoreV1Api(api).list_node, watch_timeout=30)
    watch.add_listener(lambda kind, obj, _prev: state.node_event(kind, obj))
    watch.start()
    try:
        deadline = time.monotonic() + 10
        while raw.watches < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert raw.watches >= 2, caplog.text[-3000:]
        assert raw.lists == 2
        assert watch.failing() is None, watch.failing()
        assert state.seen_node("good")
    finally:
        watch.stop()
    assert not [r.getMessage() for r in caplog.records if r.exc_info]
    assert "odd-notes" in caplog.text


def test_node_watch_lists_again_when_the_resource_version_went_back(tmp_path: Path) -> None:
    """After the API server's etcd was restored from a backup, each watch from the extender's (now too large)
    resourceVersion was answered 504 "Too large resource version" and tried again from it for ever: no node
    added or changed since was seen. The watch lists again."""
    with ApiServerSimulator() as sim:
        sim.add_node("before")
        backup = sim.backup()
        api = api_client(str(sim.write_kubeconfig(tmp_path / "kc")), wait_as_told=False)
        watch = Watch("nodes", client.CoreV1Api(api).list_node, watch_timeout=30)
        watch.start()
        try:
            assert watch.wait_synced(5.0)
            for i in range(4):
                sim.add_node(f"more{i}")
            deadline = time.monotonic() + 5
            while len(watch) < 5 and time.monotonic() < deadline:
                time.sleep(0.05)
            sim.restore(backup)
            sim.add_node("after")
            deadline = time.monotonic() + 25
            while len(watch) != 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert sorted(n["metadata"]["name"] for n in watch.objects()) == ["after", "before"]
        finally:
            watch.stop()


def test_pod_of_unexpected_spec_is_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """A pod whose spec was a string or a list failed the extender's pod listener with a traceback."""
    from simnode.apiserver_objects import pod_manifest

    state = ClusterState(assume_ttl=30)
    for spec in ("spec", ["containers"], 5):
        pod = pod_manifest("p", node="n1")
        pod["metadata"]["uid"] = "u1"
        pod["spec"] = spec
        for kind in ("ADDED", "MODIFIED", "DELETED"):
            state.pod_event(kind, pod)
    assert not [r for r in caplog.records if r.exc_info]


def test_watch_keeps_no_managed_fields(raw: RawApi, tmp_path: Path) -> None:
    """The extender kept every GPU pod of the cluster as the API server sent it, managedFields included (the
    server's record of which client set which field, never read here, most of a pod's size): 20,000 pods
    held 193 MiB, 38 MiB without them. They are dropped as the agent's pod cache drops them."""
    fields = [{"manager": "kubelet", "operation": "Update", "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {}}}]

    def pod(i: int) -> dict[str, Any]:
        return {
            "metadata": {
                "name": f"p{i}",
                "namespace": "default",
                "uid": f"u{i}",
                "resourceVersion": "5",
                "managedFields": fields,
            },
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"tencent.com/vcuda-core": "50"}}}]},
        }

    raw.list_body = lambda _h: {"metadata": {"resourceVersion": "10"}, "items": [pod(i) for i in range(50)]}

    def one_more(handler: BaseHTTPRequestHandler) -> None:
        raw.start_stream(handler)
        raw.event(handler, {"type": "ADDED", "object": pod(50)})
        raw.stopping.wait(60)

    raw.watch = one_more
    api = api_client(raw.kubeconfig(tmp_path / "kc"), wait_as_told=False)
    watch = Watch("pods", client.CoreV1Api(api).list_pod_for_all_namespaces, watch_timeout=30)
    watch.start()
    try:
        deadline = time.monotonic() + 10
        while len(watch) < 51 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(watch) == 51
        assert not [o for o in watch.objects() if "managedFields" in o["metadata"]]
    finally:
        watch.stop()


def test_bind_refused_by_a_connection_reset_says_so_in_one_clear_line(tmp_path: Path) -> None:
    """A bind whose API server reset the connection answered the scheduler with urllib3's own text
    ("MaxRetryError: HTTPSConnectionPool(...): Max retries exceeded with url: ... (Caused by ...)"), which
    the scheduler shows in the pod's events. It now names the server and why."""
    from gpumanager.extender.api import BindingArgs
    from gpumanager.extender.binder import Binder, BindError
    from tests.test_apiserver_attack_dra_review12 import _resetting_server

    config, port, srv = _resetting_server(tmp_path)
    try:
        binder = Binder(api_client(config, wait_as_told=False), ClusterState(assume_ttl=30), "binpack")
        with pytest.raises(BindError) as refused:
            binder.bind(BindingArgs("p", "default", "u-p", "node-1"))
    finally:
        srv.close()
    message = str(refused.value)
    assert f"cannot reach the API server at https://127.0.0.1:{port}" in message, message
    assert "Max retries" not in message and "\n" not in message, message
