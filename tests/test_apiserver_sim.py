"""The API-server simulator, driven through the real ``kubernetes`` client."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from gpumanager.kube.client import api_client
from gpumanager.kube.rest import KubeRest
from simnode.apiserver import ApiError, ApiServerSimulator, pod_manifest
from simnode.apiserver_patch import (
    NODE_MERGE_KEYS,
    POD_MERGE_KEYS,
    PatchError,
    json_patch,
    merge_patch,
    strategic_merge_patch,
)
from simnode.apiserver_selectors import parse_label_selector

VCORE = "tencent.com/vcuda-core"
VMEM = "tencent.com/vcuda-memory"


@pytest.fixture
def sim() -> Iterator[ApiServerSimulator]:
    with ApiServerSimulator(bookmark_interval=0.2) as server:
        yield server


@pytest.fixture
def v1(sim: ApiServerSimulator) -> client.CoreV1Api:
    return client.CoreV1Api(sim.client())


def status_of(exc: ApiException) -> dict[str, Any]:
    """The Status object an error answer carried."""
    body = exc.body.decode() if isinstance(exc.body, bytes) else exc.body
    return dict(json.loads(body))


class Collector:
    """Consumes ``Watch.stream`` on a thread; events (or the exception that ended it) in a queue."""

    def __init__(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.watch = watch.Watch()
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.error: BaseException | None = None
        self.done = threading.Event()

        def run() -> None:
            try:
                for event in self.watch.stream(func, *args, **kwargs):
                    self.events.put(event)
            except BaseException as exc:  # the test inspects it
                self.error = exc
            finally:
                self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def next(self, timeout: float = 5.0) -> dict[str, Any]:
        return self.events.get(timeout=timeout)

    def take(self, n: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        return [self.next(timeout) for _ in range(n)]

    def stop(self) -> None:
        self.watch.stop()
        self.thread.join(timeout=5)


def names(items: list[Any]) -> list[str]:
    return [f"{p.metadata.namespace}/{p.metadata.name}" for p in items]


# --------------------------------------------------------------------------------------------
# configuration, discovery, auth


def test_kubeconfig_loads_with_the_client_and_the_agent_helpers(sim: ApiServerSimulator, tmp_path: Path) -> None:
    path = sim.write_kubeconfig(tmp_path / "kube" / "config")
    api = config.new_client_from_config(config_file=str(path))
    assert client.VersionApi(api).get_code().git_version == "v1.31.4"
    assert KubeRest(api_client(str(path))).json("GET", "/version")["gitVersion"] == "v1.31.4"
    assert api.configuration.host == sim.url


def test_discovery_documents(v1: client.CoreV1Api, sim: ApiServerSimulator) -> None:
    versions = client.CoreApi(sim.client()).get_api_versions()
    assert versions.versions == ["v1"]
    resources = {r.name: r for r in v1.get_api_resources().resources}
    assert resources["pods"].namespaced and resources["pods"].kind == "Pod"
    assert not resources["nodes"].namespaced
    assert "watch" in resources["pods"].verbs
    assert {"pods/status", "nodes/status", "pods/binding"} <= set(resources)


def test_bearer_token_is_checked(tmp_path: Path) -> None:
    with ApiServerSimulator(token="s3cret") as sim:
        sim.create_pod(pod_manifest("p0"))
        good = client.CoreV1Api(sim.client())
        assert names(good.list_namespaced_pod("default").items) == ["default/p0"]
        cfg = client.Configuration()
        cfg.host = sim.url
        cfg.api_key = {"BearerToken": "wrong"}
        cfg.api_key_prefix = {"BearerToken": "Bearer"}
        with pytest.raises(ApiException) as bad:
            client.CoreV1Api(client.ApiClient(cfg)).list_namespaced_pod("default")
        assert bad.value.status == 401 and status_of(bad.value)["reason"] == "Unauthorized"
        anon_cfg = client.Configuration()
        anon_cfg.host = sim.url
        anonymous = client.ApiClient(anon_cfg)
        assert client.VersionApi(anonymous).get_code().git_version.startswith("v1.")
        with pytest.raises(ApiException) as forbidden:
            client.CoreV1Api(anonymous).list_namespaced_pod("default")
        assert forbidden.value.status == 403
        assert 'User "system:anonymous" cannot list resource "pods"' in status_of(forbidden.value)["message"]


def test_the_bearer_scheme_is_case_insensitive_as_on_a_real_server() -> None:
    # The client's in-cluster loader sends "bearer <token>"; the API server's token authenticator
    # compares the scheme without regard to case.
    with ApiServerSimulator(token="s3cret") as sim:
        for scheme in ("bearer", "BEARER"):
            cfg = client.Configuration()
            cfg.host = sim.url
            cfg.api_key = {"BearerToken": f"{scheme} s3cret"}
            assert client.CoreV1Api(client.ApiClient(cfg)).list_namespaced_pod("default").items == []
        cfg.api_key = {"BearerToken": "Basic s3cret"}
        with pytest.raises(ApiException) as bad:
            client.CoreV1Api(client.ApiClient(cfg)).list_namespaced_pod("default")
        assert bad.value.status == 401


# --------------------------------------------------------------------------------------------
# list, get, create


def _populate(sim: ApiServerSimulator) -> None:
    sim.create_pod(pod_manifest("a1", namespace="ns-a", node="node-1", labels={"app": "x", "tier": "gpu"}))
    sim.create_pod(pod_manifest("a2", namespace="ns-a", node="node-2", labels={"app": "y"}, phase="Running"))
    sim.create_pod(
        pod_manifest("b1", namespace="ns-b", node="node-1", labels={"app": "y", "tier": "cpu"}, phase="Running")
    )
    sim.create_pod(pod_manifest("b2", namespace="ns-b", node=None, labels={"app": "z"}))


def test_list_with_field_selectors_across_namespaces(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    _populate(sim)
    every = v1.list_pod_for_all_namespaces()
    assert every.kind == "PodList" and every.metadata.resource_version == str(sim.resource_version)
    assert names(every.items) == ["ns-a/a1", "ns-a/a2", "ns-b/b1", "ns-b/b2"]

    def sel(field_selector: str) -> list[str]:
        return names(v1.list_pod_for_all_namespaces(field_selector=field_selector).items)

    assert sel("spec.nodeName=node-1") == ["ns-a/a1", "ns-b/b1"]
    assert sel("spec.nodeName==node-1,status.phase=Running") == ["ns-b/b1"]
    assert sel("status.phase!=Running") == ["ns-a/a1", "ns-b/b2"]
    assert sel("spec.nodeName=") == ["ns-b/b2"]
    assert sel("metadata.name=a2") == ["ns-a/a2"]
    assert sel("metadata.namespace=ns-b,spec.nodeName=node-1") == ["ns-b/b1"]
    assert names(v1.list_namespaced_pod("ns-a", field_selector="spec.nodeName=node-1").items) == ["ns-a/a1"]
    with pytest.raises(ApiException) as bad:
        sel("spec.bogus=1")
    assert bad.value.status == 400 and "field label not supported" in status_of(bad.value)["message"]


def test_list_with_label_selectors(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    _populate(sim)

    def sel(label_selector: str) -> list[str]:
        return [p.metadata.name for p in v1.list_pod_for_all_namespaces(label_selector=label_selector).items]

    assert sel("app=y") == ["a2", "b1"]
    assert sel("app==y,tier=cpu") == ["b1"]
    assert sel("app!=y") == ["a1", "b2"]
    assert sel("app in (x, z)") == ["a1", "b2"]
    assert sel("app notin (x,z)") == ["a2", "b1"]
    assert sel("tier") == ["a1", "b1"]
    assert sel("!tier") == ["a2", "b2"]
    assert sel("tier!=gpu") == ["a2", "b1", "b2"]
    with pytest.raises(ApiException) as bad:
        sel("app in x")
    assert bad.value.status == 400


def test_list_pages_with_limit_and_continue(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    for i in range(5):
        sim.create_pod(pod_manifest(f"p{i}"))
    first = v1.list_namespaced_pod("default", limit=2)
    assert [p.metadata.name for p in first.items] == ["p0", "p1"]
    assert first.metadata.remaining_item_count == 3
    sim.create_pod(pod_manifest("p3a"))  # after the first page: not in this consistent list
    second = v1.list_namespaced_pod("default", limit=2, _continue=first.metadata._continue)
    assert [p.metadata.name for p in second.items] == ["p2", "p3"]
    assert second.metadata.resource_version == first.metadata.resource_version
    third = v1.list_namespaced_pod("default", limit=2, _continue=second.metadata._continue)
    assert [p.metadata.name for p in third.items] == ["p4"] and not third.metadata._continue
    sim.compact()
    with pytest.raises(ApiException) as gone:
        v1.list_namespaced_pod("default", limit=2, _continue=first.metadata._continue)
    assert gone.value.status == 410


def test_get_pod_and_not_found(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    stored = sim.create_pod(pod_manifest("p0", uid="11111111-2222-3333-4444-555555555555"))
    pod = v1.read_namespaced_pod("p0", "default")
    assert pod.metadata.uid == "11111111-2222-3333-4444-555555555555"
    assert pod.metadata.resource_version == stored["metadata"]["resourceVersion"]
    assert pod.spec.containers[0].resources.limits == {VCORE: "50", VMEM: "4"}
    with pytest.raises(ApiException) as missing:
        v1.read_namespaced_pod("nope", "default")
    st = status_of(missing.value)
    assert missing.value.status == 404
    assert (st["kind"], st["reason"], st["message"]) == ("Status", "NotFound", 'pods "nope" not found')
    assert st["details"] == {"name": "nope", "kind": "pods"}
    assert sim.get_pod("default", "nope") is None


def test_create_fills_system_fields_and_defaults(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    before = sim.resource_version
    manifest = pod_manifest("p0", namespace="team", phase="Running", uid="client-chosen")
    pod = v1.create_namespaced_pod("team", manifest)
    assert pod.metadata.uid and pod.metadata.uid != "client-chosen"
    assert int(pod.metadata.resource_version) == before + 1
    assert pod.metadata.creation_timestamp is not None
    assert pod.status.phase == "Pending"  # the server resets the status of new pods
    c0 = pod.spec.containers[0]
    assert c0.resources.requests == {VCORE: "50", VMEM: "4"}  # defaulted from limits
    assert pod.spec.restart_policy == "Always" and c0.termination_message_path == "/dev/termination-log"
    assert sim.get_pod("team", "p0") is not None

    with pytest.raises(ApiException) as dup:
        v1.create_namespaced_pod("team", pod_manifest("p0", namespace="team"))
    assert dup.value.status == 409 and status_of(dup.value)["reason"] == "AlreadyExists"
    with pytest.raises(ApiException) as wrong_ns:
        v1.create_namespaced_pod("other", pod_manifest("p1", namespace="team"))
    assert wrong_ns.value.status == 400
    bad = pod_manifest("p2", containers=[{"name": "c0", "limits": {VCORE: "50"}, "requests": {VCORE: "20"}}])
    with pytest.raises(ApiException) as invalid:
        v1.create_namespaced_pod("default", bad)
    st = status_of(invalid.value)
    assert invalid.value.status == 422 and st["reason"] == "Invalid"
    assert st["details"]["causes"][0]["field"] == f"spec.containers[0].resources.requests[{VCORE}]"
    no_containers = {"metadata": {"name": "p3"}, "spec": {"containers": []}}
    with pytest.raises(ApiException) as empty:
        v1.create_namespaced_pod("default", no_containers)
    assert empty.value.status == 422 and "spec.containers: Required value" in status_of(empty.value)["message"]


def test_create_pod_helper_validates(sim: ApiServerSimulator) -> None:
    with pytest.raises(ApiError) as err:
        sim.create_pod(pod_manifest("Bad_Name"))
    assert err.value.code == 422


# --------------------------------------------------------------------------------------------
# patch, update, status


def test_strategic_merge_patch_is_the_default_and_merges_annotations(
    sim: ApiServerSimulator, v1: client.CoreV1Api
) -> None:
    sim.create_pod(pod_manifest("p0", annotations={"keep": "1", "drop": "2"}))
    pod = v1.patch_namespaced_pod("p0", "default", {"metadata": {"annotations": {"new": "3", "drop": None}}})
    assert pod.metadata.annotations == {"keep": "1", "new": "3"}
    assert sim.requests[-1].content_type == "application/strategic-merge-patch+json"
    assert sim.requests[-1].body == {"metadata": {"annotations": {"new": "3", "drop": None}}}
    # containers merge by name: a strategic patch naming c0 keeps its other fields
    pod = v1.patch_namespaced_pod("p0", "default", {"spec": {"containers": [{"name": "c0", "image": "busybox:1.36"}]}})
    assert pod.spec.containers[0].image == "busybox:1.36"
    assert pod.spec.containers[0].resources.limits[VCORE] == "50"


def test_merge_patch_and_json_patch(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    sim.create_pod(pod_manifest("p0", labels={"a": "1"}))
    pod = v1.patch_namespaced_pod(
        "p0", "default", {"metadata": {"labels": {"b": "2", "a": None}}}, _content_type="application/merge-patch+json"
    )
    assert pod.metadata.labels == {"b": "2"}
    ops = [
        {"op": "add", "path": "/metadata/annotations", "value": {}},
        {"op": "add", "path": "/metadata/annotations/tencent.com~1gpu-assigned", "value": "false"},
    ]
    pod = v1.patch_namespaced_pod("p0", "default", ops)
    assert sim.requests[-1].content_type == "application/json-patch+json"
    assert pod.metadata.annotations == {"tencent.com/gpu-assigned": "false"}
    with pytest.raises(ApiException) as failed:
        v1.patch_namespaced_pod("p0", "default", [{"op": "test", "path": "/metadata/name", "value": "other"}])
    assert failed.value.status == 422
    with pytest.raises(ApiException) as spec_change:
        v1.patch_namespaced_pod("p0", "default", {"spec": {"nodeName": "node-9"}})
    assert spec_change.value.status == 422 and "Forbidden" in status_of(spec_change.value)["message"]
    with pytest.raises(ApiException) as unknown:
        v1.patch_namespaced_pod("p0", "default", {"metadata": {}}, _content_type="application/apply-patch+yaml")
    assert unknown.value.status == 415


def test_stale_resource_version_conflicts(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    created = sim.create_pod(pod_manifest("p0"))
    stale = created["metadata"]["resourceVersion"]
    fresh = v1.patch_namespaced_pod("p0", "default", {"metadata": {"annotations": {"x": "1"}}})
    assert int(fresh.metadata.resource_version) > int(stale)
    with pytest.raises(ApiException) as conflict:
        v1.patch_namespaced_pod("p0", "default", {"metadata": {"resourceVersion": stale, "annotations": {"x": "2"}}})
    st = status_of(conflict.value)
    assert conflict.value.status == 409 and st["reason"] == "Conflict"
    assert "the object has been modified" in st["message"]
    # PUT with the stale resourceVersion conflicts; with the current one it succeeds
    body = created
    body["metadata"]["annotations"] = {"y": "1"}
    with pytest.raises(ApiException) as put_conflict:
        v1.replace_namespaced_pod("p0", "default", body)
    assert put_conflict.value.status == 409
    body["metadata"]["resourceVersion"] = fresh.metadata.resource_version
    replaced = v1.replace_namespaced_pod("p0", "default", body)
    assert replaced.metadata.annotations == {"y": "1"}
    # a patch carrying the current resourceVersion is accepted
    ok = v1.patch_namespaced_pod(
        "p0", "default", {"metadata": {"resourceVersion": replaced.metadata.resource_version, "labels": {"l": "v"}}}
    )
    assert ok.metadata.labels == {"l": "v"}
    # a patch that changes nothing writes nothing
    same = v1.patch_namespaced_pod("p0", "default", {"metadata": {"labels": {"l": "v"}}})
    assert same.metadata.resource_version == ok.metadata.resource_version


def test_status_subresource(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    sim.create_pod(pod_manifest("p0"))
    pod = v1.read_namespaced_pod("p0", "default")
    pod.status.phase = "Running"
    pod.status.pod_ip = "10.1.2.3"
    pod.spec.node_name = "ignored-by-status-update"
    updated = v1.replace_namespaced_pod_status("p0", "default", pod)
    assert updated.status.phase == "Running" and updated.status.pod_ip == "10.1.2.3"
    assert updated.spec.node_name == "node-1"
    patched = v1.patch_namespaced_pod_status(
        "p0", "default", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    )
    patched = v1.patch_namespaced_pod_status(
        "p0", "default", {"status": {"conditions": [{"type": "PodScheduled", "status": "True"}]}}
    )
    assert sorted(c.type for c in patched.status.conditions) == ["PodScheduled", "Ready"]  # merged by type
    assert patched.status.phase == "Running"
    # the main resource cannot change the status
    main = v1.patch_namespaced_pod("p0", "default", {"status": {"phase": "Failed"}})
    assert main.status.phase == "Running"
    v1.patch_namespaced_pod_status("p0", "default", {"status": {"phase": "Succeeded"}})
    with pytest.raises(ApiException) as back:
        v1.patch_namespaced_pod_status("p0", "default", {"status": {"phase": "Running"}})
    assert back.value.status == 422


def test_delete_pod(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    created = sim.create_pod(pod_manifest("p0"))
    with pytest.raises(ApiException) as precondition:
        v1.delete_namespaced_pod(
            "p0", "default", body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid="other"))
        )
    assert precondition.value.status == 409
    # p0 is on a node: it stays, marked, until its kubelet deletes it with grace 0
    deleted = v1.delete_namespaced_pod("p0", "default", grace_period_seconds=30)
    assert deleted.metadata.uid == created["metadata"]["uid"]
    assert deleted.metadata.deletion_timestamp is not None and deleted.metadata.deletion_grace_period_seconds == 30
    longer = v1.delete_namespaced_pod("p0", "default", grace_period_seconds=60)  # may only shorten it
    assert longer.metadata.deletion_grace_period_seconds == 30
    assert sim.get_pod("default", "p0") is not None
    v1.delete_namespaced_pod("p0", "default", grace_period_seconds=0)
    assert sim.get_pod("default", "p0") is None
    with pytest.raises(ApiException) as again:
        v1.delete_namespaced_pod("p0", "default")
    assert again.value.status == 404


def test_graceful_delete_and_finalizers() -> None:
    with ApiServerSimulator() as sim:  # graceful deletion is the default, as on a real server
        v1 = client.CoreV1Api(sim.client())
        sim.create_pod(pod_manifest("p0"))
        sim.create_pod(pod_manifest("unscheduled", node=None))
        collector = Collector(v1.list_namespaced_pod, "default", resource_version=str(sim.resource_version))
        assert sim.wait_for_watches(1)
        pending = v1.delete_namespaced_pod("p0", "default")
        assert pending.metadata.deletion_timestamp is not None and pending.metadata.deletion_grace_period_seconds == 30
        assert sim.get_pod("default", "p0") is not None
        v1.delete_namespaced_pod("unscheduled", "default")  # not on a node: gone at once
        assert sim.finish_deletion("default", "p0") is not None
        events = [(e["type"], e["object"].metadata.name) for e in collector.take(3)]
        assert events == [("MODIFIED", "p0"), ("DELETED", "unscheduled"), ("DELETED", "p0")]
        # a finalizer holds the object until it is removed
        sim.create_pod({**pod_manifest("fin"), "metadata": {"name": "fin", "finalizers": ["example.com/hold"]}})
        v1.delete_namespaced_pod("fin", "default", grace_period_seconds=0)
        assert sim.get_pod("default", "fin")["metadata"]["deletionTimestamp"]  # type: ignore[index]
        v1.patch_namespaced_pod(
            "fin", "default", {"metadata": {"finalizers": None}}, _content_type="application/merge-patch+json"
        )
        assert sim.get_pod("default", "fin") is None
        collector.stop()


def test_graceful_delete_off_removes_every_pod_at_once() -> None:
    with ApiServerSimulator(graceful_delete=False) as sim:
        sim.create_pod(pod_manifest("p0"))
        sim.set_pod_phase("default", "p0", "Running")
        client.CoreV1Api(sim.client()).delete_namespaced_pod("p0", "default")
        assert sim.get_pod("default", "p0") is None


def test_in_process_deletion_helpers_and_pod_events() -> None:
    with ApiServerSimulator() as sim:
        events = sim.pod_events()
        first = sim.create_pod(pod_manifest("p0"))
        marked = sim.request_deletion("default", "p0")
        assert marked is not None and marked["metadata"]["deletionGracePeriodSeconds"] == 30
        assert sim.finish_deletion("default", "p0", uid="another-uid") is None  # not that pod
        assert sim.get_pod("default", "p0") is not None
        assert sim.finish_deletion("default", "p0", uid=first["metadata"]["uid"]) is not None
        assert sim.get_pod("default", "p0") is None and sim.request_deletion("default", "p0") is None
        sim.close_pod_events(events)
        sim.create_pod(pod_manifest("after"))
        seen = []
        while not events.empty():
            kind, pod = events.get_nowait()
            seen.append((kind, pod["metadata"]["name"], bool(pod["metadata"].get("deletionTimestamp"))))
        assert seen == [("ADDED", "p0", False), ("MODIFIED", "p0", True), ("DELETED", "p0", True)]
        assert sim.watch_count() == 0  # not a watch


@pytest.mark.parametrize("flags", [[], ["--graceful-delete"], ["--no-graceful-delete"]])
def test_process_deletes_gracefully_unless_told_not_to(tmp_path: Path, flags: list[str]) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    cmd = [sys.executable, "-m", "simnode.apiserver", f"--kubeconfig={kubeconfig}", "--node=n1", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not kubeconfig.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the API-server process did not start"
            time.sleep(0.05)
        time.sleep(0.1)
        v1 = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
        v1.create_namespaced_pod("default", pod_manifest("p0", node="n1"))
        v1.delete_namespaced_pod("p0", "default")
        left = [p.metadata.name for p in v1.list_namespaced_pod("default").items]
        assert left == ([] if "--no-graceful-delete" in flags else ["p0"])
    finally:
        proc.terminate()
        proc.wait(10)


def test_binding_sets_the_node_once(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    sim.create_pod(pod_manifest("p0", node=None))
    body = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "p0"},
        "target": {"kind": "Node", "name": "node-7"},
    }
    v1.api_client.call_api(
        *v1.api_client.param_serialize("POST", "/api/v1/namespaces/default/pods/p0/binding", body=body)
    ).read()
    assert sim.get_pod("default", "p0")["spec"]["nodeName"] == "node-7"  # type: ignore[index]
    again = v1.api_client.call_api(
        *v1.api_client.param_serialize("POST", "/api/v1/namespaces/default/pods/p0/binding", body=body)
    )
    assert again.status == 409


# --------------------------------------------------------------------------------------------
# watch


def test_watch_streams_added_modified_deleted(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    sim.create_pod(pod_manifest("old", node="node-1"))
    listed = v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=node-1")
    collector = Collector(
        v1.list_pod_for_all_namespaces,
        field_selector="spec.nodeName=node-1",
        resource_version=listed.metadata.resource_version,
    )
    assert sim.wait_for_watches(1)
    v1.create_namespaced_pod("ns-x", pod_manifest("p1", namespace="ns-x"))
    sim.create_pod(pod_manifest("elsewhere", node="node-2"))  # filtered out
    v1.patch_namespaced_pod("p1", "ns-x", {"metadata": {"annotations": {"k": "v"}}})
    sim.set_pod_phase("ns-x", "p1", "Running", podIP="10.0.0.7")
    v1.delete_namespaced_pod("p1", "ns-x")  # graceful: marked first
    sim.finish_deletion("ns-x", "p1")  # the kubelet's DELETE with grace 0
    events = collector.take(5)
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "MODIFIED", "MODIFIED", "DELETED"]
    assert all(isinstance(e["object"], client.V1Pod) for e in events)
    assert all(e["object"].metadata.name == "p1" for e in events)
    assert events[1]["object"].metadata.annotations == {"k": "v"}
    assert events[2]["object"].status.pod_ip == "10.0.0.7"
    assert events[3]["object"].metadata.deletion_timestamp is not None
    rvs = [int(e["object"].metadata.resource_version) for e in events]
    assert rvs == sorted(rvs) and len(set(rvs)) == 5
    assert events[4]["raw_object"]["kind"] == "Pod"
    collector.stop()


def test_watch_without_resource_version_starts_with_the_current_state(
    sim: ApiServerSimulator, v1: client.CoreV1Api
) -> None:
    sim.create_pod(pod_manifest("a"))
    sim.create_pod(pod_manifest("b", labels={"x": "1"}))
    collector = Collector(v1.list_namespaced_pod, "default", label_selector="x=1")
    first = collector.next()
    assert (first["type"], first["object"].metadata.name) == ("ADDED", "b")
    # a pod that stops matching the selector is DELETED for this watch, one that starts matching ADDED
    sim.update_pod("default", "b", lambda p: p["metadata"]["labels"].update(x="2"))
    sim.update_pod("default", "a", lambda p: p["metadata"].update(labels={"x": "1"}))
    assert [(e["type"], e["object"].metadata.name) for e in collector.take(2)] == [("DELETED", "b"), ("ADDED", "a")]
    collector.stop()


def test_watch_resumes_from_a_resource_version(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    sim.create_pod(pod_manifest("p0"))
    mark = sim.resource_version
    sim.create_pod(pod_manifest("p1"))
    sim.update_pod("default", "p0", lambda p: p["metadata"].setdefault("labels", {}).update(seen="yes"))
    collector = Collector(v1.list_namespaced_pod, "default", resource_version=str(mark), timeout_seconds=1)
    events = collector.take(2)
    assert [(e["type"], e["object"].metadata.name) for e in events] == [("ADDED", "p1"), ("MODIFIED", "p0")]
    assert collector.done.wait(5)  # timeoutSeconds ends the stream and Watch does not retry
    assert collector.error is None and collector.events.empty()


def test_watch_from_a_compacted_resource_version_gets_410(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    sim.create_pod(pod_manifest("p0"))
    old = sim.resource_version
    sim.create_pod(pod_manifest("p1"))
    sim.create_pod(pod_manifest("p2"))
    sim.compact(sim.resource_version)
    # raw: HTTP 200 and one ERROR event carrying a 410 Expired Status, as the real server does
    resp = v1.list_namespaced_pod("default", watch=True, resource_version=str(old), _preload_content=False)
    lines = [json.loads(line) for line in resp.read().decode().splitlines() if line]
    assert resp.status == 200 and len(lines) == 1 and lines[0]["type"] == "ERROR"
    assert lines[0]["object"]["code"] == 410 and lines[0]["object"]["reason"] == "Expired"
    assert "too old resource version" in lines[0]["object"]["message"]
    # kubernetes.watch raises ApiException(410) (after one silent retry when no timeout is set)
    for kwargs in ({"timeout_seconds": 5}, {}):
        with pytest.raises(ApiException) as gone:
            for _event in watch.Watch().stream(v1.list_namespaced_pod, "default", resource_version=str(old), **kwargs):
                pass
        assert gone.value.status == 410
    # the consumer recovers by listing again and watching from the list's resourceVersion
    fresh = v1.list_namespaced_pod("default")
    collector = Collector(v1.list_namespaced_pod, "default", resource_version=fresh.metadata.resource_version)
    assert sim.wait_for_watches(1)
    sim.create_pod(pod_manifest("p3"))
    assert collector.next()["object"].metadata.name == "p3"
    collector.stop()


def test_history_bound_expires_old_resource_versions() -> None:
    with ApiServerSimulator(history=3) as sim:
        v1 = client.CoreV1Api(sim.client())
        sim.create_pod(pod_manifest("p0"))
        start = sim.resource_version
        for i in range(1, 6):
            sim.create_pod(pod_manifest(f"p{i}"))
        with pytest.raises(ApiException) as gone:
            for _event in watch.Watch().stream(
                v1.list_namespaced_pod, "default", resource_version=str(start), timeout_seconds=2
            ):
                pass
        assert gone.value.status == 410
        recent = watch.Watch().stream(
            v1.list_namespaced_pod, "default", resource_version=str(sim.resource_version - 3), timeout_seconds=1
        )
        assert [e["object"].metadata.name for e in recent] == ["p3", "p4", "p5"]


def test_bookmarks_and_initial_events(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    sim.create_pod(pod_manifest("p0"))
    w = watch.Watch()
    seen: list[tuple[str, str]] = []
    for event in w.stream(
        v1.list_namespaced_pod,
        "default",
        allow_watch_bookmarks=True,
        send_initial_events=True,
        resource_version_match="NotOlderThan",
        timeout_seconds=5,
    ):
        rv = event["raw_object"]["metadata"]["resourceVersion"]
        seen.append((event["type"], rv))
        annotations = event["raw_object"]["metadata"].get("annotations") or {}
        if event["type"] == "BOOKMARK" and not annotations:
            w.stop()
    assert seen[0][0] == "ADDED"
    assert seen[1] == ("BOOKMARK", str(sim.resource_version))
    assert seen[-1][0] == "BOOKMARK" and len(seen) == 3
    assert w.resource_version == str(sim.resource_version)


def test_close_watches_makes_the_client_watch_again(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    sim.create_pod(pod_manifest("p0"))
    collector = Collector(v1.list_namespaced_pod, "default", resource_version=str(sim.resource_version))
    assert sim.wait_for_watches(1)
    sim.create_pod(pod_manifest("p1"))
    p1 = collector.next()["object"]
    assert p1.metadata.name == "p1"
    assert sim.close_watches() == 1
    sim.create_pod(pod_manifest("p2"))  # maybe while no watch is open: delivered after the re-watch
    assert collector.next()["object"].metadata.name == "p2"
    watches = [r for r in sim.requests if r.query.get("watch")]
    assert len(watches) == 2
    assert watches[1].query["resourceVersion"] == p1.metadata.resource_version  # resumed after p1
    collector.stop()
    deadline = time.monotonic() + 5
    while sim.watch_count() and time.monotonic() < deadline:  # the server notices the client left
        time.sleep(0.02)
    assert sim.watch_count() == 0
    # an abrupt close surfaces as a connection error in the consumer
    abrupt = Collector(v1.list_namespaced_pod, "default", resource_version=str(sim.resource_version))
    assert sim.wait_for_watches(1)
    sim.close_watches(abrupt=True)
    assert abrupt.done.wait(5)
    assert isinstance(abrupt.error, urllib3.exceptions.HTTPError)


def test_many_concurrent_watchers_see_every_change_in_order(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    start = sim.resource_version
    collectors = [Collector(v1.list_namespaced_pod, "default", resource_version=str(start)) for _ in range(4)]
    assert sim.wait_for_watches(4)

    def writer(prefix: str) -> None:
        api = client.CoreV1Api(sim.client())
        for i in range(10):
            api.create_namespaced_pod("default", pod_manifest(f"{prefix}-{i}"))

    writers = [threading.Thread(target=writer, args=(f"w{n}",)) for n in range(3)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    expected = list(range(start + 1, start + 31))
    for collector in collectors:
        rvs = [int(e["object"].metadata.resource_version) for e in collector.take(30)]
        assert rvs == expected
        collector.stop()


# --------------------------------------------------------------------------------------------
# nodes


def test_nodes_get_list_patch(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    sim.add_node("node-1", labels={"gpu": "true"}, capacity={VCORE: 800, VMEM: 1280})
    sim.add_node("node-2")
    node = v1.read_node("node-1")
    assert node.metadata.labels["kubernetes.io/hostname"] == "node-1"
    assert node.status.capacity[VCORE] == "800"
    assert [c.type for c in node.status.conditions if c.status == "True"] == ["Ready"]
    assert [n.metadata.name for n in v1.list_node(label_selector="gpu=true").items] == ["node-1"]
    assert [n.metadata.name for n in v1.list_node(field_selector="metadata.name=node-2").items] == ["node-2"]
    patched = v1.patch_node("node-1", {"metadata": {"labels": {"nvidia-device-enable": "enable", "gpu": None}}})
    assert patched.metadata.labels["nvidia-device-enable"] == "enable" and "gpu" not in patched.metadata.labels
    assert sim.get_node("node-1")["metadata"]["labels"]["nvidia-device-enable"] == "enable"  # type: ignore[index]
    status = v1.patch_node_status("node-1", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    assert {c.type: c.status for c in status.status.conditions}["Ready"] == "False"
    assert len(status.status.conditions) == 4
    created = v1.create_node({"metadata": {"name": "node-3"}})
    assert created.metadata.uid
    with pytest.raises(ApiException) as missing:
        v1.read_node("node-9")
    assert missing.value.status == 404


# --------------------------------------------------------------------------------------------
# faults


def test_down_503_and_back(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    sim.create_pod(pod_manifest("p0"))
    sim.set_down(True)
    with pytest.raises(ApiException) as down:
        v1.list_namespaced_pod("default")
    assert down.value.status == 503 and status_of(down.value)["reason"] == "ServiceUnavailable"
    sim.set_down(False)
    assert len(v1.list_namespaced_pod("default").items) == 1


def test_down_refuse_and_back_on_the_same_port(sim: ApiServerSimulator) -> None:
    v1 = client.CoreV1Api(sim.client(retries=False))
    sim.create_pod(pod_manifest("p0"))
    port = sim.port
    collector = Collector(v1.list_namespaced_pod, "default", resource_version=str(sim.resource_version))
    assert sim.wait_for_watches(1)
    sim.set_down(True, mode="refuse")
    with pytest.raises(urllib3.exceptions.HTTPError):
        v1.list_namespaced_pod("default", _request_timeout=2)
    assert collector.done.wait(5) and collector.error is not None
    sim.set_down(False)
    assert sim.port == port
    assert len(v1.list_namespaced_pod("default").items) == 1


def test_fail_next_and_delay(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    sim.create_pod(pod_manifest("p0"))
    sim.fail_next("PATCH", r"/pods/p0$", status=409, count=2)
    for _ in range(2):
        with pytest.raises(ApiException) as conflict:
            v1.patch_namespaced_pod("p0", "default", {"metadata": {"labels": {"a": "b"}}})
        assert conflict.value.status == 409
    assert v1.patch_namespaced_pod("p0", "default", {"metadata": {"labels": {"a": "b"}}}).metadata.labels == {"a": "b"}
    sim.fail_next(None, r"/api/v1/pods", status=500)
    with pytest.raises(ApiException) as internal:
        v1.list_pod_for_all_namespaces()
    assert internal.value.status == 500 and status_of(internal.value)["reason"] == "InternalError"
    assert [r.status for r in sim.requests[-4:]] == [409, 409, 200, 500]
    sim.delay(r"/namespaces/default/pods$", 3.0)
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        client.CoreV1Api(sim.client(retries=False)).list_namespaced_pod("default", _request_timeout=0.2)
    sim.delay(r"/namespaces/default/pods$", 0)
    assert len(v1.list_namespaced_pod("default").items) == 1


def test_direct_helpers_and_request_log(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    created = sim.create_pod(pod_manifest("p0", phase="Running", uid="u-1"))
    assert created["status"]["phase"] == "Running" and created["metadata"]["uid"] == "u-1"
    rv = sim.resource_version
    touched = sim.update_pod("default", "p0", lambda p: None)
    assert int(touched["metadata"]["resourceVersion"]) == rv + 1
    sim.set_pod_phase("default", "p0", "Failed", reason="Evicted")
    assert v1.read_namespaced_pod("p0", "default").status.reason == "Evicted"
    assert [p["metadata"]["name"] for p in sim.pods()] == ["p0"] and sim.pods("other") == []
    assert sim.delete_pod("default", "p0") is not None and sim.delete_pod("default", "p0") is None
    last = sim.requests[-1]
    assert (last.method, last.path, last.status) == ("GET", "/api/v1/namespaces/default/pods/p0", 200)
    with pytest.raises(ApiError) as missing:
        sim.update_pod("default", "p0", lambda p: None)
    assert missing.value.code == 404


def test_stop_is_idempotent_and_url_needs_start() -> None:
    sim = ApiServerSimulator()
    with pytest.raises(RuntimeError):
        _ = sim.url
    sim.start()
    url = sim.url
    sim.stop()
    sim.stop()
    with pytest.raises(urllib3.exceptions.HTTPError):
        urllib3.PoolManager(retries=False).request("GET", url + "/healthz", timeout=1)


# --------------------------------------------------------------------------------------------
# the pure parts


def test_merge_patch_rfc7386_examples() -> None:
    assert merge_patch({"a": "b"}, {"a": "c"}) == {"a": "c"}
    assert merge_patch({"a": "b"}, {"b": "c"}) == {"a": "b", "b": "c"}
    assert merge_patch({"a": "b"}, {"a": None}) == {}
    assert merge_patch({"a": [{"b": "c"}]}, {"a": [1]}) == {"a": [1]}
    assert merge_patch({"e": None}, {"a": 1}) == {"e": None, "a": 1}
    assert merge_patch([1, 2], {"a": "b", "c": None}) == {"a": "b"}
    assert merge_patch({}, {"a": {"bb": {"ccc": None}}}) == {"a": {"bb": {}}}


def test_json_patch_rfc6902_operations() -> None:
    doc = {"foo": ["bar", "baz"], "q": {"x": 1}}
    out = json_patch(
        doc,
        [
            {"op": "add", "path": "/foo/1", "value": "qux"},
            {"op": "add", "path": "/foo/-", "value": "end"},
            {"op": "remove", "path": "/q/x"},
            {"op": "replace", "path": "/foo/0", "value": "BAR"},
            {"op": "copy", "from": "/foo/0", "path": "/q/copied"},
            {"op": "move", "from": "/foo/3", "path": "/moved"},
            {"op": "test", "path": "/moved", "value": "end"},
        ],
    )
    assert out == {"foo": ["BAR", "qux", "baz"], "q": {"copied": "BAR"}, "moved": "end"}
    assert doc == {"foo": ["bar", "baz"], "q": {"x": 1}}
    for bad in ([{"op": "remove", "path": "/nope"}], [{"op": "replace", "path": "/foo/9", "value": 1}]):
        with pytest.raises(PatchError):
            json_patch(doc, bad)


def test_strategic_merge_patch_lists() -> None:
    pod = {
        "metadata": {"finalizers": ["a"]},
        "spec": {"containers": [{"name": "c0", "image": "i0", "env": [{"name": "A", "value": "1"}]}, {"name": "c1"}]},
        "status": {"conditions": [{"type": "Ready", "status": "False"}]},
    }
    patch = {
        "metadata": {"finalizers": ["b"], "$deleteFromPrimitiveList/finalizers": ["a"]},
        "spec": {
            "$setElementOrder/containers": [{"name": "c0"}, {"name": "c1"}],
            "containers": [{"name": "c0", "env": [{"name": "B", "value": "2"}]}, {"name": "c1", "$patch": "delete"}],
        },
        "status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Initialized", "status": "True"}]},
    }
    out = strategic_merge_patch(pod, patch, POD_MERGE_KEYS)
    assert out["metadata"]["finalizers"] == ["b"]
    assert out["spec"]["containers"] == [
        {"name": "c0", "image": "i0", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]}
    ]
    assert out["status"]["conditions"] == [
        {"type": "Ready", "status": "True"},
        {"type": "Initialized", "status": "True"},
    ]
    replaced = strategic_merge_patch(
        pod, {"spec": {"containers": [{"name": "x"}, {"$patch": "replace"}]}}, POD_MERGE_KEYS
    )
    assert replaced["spec"]["containers"] == [{"name": "x"}]
    node = {"status": {"addresses": [{"type": "InternalIP", "address": "1"}]}}
    merged = strategic_merge_patch(
        node, {"status": {"addresses": [{"type": "Hostname", "address": "h"}]}}, NODE_MERGE_KEYS
    )
    assert len(merged["status"]["addresses"]) == 2


def test_label_selector_parser() -> None:
    sel = parse_label_selector("a in (1, 2), b notin (3), c, !d, e!=4, f>5")
    assert sel.matches({"a": "1", "c": "", "f": "6"})
    assert not sel.matches({"a": "1", "c": "", "f": "5"})
    assert not sel.matches({"a": "3", "c": "", "f": "6"})
    assert not sel.matches({"a": "1", "c": "", "d": "", "f": "6"})
    for bad in ("a in ()", "a=b=c", "=x", "a in (x", "-a=b"):
        with pytest.raises(ApiError):
            parse_label_selector(bad)


def test_requests_log_records_query_and_timing_free_fields(sim: ApiServerSimulator, v1: client.CoreV1Api) -> None:
    v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=node-1", label_selector="a=b")
    record = sim.requests[-1]
    assert record.query == {"fieldSelector": "spec.nodeName=node-1", "labelSelector": "a=b"}
    assert record.method == "GET" and record.status == 200
    assert time.monotonic() >= record.time
