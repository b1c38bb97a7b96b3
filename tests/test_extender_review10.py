"""The extender as the kube-scheduler (and several of its replicas) use it: a pod no node can hold stays
Pending with every node failed for a reason naming the node; odd requests and odd objects get an answer
naming them."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from gpumanager.extender import claims, service
from gpumanager.extender.nodes import Charge
from tests.extender_fixtures import BLOCK, World, gpu_pod, held, http_error, inventory, wait_for, world

__all__ = ["world"]


def _note(world: World, node: str, uid: str, pod: str) -> None:
    """Record on ``node`` the choice of another replica's bind (60 cores, 4 blocks on GPU 0) for ``pod``."""
    claim = claims.Claim(pod, time.time(), "1", (Charge(0, 60, 4 * BLOCK),))

    def change(obj: dict[str, Any]) -> None:
        obj["metadata"].setdefault("annotations", {})[claims.ANNOTATION] = claims.encode_claims({uid: claim})

    world.api.update_node(node, change)


def _passed(answer: dict[str, Any]) -> list[str]:
    return sorted(n["metadata"]["name"] for n in (answer["Nodes"] or {}).get("items") or [])


def _node_name_of(world: World, pod: dict[str, Any]) -> str:
    found = world.api.get_pod("default", pod["metadata"]["name"])
    assert found is not None
    return str(found["spec"].get("nodeName") or "")


def test_no_node_has_room_counting_recorded_choices_every_node_fails_and_the_pod_stays_pending(
    world: World,
) -> None:
    """Every candidate is filled by choices another replica's binds recorded (its pod watch lags): filter
    passed them all, so the scheduler went on to bind a pod that no node could hold."""
    for node in ("full", "also-full"):
        world.add_node(node, inventory([16]), gpus=1, memory_gib=16)
    ext = world.start_extender()
    y = world.create(gpu_pod("y", [(60, 4)]))
    _note(world, "full", "uid-x1", "default/x1")
    _note(world, "also-full", "uid-x2", "default/x2")
    wait_for(lambda: bool(ext.state.node_claims("full")) and bool(ext.state.node_claims("also-full")), what="records")
    answer = world.filter(y)
    assert answer["Error"] == ""
    assert _passed(answer) == [], answer
    failed = answer["FailedNodes"]
    assert set(failed) == {"full", "also-full"}, answer
    assert "counting the choices binds recorded on the node" in failed["full"] and "needs 60 cores" in failed["full"]
    assert failed["also-full"] == failed["full"]  # one reason, which the scheduler folds
    assert answer["FailedAndUnresolvableNodes"] == {}  # preempting, or the record ending, may make room
    names_only = world.post("filter", {"Pod": y, "NodeNames": ["full", "also-full"]})
    assert names_only["NodeNames"] == [] and set(names_only["FailedNodes"]) == {"full", "also-full"}
    # A scheduler that binds anyway is refused, and the pod stays Pending.
    assert "no longer fits" in world.bind(y, "full")
    assert _node_name_of(world, y) == ""
    # Nothing of the refused bind is left: no annotations on the pod, no record on the node, nothing assumed.
    assert not [k for k in world.annotations(y) if k.startswith("tencent.com/")], world.annotations(y)
    full = next(n for n in world.api.nodes() if n["metadata"]["name"] == "full")
    assert "uid-y" not in claims.parse_claims(full)
    assert ext.state.assumed_count() == 0 and ext.state.over_committed() == {}


def test_every_failed_node_gets_a_reason(world: World) -> None:
    """Every candidate that fails has a reason (the node is its key; the reason does not name it, so
    that the scheduler folds equal reasons: "2 container 'c0' needs...")."""
    for node in ("n1", "n2"):
        world.add_node(node, inventory([80]), gpus=1)
        world.create(gpu_pod(f"on-{node}", [(100, 0)], node=node, annotations=held(node, [[0]]), phase="Running"))
    world.add_node("cpu", None, gpus=0)
    world.start_extender()
    world.wait_seen(2)
    pod = world.create(gpu_pod("a", [(100, 0)]))
    answer = world.filter(pod)
    assert _passed(answer) == []
    reasons = {**answer["FailedNodes"], **answer["FailedAndUnresolvableNodes"]}
    assert set(reasons) == {"n1", "n2", "cpu"}, answer
    for node, reason in reasons.items():
        assert reason and node not in reason, (node, reason)
    assert "needs 1 whole GPU(s)" in answer["FailedNodes"]["n1"]
    odd = world.create(gpu_pod("odd", [(150, 0)]))
    for node, reason in world.filter(odd, ["n1", "n2"])["FailedAndUnresolvableNodes"].items():
        assert "150 tencent.com/vcuda-core" in reason and node not in reason, reason
    assert "no longer fits" in world.bind(pod, "n1")
    assert _node_name_of(world, pod) == ""


def test_a_node_object_or_name_without_a_name_is_refused_naming_its_place(world: World) -> None:
    """A Node object without ``metadata.name`` was judged as a node called "" (and answered as one)."""
    world.add_node("n1", inventory([80]), gpus=1)
    world.start_extender()
    pod = world.create(gpu_pod("a", [(50, 4)]))
    node = world.api.nodes()[0]
    for verb in ("filter", "prioritize"):
        for body, where in (
            ({"Pod": pod, "Nodes": {"items": [node, {"metadata": {}}]}}, "ExtenderArgs.Nodes.items[1]"),
            ({"Pod": pod, "Nodes": {"items": [{"metadata": {"name": ""}}]}}, "ExtenderArgs.Nodes.items[0]"),
            ({"Pod": pod, "NodeNames": ["n1", ""]}, "ExtenderArgs.NodeNames[1]"),
        ):
            status, answer = http_error(world, verb, json.dumps(body).encode())
            assert status == 400, (verb, body, answer)
            assert where in answer["Error"] and "name" in answer["Error"], answer


def test_a_record_that_lapsed_is_taken_off_the_node_so_a_pending_pod_is_tried_again(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record left by a replica that died mid-bind fails the node until it lapses; the lapse itself
    changed nothing in the cluster, so a pod failed on it waited for an unrelated event (the
    scheduler: up to 5 minutes). The extender now takes lapsed records off the node (a Node update,
    which sends unschedulable pods back to the queue)."""
    monkeypatch.setattr(claims, "CLAIM_TTL", 1.0)
    monkeypatch.setattr(service, "SWEEP_EVERY", 0.2)
    world.add_node("full", inventory([16]), gpus=1, memory_gib=16)
    ext = world.start_extender()
    y = world.create(gpu_pod("y", [(60, 4)]))
    _note(world, "full", "uid-dead", "default/dead")
    wait_for(lambda: bool(ext.state.node_claims("full")), what="the record shown")
    assert "counting the choices binds recorded on the node" in world.filter(y)["FailedNodes"]["full"]

    def record() -> str:
        return str(world.api.nodes()[0]["metadata"].get("annotations", {}).get(claims.ANNOTATION, ""))

    wait_for(lambda: "uid-dead" not in record(), timeout=5, what="the lapsed record taken off the node")
    assert _passed(world.filter(y)) == ["full"]
    assert world.bind(y, "full") == ""


def test_a_live_record_is_not_taken_off_the_node(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "SWEEP_EVERY", 0.1)
    world.add_node("full", inventory([16]), gpus=1, memory_gib=16)
    ext = world.start_extender()
    _note(world, "full", "uid-live", "default/live")
    wait_for(lambda: bool(ext.state.node_claims("full")), what="the record shown")
    time.sleep(0.6)
    assert "uid-live" in world.api.nodes()[0]["metadata"]["annotations"][claims.ANNOTATION]
