"""The extender against inputs a kube-scheduler (or a tool written for gpu-admission) sends."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from typing import Any

import pytest

from gpumanager.extender.api import BadRequestError, encode, filter_result, parse_args, parse_binding
from gpumanager.extender.charges import PodCharges
from gpumanager.extender.decisions import Decider
from gpumanager.extender.metrics import ExtenderMetrics
from gpumanager.extender.nodes import Charge
from gpumanager.extender.server import ExtenderServer, Routes
from gpumanager.extender.state import ClusterState

POD = {
    "metadata": {"name": "p", "namespace": "d", "uid": "u1"},
    "spec": {
        "containers": [
            {"name": "c", "resources": {"limits": {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "4"}}}
        ]
    },
}


def _body(value: object) -> bytes:
    return json.dumps(value).encode()


# Go's encoding/json matches keys case-insensitively: gpu-admission took the v1 types' tags
# ("pod", "nodes", "nodenames") as well as the Go field names the kube-scheduler sends.


def test_filter_args_with_the_v1_types_lowercase_keys_name_nodes() -> None:
    args = parse_args(_body({"pod": POD, "nodes": None, "nodenames": ["a", "b"]}))
    assert args.pod == POD
    assert args.names == ["a", "b"]
    assert filter_result(args, ["b"], {"a": "full"}, {})["NodeNames"] == ["b"]


def test_filter_args_with_lowercase_nodes_answer_with_the_node_objects() -> None:
    node = {"metadata": {"name": "a", "labels": {"x": "y"}}}
    args = parse_args(_body({"pod": POD, "nodes": {"items": [node]}}))
    assert args.node_names is None
    assert args.names == ["a"]
    result = json.loads(encode(filter_result(args, ["a"], {}, {})))
    assert result["NodeNames"] is None
    assert result["Nodes"]["items"] == [node]


def test_filter_args_keys_in_any_case_last_one_wins_as_in_go() -> None:
    args = parse_args(_body({"POD": POD, "NodeNames": ["a"], "nodeNames": ["b"]}))
    assert args.pod == POD
    assert args.names == ["b"]


def test_filter_args_without_a_pod_are_refused_by_name() -> None:
    with pytest.raises(BadRequestError, match="Pod"):
        parse_args(_body({"nodenames": ["a"]}))
    with pytest.raises(BadRequestError, match="Pod"):
        parse_args(_body({"Pod": None, "NodeNames": ["a"]}))
    with pytest.raises(BadRequestError, match=r"Pod.*object"):
        parse_args(_body({"Pod": [1], "NodeNames": ["a"]}))
    with pytest.raises(BadRequestError, match="NodeNames"):
        parse_args(_body({"Pod": POD, "nodenames": [1]}))


def test_binding_args_with_lowercase_keys() -> None:
    args = parse_binding(_body({"podName": "p", "podNamespace": "d", "podUID": "u", "node": "n"}))
    assert (args.pod_name, args.pod_namespace, args.pod_uid, args.node) == ("p", "d", "u", "n")
    with pytest.raises(BadRequestError, match="PodName"):
        parse_binding(_body({"PodNamespace": "d", "PodUID": "u", "Node": "n"}))
    with pytest.raises(BadRequestError, match="PodUID"):
        parse_binding(_body({"PodName": "p", "PodNamespace": "d", "Node": "n"}))
    with pytest.raises(BadRequestError, match="Node"):
        parse_binding(_body({"PodName": "p", "PodNamespace": "d", "PodUID": "u", "node": 5}))


# -- a node the watch has shown deleted, sent again by a scheduler whose cache lags -----------------


def _node(name: str, uid: str, gpus: int = 1) -> dict[str, object]:
    return {
        "metadata": {"name": name, "uid": uid},
        "status": {"capacity": {"tencent.com/vcuda-core": str(100 * gpus), "tencent.com/vcuda-memory": str(64 * gpus)}},
    }


def _filter(decider: Decider, nodes: list[dict[str, object]]) -> dict[str, Any]:
    args = parse_args(_body({"Pod": POD, "Nodes": {"items": nodes}, "NodeNames": None}))
    result, _ = decider.filter(args)
    answer: dict[str, Any] = json.loads(encode(result))
    return answer


def test_a_deleted_node_sent_by_a_lagging_scheduler_is_not_brought_back() -> None:
    state = ClusterState()
    decider = Decider(state, "binpack")
    old = _node("a", "uid-old")
    state.node_event("ADDED", old)
    state.node_event("ADDED", _node("b", "uid-b"))
    state.node_event("DELETED", old)
    assert state.node_names() == ["b"]

    answer = _filter(decider, [old, _node("b", "uid-b")])
    assert [n["metadata"]["name"] for n in answer["Nodes"]["items"]] == ["b"]
    reason = answer["FailedAndUnresolvableNodes"]["a"]
    assert "has been deleted" in reason, reason
    # Not kept: the nodes the extender counts (gpu_extender_nodes) are the cluster's.
    assert state.node_names() == ["b"]
    # Prioritize scores it 0 without keeping it either.
    args = parse_args(_body({"Pod": POD, "Nodes": {"items": [old]}}))
    assert decider.prioritize(args) == [{"Host": "a", "Score": 0}]
    assert state.node_names() == ["b"]


def test_a_node_recreated_under_the_name_is_taken_from_the_scheduler_before_the_watch_shows_it() -> None:
    state = ClusterState()
    decider = Decider(state, "binpack")
    old = _node("a", "uid-old")
    state.node_event("ADDED", old)
    state.node_event("DELETED", old)
    answer = _filter(decider, [_node("a", "uid-new")])
    assert [n["metadata"]["name"] for n in answer["Nodes"]["items"]] == ["a"]
    assert state.node_names() == ["a"]


def test_a_node_the_watch_has_not_shown_is_not_said_to_have_no_gpus() -> None:
    """With nodeCacheCapable: true only names come: a GPU node the node watch has not shown yet is
    refused for that reason, not as a node without tencent.com/vcuda-core (which misleads the operator)."""
    state = ClusterState()
    decider = Decider(state, "binpack")
    state.node_event("ADDED", {"metadata": {"name": "cpu", "uid": "u-cpu"}, "status": {"capacity": {}}})
    args = parse_args(_body({"Pod": POD, "NodeNames": ["new", "cpu"]}))
    result, _ = decider.filter(args)
    reasons = result["FailedAndUnresolvableNodes"]
    assert "not shown" in reasons["new"] and "not known to the extender" in reasons["new"]
    assert "vcuda-core" not in reasons["new"]
    assert "no tencent.com/vcuda-core" in reasons["cpu"]


# -- each drop of a pod's GPUs is logged naming the pod, not only its UID ---------------------------


def _pending(name: str, uid: str) -> dict[str, Any]:
    pod: dict[str, Any] = json.loads(json.dumps(POD))
    pod["metadata"].update(name=name, uid=uid)
    pod["status"] = {"phase": "Pending"}
    return pod


def _assumed(state: ClusterState, name: str, uid: str, *, watched: bool = True) -> None:
    """Bind's assumption for a pod the watch has shown (or not: bind read it from the API server)."""
    state.node_event("ADDED", _node("a", "uid-a"))
    if watched:
        state.pod_event("ADDED", _pending(name, uid))
        state.assume(uid, PodCharges("a", (Charge(0, 50, 4 << 28),), 0, "1"))
    else:
        state.assume(uid, PodCharges("a", (Charge(0, 50, 4 << 28),), 0, "1"), f"d/{name}")


def test_a_failed_bind_releasing_gpus_names_the_pod(caplog: pytest.LogCaptureFixture) -> None:
    state = ClusterState()
    _assumed(state, "forgotten", "uid-1")
    with caplog.at_level(logging.INFO, logger="gpumanager.extender.state"):
        state.forget("uid-1")
    assert "d/forgotten" in caplog.text


def test_a_relist_releasing_gpus_names_the_pod(caplog: pytest.LogCaptureFixture) -> None:
    state = ClusterState()
    _assumed(state, "relisted", "uid-2", watched=False)
    state.assumed_bound("uid-2")
    with caplog.at_level(logging.INFO, logger="gpumanager.extender.state"):
        assert state.relisted(set(), since=float("inf")) == 1
    assert "d/relisted" in caplog.text


def test_an_unanswered_binding_expiring_names_the_pod(caplog: pytest.LogCaptureFixture) -> None:
    state = ClusterState(assume_ttl=1e-9)
    _assumed(state, "unanswered", "uid-3")
    state.assumed_bound("uid-3", bound=False)
    with caplog.at_level(logging.INFO, logger="gpumanager.extender.state"):
        assert state.expire() == 1
    assert "d/unanswered" in caplog.text


# -- a node whose capacity claims more GPUs than any node has --------------------------------------


def test_a_node_capacity_claiming_thousands_of_gpus_is_not_built(caplog: pytest.LogCaptureFixture) -> None:
    """Without the inventory annotation a node is judged as capacity/100 GPUs, whose flat topology
    costs the square of their number, built under the state's lock: a node whose status claimed
    vcuda-core=1M stalled every verb for minutes. It is refused, naming the node and the value."""
    state = ClusterState()
    decider = Decider(state, "binpack")
    big = {
        "metadata": {"name": "big", "uid": "u-big"},
        "status": {"capacity": {"tencent.com/vcuda-core": "1M", "tencent.com/vcuda-memory": "64"}},
    }
    with caplog.at_level(logging.WARNING, logger="gpumanager.extender"):
        state.node_event("ADDED", big)
        state.node_event("MODIFIED", big)
    assert state.node("big") is None
    assert caplog.text.count("10000 GPUs") == 1  # warned once, not at each status update
    args = parse_args(_body({"Pod": POD, "NodeNames": ["big"]}))
    result, _ = decider.filter(args)
    reason = result["FailedAndUnresolvableNodes"]["big"]
    assert "1M" in reason and "10000 GPUs" in reason, reason
    # Back to a believable capacity: used again.
    state.node_event("MODIFIED", _node("big", "u-big", gpus=2))
    assert state.node("big") is not None
    result, _ = decider.filter(args)
    assert result["NodeNames"] == ["big"]


# -- gpu-admission's own verb names ----------------------------------------------------------------


def test_gpu_admissions_priorities_verb_is_prioritize() -> None:
    """gpu-admission served POST <prefix>/priorities beside /predicates: a configuration with
    prioritizeVerb: priorities got 404 (the scheduler then drops the extender's scores, logging an error
    for every pod)."""
    called: list[str] = []

    def verb(name: str) -> Any:
        def answer(body: bytes) -> tuple[Any, int]:
            called.append(name)
            return [{"Host": "a", "Score": 3}], 200

        return answer

    routes = Routes(
        verbs={"filter": verb("filter"), "prioritize": verb("prioritize"), "bind": verb("bind")},
        ready=lambda: (True, {}),
        version={},
    )
    server = ExtenderServer("127.0.0.1", 0, routes, ExtenderMetrics(dict))
    server.start()
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/scheduler/priorities", data=b"{}", method="POST"
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.loads(response.read()) == [{"Host": "a", "Score": 3}]
    finally:
        server.stop()
    assert called == ["prioritize"]


def test_a_request_refused_400_is_logged_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    """The kube-scheduler drops the body of any answer but 200 ("failed filter with extender at URL
    ..., code 400"): the reason must reach the extender's log, or nobody sees it."""

    def filter_verb(body: bytes) -> tuple[Any, int]:
        parse_args(body)
        return {}, 200

    routes = Routes(verbs={"filter": filter_verb}, ready=lambda: (True, {}), version={})
    server = ExtenderServer("127.0.0.1", 0, routes, ExtenderMetrics(dict))
    server.start()
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/scheduler/filter", data=b'{"Pod": {}}', method="POST"
        )
        with (
            caplog.at_level(logging.WARNING, logger="gpumanager.extender.server"),
            pytest.raises(urllib.error.HTTPError) as refused,
        ):
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 400
    finally:
        server.stop()
    assert "filter" in caplog.text and "neither Nodes nor NodeNames" in caplog.text, caplog.text
    assert "127.0.0.1" in caplog.text


def test_a_deleted_node_sent_by_name_is_said_to_be_deleted() -> None:
    state = ClusterState()
    decider = Decider(state, "binpack")
    old = _node("gone", "uid-gone")
    state.node_event("ADDED", old)
    state.node_event("DELETED", old)
    result, _ = decider.filter(parse_args(_body({"Pod": POD, "NodeNames": ["gone"]})))
    reason = result["FailedAndUnresolvableNodes"]["gone"]
    assert "has been deleted" in reason, reason
