"""The extender against late Bindings, odd annotations and odd objects: no GPU counted free that a pod holds,
and a clear answer instead of a failed call."""

from __future__ import annotations

import http.client
import json
import time
from typing import Any

from gpumanager import names
from gpumanager.extender.charges import pod_charges
from tests.extender_fixtures import PREFIX, World, gpu_pod, held, inventory, wait_for, world

__all__ = ["world"]


def test_a_pod_whose_binding_got_no_answer_is_not_bound_elsewhere_meanwhile(world: World) -> None:
    """A Binding the API server makes after the bind gave up: the scheduler's retry of the pod on another
    node let the first node's GPU go, and a whole-GPU pod was then bound beside the share there."""
    for node in ("n1", "n2"):
        world.add_node(node, inventory([80]), gpus=1)
    world.start_extender(bind_timeout=1.0)
    share = world.create(gpu_pod("a", [(60, 4)]))
    whole = world.create(gpu_pod("c", [(100, 0)]))
    world.wait_seen(0)
    world.api.delay(r"/binding$", 1.6, method="POST", count=2)  # slow to make Bindings
    assert "may still be made" in world.bind(share, "n1")
    retry = world.bind(share, "n2")
    assert "earlier Binding to node n1" in retry, retry

    def bound_to_n1() -> bool:
        return bool((world.api.get_pod("default", "a") or {}).get("spec", {}).get("nodeName") == "n1")

    wait_for(bound_to_n1, what="the late Binding")
    time.sleep(0.3)  # the watch shows it
    assert "no longer fits" in world.bind(whole, "n1")
    on_n1 = [p["metadata"]["name"] for p in world.api.pods() if p["spec"].get("nodeName") == "n1"]
    assert on_n1 == ["a"]


def _bound(annotations: dict[str, str], cores: int, *, node: str = "n1") -> dict[str, Any]:
    pod = gpu_pod("p", [(cores, 0 if cores >= 100 else 4)], node=node, annotations=annotations)
    return pod


def test_an_index_annotation_naming_too_few_gpus_is_not_taken_as_the_whole_charge() -> None:
    for value in ("0", "0,0"):
        charges = pod_charges(_bound(held("n1", [[0]]) | {f"{PREFIX}0": value}, 200))
        assert charges is not None and charges.charges == () and charges.unplaced == 1, (value, charges)


def test_a_pod_bound_elsewhere_than_chosen_counts_where_its_agent_annotated_it() -> None:
    """The agent of the node a pod is bound to writes the GPUs it chose and gpu-assigned=true; they are
    that node's, whatever predicate-node says (a Binding made after a bind to another node gave up)."""
    annotations = {f"{PREFIX}0": "0", names.PREDICATE_NODE: "n2", names.PREDICATE_TIME: "1"}
    before = pod_charges(_bound(annotations | {names.GPU_ASSIGNED: "false"}, 60))
    assert before is not None and before.node == "n1" and before.charges == () and before.unplaced == 1
    after = pod_charges(_bound(annotations | {names.GPU_ASSIGNED: "true"}, 60))
    assert after is not None and after.node == "n1" and [c.minor for c in after.charges] == [0]


def _post(world: World, verb: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", world.extender.server.port, timeout=10)
    try:
        conn.request("POST", f"/scheduler/{verb}", body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_pod_and_node_objects_of_the_wrong_shape_get_an_answer_naming_the_pod(world: World) -> None:
    world.add_node("n1", inventory([80]), gpus=1)
    world.start_extender()
    pod = gpu_pod("odd", [(30, 4)])
    pod["spec"]["containers"] = "not a list"
    node = {"metadata": {"name": "n9"}, "status": "not an object"}
    for verb, body in (
        ("filter", {"Pod": pod, "Nodes": {"items": [node]}, "NodeNames": None}),
        ("prioritize", {"Pod": pod, "Nodes": {"items": [node]}, "NodeNames": None}),
    ):
        status, raw = _post(world, verb, json.dumps(body).encode(), {"Content-Type": "application/json"})
        assert status == 200, (verb, status, raw)
        answer = json.loads(raw)
        if verb == "filter":
            assert "default/odd" in answer["Error"], answer
        else:
            assert answer == [{"Host": "n9", "Score": 0}]


def test_an_inventory_nested_too_deeply_falls_back_and_later_changes_are_seen(world: World) -> None:
    world.api.add_node(
        "n1",
        capacity={names.VCORE_RESOURCE: "200", names.VMEMORY_RESOURCE: "640"},
        annotations={"tencent.com/gpu-inventory": "[" * 100_000 + "]" * 100_000},
    )
    world.start_extender()
    wait_for(lambda: world.extender.state.node("n1") is not None, what="node n1 from its capacity")
    node = world.extender.state.node("n1")
    assert node is not None and node.gpu_count == 2


def test_a_chunked_body_is_refused_by_name(world: World) -> None:
    world.start_extender()
    body = json.dumps({"Pod": gpu_pod("a", [(30, 4)]), "Nodes": None, "NodeNames": []}).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    status, raw = _post(world, "filter", chunked, {"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    assert status == 400 and b"Transfer-Encoding" in raw, raw
