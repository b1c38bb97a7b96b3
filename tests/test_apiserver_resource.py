"""The API-server simulator's resource.k8s.io/v1 kinds, through the real kubernetes client."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import watch as k8s_watch
from kubernetes.client.rest import ApiException

from simnode.apiserver import ApiServerSimulator

GiB = 1 << 30


@pytest.fixture
def api() -> Iterator[Any]:
    with ApiServerSimulator() as sim:
        yield k8s.ResourceV1Api(sim.client())


def slice_body(name: str = "node-a-vcuda", node: str = "node-a", **device: Any) -> dict[str, Any]:
    dev = {
        "name": "gpu-0",
        "allowMultipleAllocations": True,
        "attributes": {"index": {"int": 0}, "uuid": {"string": "GPU-0"}},
        "capacity": {
            "cores": {
                "value": "100",
                "requestPolicy": {"default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}},
            },
            "memory": {
                "value": "81920Mi",
                "requestPolicy": {
                    "default": "81920Mi",
                    "validRange": {"min": "256Mi", "max": "81920Mi", "step": "256Mi"},
                },
            },
        },
    }
    dev.update(device)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": "vcuda.tencent.com",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [dev],
        },
    }


def raw(resp: Any) -> dict[str, Any]:
    return dict(json.loads(resp.data))


def test_slice_quantities_come_back_canonical(api: Any) -> None:
    created = api.create_resource_slice(slice_body())
    assert created.spec.devices[0].capacity["memory"].value == "80Gi"
    assert created.spec.devices[0].capacity["memory"].request_policy.default == "80Gi"
    read = raw(api.read_resource_slice("node-a-vcuda", _preload_content=False))
    assert read["apiVersion"] == "resource.k8s.io/v1" and read["kind"] == "ResourceSlice"
    assert read["spec"]["devices"][0]["capacity"]["cores"]["value"] == "100"


def test_slice_off_step_default_is_refused(api: Any) -> None:
    body = slice_body()
    policy = body["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]
    policy["default"] = "81559Mi"
    with pytest.raises(ApiException) as err:
        api.create_resource_slice(body)
    assert err.value.status == 422
    assert "requestPolicy.default" in err.value.body and "multiple of step" in err.value.body


def test_slice_policy_needs_multiple_allocations_and_taint_values_are_label_values(api: Any) -> None:
    with pytest.raises(ApiException) as err:
        api.create_resource_slice(slice_body(allowMultipleAllocations=False))
    assert err.value.status == 422 and "allowMultipleAllocations" in err.value.body
    bad = slice_body(taints=[{"key": "vcuda.tencent.com/xid", "value": "XID 79", "effect": "NoSchedule"}])
    with pytest.raises(ApiException) as err:
        api.create_resource_slice(bad)
    assert err.value.status == 422 and "taints[0].value" in err.value.body
    good = slice_body(taints=[{"key": "vcuda.tencent.com/xid", "value": "xid-79", "effect": "NoSchedule"}])
    assert api.create_resource_slice(good).spec.devices[0].taints[0].value == "xid-79"


def test_slice_field_selectors_are_limited(api: Any) -> None:
    api.create_resource_slice(slice_body())
    api.create_resource_slice(slice_body("node-b-vcuda", "node-b"))
    mine = api.list_resource_slice(field_selector="spec.nodeName=node-a,spec.driver=vcuda.tencent.com")
    assert [s.metadata.name for s in mine.items] == ["node-a-vcuda"]
    with pytest.raises(ApiException) as err:
        api.list_resource_slice(field_selector="spec.pool.name=node-a")
    assert err.value.status == 400


def test_claim_defaults_status_and_immutable_spec(api: Any) -> None:
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "share", "namespace": "ml"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "vcuda.tencent.com",
                            "capacity": {"requests": {"cores": "30", "memory": "4096Mi"}},
                        },
                    }
                ]
            }
        },
    }
    created = raw(api.create_namespaced_resource_claim("ml", claim, _preload_content=False))
    exactly = created["spec"]["devices"]["requests"][0]["exactly"]
    assert exactly["count"] == 1 and exactly["allocationMode"] == "ExactCount"
    assert exactly["capacity"]["requests"]["memory"] == "4Gi"
    status = {
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": "vcuda.tencent.com",
                            "pool": "node-a",
                            "device": "gpu-0",
                            "shareID": "4f1e0c1c-0000-4000-8000-000000000001",
                            "consumedCapacity": {"cores": "30", "memory": "4096Mi"},
                        }
                    ]
                }
            },
            "reservedFor": [{"resource": "pods", "name": "p", "uid": "u1"}],
        }
    }
    patched = api.patch_namespaced_resource_claim_status("share", "ml", status)
    result = patched.status.allocation.devices.results[0]
    assert result.share_id.endswith("0001") and result.consumed_capacity["memory"] == "4Gi"
    # A spec change is refused; a status change on the main resource is ignored.
    with pytest.raises(ApiException) as err:
        api.patch_namespaced_resource_claim(
            "share", "ml", {"spec": {"devices": {"requests": [{"name": "other", "exactly": {"deviceClassName": "x"}}]}}}
        )
    assert err.value.status == 422 and "immutable" in err.value.body
    moved = json.loads(json.dumps(status))
    moved["status"]["allocation"]["devices"]["results"][0]["device"] = "gpu-1"
    with pytest.raises(ApiException) as err:
        api.patch_namespaced_resource_claim_status("share", "ml", moved)
    assert err.value.status == 422
    cleared = api.patch_namespaced_resource_claim_status(
        "share", "ml", [{"op": "remove", "path": "/status/allocation"}]
    )
    assert cleared.status.allocation is None


def test_templates_and_classes_and_watch(api: Any) -> None:
    api.create_device_class(
        {
            "metadata": {"name": "vcuda.tencent.com"},
            "spec": {"selectors": [{"cel": {"expression": 'device.driver == "vcuda.tencent.com"'}}]},
        }
    )
    assert api.read_device_class("vcuda.tencent.com").spec.selectors[0].cel.expression.startswith("device.driver")
    api.create_namespaced_resource_claim_template(
        "ml",
        {
            "metadata": {"name": "one-gpu"},
            "spec": {
                "spec": {
                    "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "vcuda.tencent.com"}}]}
                }
            },
        },
    )
    got = api.read_namespaced_resource_claim_template("one-gpu", "ml")
    assert got.spec.spec.devices.requests[0].exactly.count == 1
    events: list[tuple[str, str]] = []
    w = k8s_watch.Watch()
    # From the list's version: the create and delete below may come before the watch is open.
    since = api.list_resource_slice().metadata.resource_version

    def watch() -> None:
        for ev in w.stream(api.list_resource_slice, resource_version=since, timeout_seconds=5):
            events.append((ev["type"], ev["object"].metadata.name))
            if ev["type"] == "DELETED":
                w.stop()

    t = threading.Thread(target=watch)
    t.start()
    api.create_resource_slice(slice_body())
    deleted = api.delete_resource_slice("node-a-vcuda")
    assert deleted.metadata.name == "node-a-vcuda"
    t.join(10)
    assert events == [("ADDED", "node-a-vcuda"), ("DELETED", "node-a-vcuda")]


def test_discovery_lists_the_group(api: Any) -> None:
    groups = k8s.ApisApi(api.api_client).get_api_versions()
    assert [g.name for g in groups.groups] == ["resource.k8s.io"]
    resources = api.get_api_resources()
    assert {"deviceclasses", "resourceslices", "resourceclaims", "resourceclaims/status", "resourceclaimtemplates"} <= {
        r.name for r in resources.resources
    }
