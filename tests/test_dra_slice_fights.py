"""The node's ResourceSlice against other writers: whoever changes or deletes it, the agent puts its
own content back with a newer pool generation; stale slices of the node in our pool go; other
drivers' slices stay; and a settled slice is not rewritten (quantities compared by value)."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

from simnode.dra_cluster import DRIVER, NODE
from tests.dra_claim_fixtures import DRAClient, dra_node

__all__ = ["dra_node"]

JSON = dict[str, Any]
NAME = f"{NODE}-{DRIVER}"


def _slices(node: DRAClient) -> list[JSON]:
    data = node.cluster.resource.list_resource_slice(
        field_selector=f"spec.nodeName={NODE}", _preload_content=False
    ).data
    return list(json.loads(data)["items"])


def _ours(node: DRAClient) -> JSON | None:
    return next((s for s in _slices(node) if s["metadata"]["name"] == NAME), None)


def _wait(node: DRAClient, predicate: Any, timeout: float = 20.0) -> JSON:
    deadline = time.monotonic() + timeout
    current = None
    while time.monotonic() < deadline:
        current = _ours(node)
        if current is not None and predicate(current):
            return current
        time.sleep(0.05)
    raise TimeoutError(f"our slice never met the condition; last: {json.dumps(current)[:1500]}")


def _devices(s: JSON) -> list[str]:
    return [d["name"] for d in s["spec"]["devices"]]


def _memory(s: JSON) -> str:
    return str(s["spec"]["devices"][0]["capacity"]["memory"]["value"])


def test_a_slice_another_writer_changes_is_put_back_with_a_newer_generation(dra_node: DRAClient) -> None:
    api = dra_node.cluster.resource
    original = _wait(dra_node, lambda s: True)
    changed = copy.deepcopy(original)
    changed["spec"]["devices"][0]["capacity"]["memory"]["value"] = "1Gi"
    changed["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"] = {
        "default": "1Gi",
        "validRange": {"min": "256Mi", "max": "1Gi", "step": "256Mi"},
    }
    changed["spec"]["pool"]["generation"] = original["spec"]["pool"]["generation"] + 5
    api.replace_resource_slice(NAME, changed, _preload_content=False)
    restored = _wait(dra_node, lambda s: _memory(s) == _memory(original))
    assert restored["spec"]["pool"]["generation"] > changed["spec"]["pool"]["generation"]
    assert _devices(restored) == _devices(original)


def test_a_deleted_slice_is_published_again(dra_node: DRAClient) -> None:
    api = dra_node.cluster.resource
    original = _wait(dra_node, lambda s: True)
    api.delete_resource_slice(NAME, _preload_content=False)
    again = _wait(dra_node, lambda s: s["metadata"]["uid"] != original["metadata"]["uid"])
    assert _devices(again) == _devices(original)
    assert again["spec"]["pool"]["generation"] > original["spec"]["pool"]["generation"]


def test_stale_slices_of_our_pool_go_and_other_drivers_stay(dra_node: DRAClient) -> None:
    c = dra_node.cluster
    api = c.resource
    original = _wait(dra_node, lambda s: True)
    stale = copy.deepcopy(original)
    stale["metadata"] = {"name": f"{NODE}-old-{DRIVER}"}
    stale["spec"]["pool"]["generation"] = 40
    foreign = copy.deepcopy(original)
    foreign["metadata"] = {"name": f"{NODE}-gpu.example.com"}
    foreign["spec"]["driver"] = "gpu.example.com"
    foreign["spec"]["pool"] = {"name": NODE, "generation": 3, "resourceSliceCount": 1}
    assert c.agent is not None
    c.agent.stop()
    api.create_resource_slice(stale, _preload_content=False)
    api.create_resource_slice(foreign, _preload_content=False)
    c.start_agent(wait=False)
    assert c.kubelet is not None
    c.kubelet.wait_registered(DRIVER, after=c.kubelet.registrations(DRIVER), timeout=30)
    deadline = time.monotonic() + 20
    while any(s["metadata"]["name"] == stale["metadata"]["name"] for s in _slices(dra_node)):
        assert time.monotonic() < deadline, "the stale slice of our pool is still there"
        time.sleep(0.1)
    ours = _wait(dra_node, lambda s: True)
    # The scheduler takes the newest generation of a pool: ours must be newer than the stale one.
    assert ours["spec"]["pool"]["generation"] > 40
    names = {s["metadata"]["name"] for s in _slices(dra_node)}
    assert foreign["metadata"]["name"] in names, "another driver's slice of this node was deleted"


def test_a_settled_slice_is_not_rewritten(dra_node: DRAClient) -> None:
    first = _wait(dra_node, lambda s: True)
    time.sleep(3.0)
    later = _ours(dra_node)
    assert later is not None
    assert later["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
