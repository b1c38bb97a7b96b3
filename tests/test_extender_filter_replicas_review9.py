"""Two extender replicas against one API server: filter honours the choices the other replica recorded
on a node (annotation ``tencent.com/gpu-extender-binds``) before its pod watch shows the pod's own
annotations, so the scheduler is not sent to a node whose bind can only refuse the pod."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.pods import PodSpecError
from gpumanager.extender import claims
from gpumanager.extender.nodes import Charge
from gpumanager.extender.service import Extender
from simnode.apiserver import ApiServerSimulator
from simnode.extender_process import ExtenderProcess
from tests import extender_fixtures
from tests.extender_fixtures import BLOCK, PREFIX, World, gpu_pod, http_error, inventory, wait_for

world = extender_fixtures.world


def _post(ext: Extender, verb: str, body: object) -> Any:
    req = urllib.request.Request(
        f"http://127.0.0.1:{ext.server.port}/scheduler/{verb}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def _filter(world: World, ext: Extender, pod: dict[str, Any]) -> dict[str, Any]:
    answer: dict[str, Any] = _post(ext, "filter", {"Pod": pod, "Nodes": {"items": world.api.nodes()}})
    assert answer["Error"] == "", answer
    return answer


def _passed(answer: dict[str, Any]) -> list[str]:
    return sorted(n["metadata"]["name"] for n in (answer["Nodes"] or {}).get("items") or [])


def _bind(ext: Extender, pod: dict[str, Any], node: str) -> str:
    md = pod["metadata"]
    args = {"PodName": md["name"], "PodNamespace": "default", "PodUID": md["uid"], "Node": node}
    return str(_post(ext, "bind", args)["Error"])


def _other_bind_in_flight(
    world: World, one: Extender, two: Extender, x: dict[str, Any]
) -> tuple[threading.Thread, list[str]]:
    """Replica ``one`` binds pod ``x`` to node ``full``: it records its choice on the node, then its
    patch of x's annotations hangs 5 s (a slow API server; its bind may take 10), so replica ``two``'s
    watches show the record but not the pod's annotations. Returns the thread of one's bind and the
    list its answer goes to."""
    world.api.delay(r"/namespaces/default/pods/x$", 5.0, method="PATCH", count=1)
    outcome: list[str] = []
    thread = threading.Thread(target=lambda: outcome.append(_bind(one, x, "full")), daemon=True)
    thread.start()
    wait_for(lambda: "uid-x" in two.state.node_claims("full"), what="replica two's node watch shows one's choice")
    assert two.state.pod_count() == 0  # its pod watch has not shown x chosen yet
    return thread, outcome


def _wait_counted(ext: Extender, pods: int) -> None:
    wait_for(lambda: ext.state.pod_count() == pods and ext.state.unplaced() == 0, what=f"{pods} pods counted, placed")


def test_filter_fails_a_node_the_other_replica_just_filled_when_another_node_has_room(world: World) -> None:
    world.add_node("full", inventory([16]))
    world.add_node("free", inventory([16]))
    one, two = world.start_extender(bind_timeout=10.0), world.start_extender(bind_timeout=10.0)
    x = world.create(gpu_pod("x", [(60, 4)]))
    y = world.create(gpu_pod("y", [(60, 4)]))
    other, outcome = _other_bind_in_flight(world, one, two, x)
    answer = _filter(world, two, y)
    # Before: both passed, and a scheduler that picked "full" (prioritize scores it 0, but a tie or the
    # scheduler's own scores may still pick it) got a bind that could only refuse the pod.
    assert _passed(answer) == ["free"], answer["FailedNodes"]
    reason = answer["FailedNodes"]["full"]
    assert "counting the choices binds recorded on the node" in reason and claims.ANNOTATION in reason, reason
    assert "full" not in (answer.get("FailedAndUnresolvableNodes") or {})
    assert _bind(two, y, "free") == ""
    other.join(10)
    assert outcome == [""]
    for ext in (one, two):
        _wait_counted(ext, 2)
        assert ext.state.over_committed() == {}


def test_filter_fails_a_node_filled_only_by_a_record_also_when_no_node_has_room(world: World) -> None:
    """No other node has room: the node still fails (resolvable, naming the record's pod),
    so the pod stays Pending instead of going to a bind that can only refuse it."""
    world.add_node("full", inventory([16]))
    one, two = world.start_extender(bind_timeout=10.0), world.start_extender(bind_timeout=10.0)
    x = world.create(gpu_pod("x", [(60, 4)]))
    y = world.create(gpu_pod("y", [(60, 4)]))
    other, outcome = _other_bind_in_flight(world, one, two, x)
    answer = _filter(world, two, y)
    assert _passed(answer) == [], answer
    assert "counting the choices binds recorded on the node" in answer["FailedNodes"]["full"], answer
    assert "no longer fits" in _bind(two, y, "full")  # never an over-commit
    other.join(10)
    assert outcome == [""]


def _note(world: World, node: str, uid: str, pod: str) -> None:
    claim = claims.Claim(pod, time.time(), "1", (Charge(0, 60, 4 * BLOCK),))

    def change(obj: dict[str, Any]) -> None:
        obj["metadata"].setdefault("annotations", {})[claims.ANNOTATION] = claims.encode_claims({uid: claim})

    world.api.update_node(node, change)


def test_a_record_that_lapsed_no_longer_fails_the_node(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record whose bind died (never bound, never removed) counts for its lifetime, as bind counts it,
    then filter passes the node again: no GPU is blocked for ever."""
    monkeypatch.setattr(claims, "CLAIM_TTL", 1.0)
    world.add_node("full", inventory([16]))
    world.add_node("free", inventory([16]))
    ext = world.start_extender()
    y = world.create(gpu_pod("y", [(60, 4)]))
    _note(world, "full", "uid-dead", "default/dead")
    wait_for(lambda: bool(ext.state.node_claims("full")), what="the record shown")
    assert _passed(_filter(world, ext, y)) == ["free"]
    time.sleep(1.2)
    assert _passed(_filter(world, ext, y)) == ["free", "full"]
    assert _bind(ext, y, "full") == ""


def test_a_record_of_a_deleted_pod_does_not_fail_the_node(world: World) -> None:
    """The pod of the record was deleted (the watch showed it): its record holds nothing, in filter as in bind."""
    world.add_node("full", inventory([16]))
    world.add_node("free", inventory([16]))
    ext = world.start_extender()
    gone = world.create(gpu_pod("gone", [(60, 4)]))
    y = world.create(gpu_pod("y", [(60, 4)]))
    _note(world, "full", gone["metadata"]["uid"], "default/gone")
    wait_for(lambda: bool(ext.state.node_claims("full")), what="the record shown")
    assert _passed(_filter(world, ext, y)) == ["free"]
    world.api.delete_pod("default", "gone")
    wait_for(lambda: ext.state.ended(gone["metadata"]["uid"]), what="the deletion shown")
    assert _passed(_filter(world, ext, y)) == ["free", "full"]
    assert _bind(ext, y, "full") == ""


# -- odd values written by others ------------------------------------------------------------------


def test_an_index_annotation_of_thousands_of_digits_is_refused_by_name(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """``predicate-gpu-idx-0`` of 5000 digits: Python refuses to convert so long a number (ValueError,
    not PodSpecError), which escaped the pod watch's listener with a traceback, the pod's event lost
    (the agent's Allocate read the same function). It is an annotation that names no GPU: the pod is
    counted with that container unplaced, a warning naming the pod and the annotation."""
    world.add_node("n", inventory([16]))
    ext = world.start_extender()
    notes = {f"{PREFIX}0": "1" * 5000, names.PREDICATE_NODE: "n", names.PREDICATE_TIME: "1"}
    pod = world.create(gpu_pod("long", [(30, 4)], node="n", annotations=notes, phase="Running"))
    wait_for(lambda: ext.state.unplaced() == 1, what="the pod counted, its container unplaced")
    assert "Traceback" not in caplog.text
    assert "listener failed" not in caplog.text
    with pytest.raises(PodSpecError) as err:
        podinfo.predicated_gpus(pod, 0)
    assert "default/long" in str(err.value) and f"{PREFIX}0" in str(err.value)
    assert len(str(err.value)) < 300  # the value is shown cut short


def test_a_recorded_choice_with_negative_numbers_frees_nothing(world: World) -> None:
    """A record on the node whose charges are negative (a hand edit, a damaged value) would take cores off
    what the GPU holds, and bind would over-commit it: such a record is not read."""
    world.add_node("n", inventory([16]))
    ext = world.start_extender()
    held_notes = {f"{PREFIX}0": "0", names.PREDICATE_NODE: "n", names.PREDICATE_TIME: "1", names.GPU_ASSIGNED: "true"}
    world.create(gpu_pod("a", [(60, 4)], node="n", annotations=held_notes, phase="Running"))
    world.wait_seen(1)
    value = json.dumps(
        {"uid-odd": {"pod": "default/odd", "at": time.time(), "time": "2", "gpus": [[0, -60, -4 * BLOCK]]}}
    )

    def change(obj: dict[str, Any]) -> None:
        obj["metadata"].setdefault("annotations", {})[claims.ANNOTATION] = value

    world.api.update_node("n", change)
    p = world.create(gpu_pod("p", [(60, 4)]))
    assert "no longer fits" in _bind(ext, p, "n")
    assert ext.state.over_committed() == {}


# -- predicate time: the agent's order of the pods waiting on a node -------------------------------


def test_a_bind_after_another_replicas_records_a_later_predicate_time_whatever_the_clocks(world: World) -> None:
    """The node agent matches each kubelet Allocate to the waiting pod of the smallest predicate time.
    Another replica, whose clock is a minute ahead, recorded a choice on the node just now: a pod bound
    here after it must not carry a smaller predicate time (the agent would take it for the earlier pod
    and, where their memory differs, refuse both at PreStartContainer)."""
    world.add_node("n", inventory([16, 16]))
    ext = world.start_extender()
    ahead = time.time_ns() + 60 * 10**9
    claim = claims.Claim("default/elsewhere", time.time() + 60, str(ahead), (Charge(0, 60, 4 * BLOCK),))

    def change(obj: dict[str, Any]) -> None:
        obj["metadata"].setdefault("annotations", {})[claims.ANNOTATION] = claims.encode_claims({"uid-else": claim})

    world.api.update_node("n", change)
    p = world.create(gpu_pod("p", [(30, 4)]))
    assert _bind(ext, p, "n") == ""
    mine = int(world.annotations(p)[names.PREDICATE_TIME])
    assert mine > ahead
    recorded = claims.parse_claims(world.api.nodes()[0])
    assert recorded["uid-p"].predicate_time == str(mine) and recorded["uid-else"].predicate_time == str(ahead)


# -- one pod bound by two binds at once (the scheduler retried on another node) ----------------------


def test_a_second_bind_of_a_pod_to_another_node_waits_for_the_first(world: World) -> None:
    """The scheduler lost replica one's answer and bound the pod again, to another node, through replica
    two, while one's Binding was still on its way. Two overwrote one's annotations (naming n2), one's
    Binding was made (the pod runs on n1), two's was refused and left its annotations: the pod ran on n1
    with annotations naming n2, counted on no GPU of n1 once one's record lapsed, and the agent chose a
    GPU there by itself. Two now refuses while one's choice of the pod is recorded on n1."""
    world.add_node("n1", inventory([16]))
    world.add_node("n2", inventory([16]))
    one, two = world.start_extender(), world.start_extender()
    p = world.create(gpu_pod("p", [(60, 4)]))
    world.api.delay(r"/namespaces/default/pods/p/binding", 1.0, method="POST", count=1)
    first: list[str] = []
    thread = threading.Thread(target=lambda: first.append(_bind(one, p, "n1")), daemon=True)
    thread.start()
    wait_for(lambda: world.annotations(p).get(names.PREDICATE_NODE) == "n1", what="one's choice written")
    world.api.delay(r"pods/p/binding$", 2.0, method="POST", count=1)
    second = _bind(two, p, "n2")
    thread.join(10)
    assert first == [""]
    stored = world.api.get_pod("default", "p")
    assert stored is not None and stored["spec"]["nodeName"] == "n1"
    notes = stored["metadata"]["annotations"]
    assert notes[names.PREDICATE_NODE] == "n1" and notes[f"{PREFIX}0"] == "0", notes
    assert "n1" in second and second != "", second
    for ext in (one, two):
        _wait_counted(ext, 1)
        gpus = ext.state.node("n1")
        assert gpus is not None and gpus.held[0].cores == 60


def test_a_second_bind_that_read_the_pod_stale_removes_its_record_when_it_steps_back(world: World) -> None:
    """As above, but replica two's watch had not shown one's choice: two records its own on n2, its patch
    of the pod meets 409, it reads the pod again, sees one's choice in flight and steps back, removing
    its record from n2 (else n2's GPU stayed held for the record's lifetime)."""
    world.add_node("n1", inventory([16]))
    world.add_node("n2", inventory([16]))
    one, two = world.start_extender(), world.start_extender()
    p = world.create(gpu_pod("p", [(60, 4)]))
    wait_for(lambda: two._cached_pod("uid-p") is not None, what="two caches p")
    world.api.hold_watches(True)
    world.api.delay(r"/namespaces/default/pods/p/binding", 2.0, method="POST", count=1)
    first: list[str] = []
    thread = threading.Thread(target=lambda: first.append(_bind(one, p, "n1")), daemon=True)
    thread.start()
    wait_for(lambda: world.annotations(p).get(names.PREDICATE_NODE) == "n1", what="one's choice written")
    second = _bind(two, p, "n2")
    world.api.hold_watches(False)
    thread.join(10)
    assert first == [""]
    assert "n1" in second, second
    n2 = next(n for n in world.api.nodes() if n["metadata"]["name"] == "n2")
    assert "uid-p" not in claims.parse_claims(n2)


# -- quantities no API server stores, sent straight to the extender --------------------------------


def _filter_raw(world: World, pod: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    body = json.dumps({"Pod": pod, "NodeNames": ["n"]}).encode()
    return http_error(world, "filter", body)


@pytest.mark.parametrize("resource", [names.VCORE_RESOURCE, names.VMEMORY_RESOURCE])
def test_a_limit_of_thousands_of_digits_is_refused_naming_the_pod_not_a_500(world: World, resource: str) -> None:
    """The API server caps every quantity at 2**63-1, but the extender's port takes any request: a limit of
    5000 digits raised ValueError from int() and filter answered 500 ('internal error')."""
    world.add_node("n", inventory([16]))
    world.start_extender()
    pod = gpu_pod("huge", [(30, 4)])
    for part in ("limits", "requests"):
        pod["spec"]["containers"][0]["resources"][part][resource] = "1" * 5000
    status, answer = _filter_raw(world, pod)
    assert status == 200, answer
    assert "default/huge" in answer["Error"] and resource in answer["Error"], answer


@contextmanager
def _extender_process(tmp_path: Path) -> Iterator[ExtenderProcess]:
    """The real command (its own interpreter: a request that held the GIL for minutes would stall a test
    serving it in-process) against the API-server simulator with one node ``n``."""
    with ApiServerSimulator() as sim:
        world = World(sim)
        world.add_node("n", inventory([16]))
        proc = ExtenderProcess(tmp_path, sim.write_component_kubeconfig(tmp_path / "kubeconfig", "extender"))
        proc.start()
        try:
            yield proc
        finally:
            proc.kill()


def _post_within(proc: ExtenderProcess, body: object) -> Any:
    """filter, the answer as decoded; a TimeoutError when none came within 30 s (a hang guard, not a timing)."""
    return proc.post("filter", body)


def test_a_limit_with_a_huge_exponent_is_refused_without_computing_it(tmp_path: Path) -> None:
    """``1e999999999`` read as a whole number took int() minutes of the interpreter (the whole extender,
    the GIL held); it is refused at once as larger than any quantity."""
    pod = gpu_pod("exp", [(30, 4)])
    for part in ("limits", "requests"):
        pod["spec"]["containers"][0]["resources"][part][names.VCORE_RESOURCE] = "1e999999999"
    with _extender_process(tmp_path) as proc:
        answer = _post_within(proc, {"Pod": pod, "NodeNames": ["n"]})
    assert "default/exp" in answer["Error"] and "1e999999999" in answer["Error"], answer


def test_a_node_capacity_with_a_huge_exponent_reads_as_unreadable(tmp_path: Path) -> None:
    """A Node object sent in a filter request (``nodeCacheCapable: false``) that the watch has not shown:
    its capacity ``1e999999999`` is read as no capacity, not computed."""
    huge = "1e999999999"
    node = {
        "metadata": {"name": "odd", "uid": "uid-odd"},
        "status": {"capacity": {names.VCORE_RESOURCE: huge}, "allocatable": {names.VCORE_RESOURCE: huge}},
    }
    with _extender_process(tmp_path) as proc:
        answer = _post_within(proc, {"Pod": gpu_pod("p", [(30, 4)]), "Nodes": {"items": [node]}})
    assert "odd" in (answer.get("FailedAndUnresolvableNodes") or {}), answer


def test_a_pod_chosen_for_a_node_name_the_api_server_refuses_still_binds(world: World) -> None:
    """The pod's predicate-node is a name no node can have (a hand edit): reading that node is refused
    (400), which must not fail every bind of the pod."""
    world.add_node("n", inventory([16]))
    ext = world.start_extender()
    notes = {f"{PREFIX}0": "0", names.PREDICATE_NODE: "Not A Node!", names.PREDICATE_TIME: "1"}
    p = world.create(gpu_pod("p", [(30, 4)], annotations=notes))
    world.api.fail_next("GET", r"/nodes/Not", 400, count=5, message="invalid node name")
    assert _bind(ext, p, "n") == ""
