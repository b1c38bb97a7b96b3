"""The extender against a scheduler whose view differs from its own, and odd requests over HTTP."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from gpumanager.extender.service import Extender, ExtenderSettings
from simnode.apiserver import ApiServerSimulator

JSON = dict[str, Any]
CORE = "tencent.com/vcuda-core"
MEMORY = "tencent.com/vcuda-memory"


def _container(name: str, cores: int, blocks: int) -> JSON:
    limits = {}
    if cores:
        limits[CORE] = str(cores)
    if blocks:
        limits[MEMORY] = str(blocks)
    return {"name": name, "image": "x", "resources": {"limits": limits}}


def gpu_pod(name: str, containers: Sequence[tuple[int, int]], inits: Sequence[tuple[int, int]] = ()) -> JSON:
    spec: JSON = {"containers": [_container(f"c{i}", *c) for i, c in enumerate(containers)]}
    if inits:
        spec["initContainers"] = [_container(f"i{i}", *c) for i, c in enumerate(inits)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def wait_for(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class World:
    def __init__(self, sim: ApiServerSimulator) -> None:
        self.sim = sim
        self.extenders: list[Extender] = []

    def extender(self, **settings: Any) -> Extender:
        ext = Extender(self.sim.client(), ExtenderSettings(host="127.0.0.1", port=0, **settings))
        ext.start()
        self.extenders.append(ext)
        wait_for(ext.synced)
        return ext

    def node(self, name: str, gpus: int, blocks: int) -> JSON:
        return self.sim.add_node(name, capacity={CORE: gpus * 100, MEMORY: blocks})


@pytest.fixture
def world() -> Iterator[World]:
    with ApiServerSimulator(bookmark_interval=1.0) as sim:
        w = World(sim)
        try:
            yield w
        finally:
            for ext in w.extenders:
                ext.stop()


def post(ext: Extender, verb: str, body: object) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", ext.server.port, timeout=30)
    try:
        conn.request("POST", f"/scheduler/{verb}", json.dumps(body).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def bind_args(pod: JSON, node: str) -> JSON:
    meta = pod["metadata"]
    return {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": node}


def _no_gpus(node: JSON) -> None:
    for section in ("capacity", "allocatable"):
        node["status"][section][CORE] = "0"
        node["status"][section][MEMORY] = "0"


def test_a_stale_node_object_sent_by_the_scheduler_does_not_bring_back_gpus_the_watch_saw_go(world: World) -> None:
    world.node("a", 2, 32)
    stale = world.sim.get_node("a")
    ext = world.extender()
    world.sim.update_node("a", _no_gpus)  # the device plugin went away: the kubelet zeroes the capacity
    wait_for(lambda: ext.state.node("a") is None)
    pod = world.sim.create_pod(gpu_pod("p1", [(50, 4)]))
    # The scheduler's cache still holds the node as it was.
    code, result = post(ext, "filter", {"Pod": pod, "Nodes": {"items": [stale]}, "NodeNames": None})
    assert code == 200
    assert result["Nodes"]["items"] == []
    assert result["FailedAndUnresolvableNodes"]["a"] == "node has no tencent.com/vcuda-core"
    assert ext.state.node("a") is None
    code, answer = post(ext, "bind", bind_args(pod, "a"))
    assert "has no GPUs" in answer["Error"]
    assert not (world.sim.get_pod("default", "p1") or {}).get("spec", {}).get("nodeName")


def test_a_node_object_sent_by_the_scheduler_before_the_watch_shows_it_is_judged(world: World) -> None:
    ext = world.extender()
    world.sim.hold_watches(True)  # the node watch lags behind the scheduler's cache
    node = world.sim.add_node("late", capacity={CORE: 100, MEMORY: 16})
    pod = gpu_pod("p1", [(50, 4)])
    pod["metadata"]["uid"] = "uid-p1"
    try:
        code, result = post(ext, "filter", {"Pod": pod, "Nodes": {"items": [node]}, "NodeNames": None})
    finally:
        world.sim.hold_watches(False)
    assert code == 200
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["late"]


def _recorded(sim: ApiServerSimulator, node: str) -> dict[str, Any]:
    notes = (sim.get_node(node) or {}).get("metadata", {}).get("annotations") or {}
    raw = notes.get("tencent.com/gpu-extender-binds")
    return json.loads(raw) if raw else {}


def test_a_bind_that_gives_up_after_a_conflict_takes_its_choice_off_the_node(world: World) -> None:
    world.node("a", 1, 16)
    ext = world.extender()
    pod = world.sim.create_pod(gpu_pod("p1", [(60, 4)]))
    wait_for(lambda: ext.pods.get(pod["metadata"]["uid"]) is not None)
    # The annotation patch meets a conflict, and reading the pod again then fails.
    world.sim.fail_next("PATCH", r"/namespaces/default/pods/p1$", 409, message="the object has been modified")
    world.sim.fail_next("GET", r"/namespaces/default/pods/p1$", 500, message="etcd is away")
    code, answer = post(ext, "bind", bind_args(pod, "a"))
    assert code == 200 and "etcd is away" in answer["Error"]
    assert pod["metadata"]["uid"] not in _recorded(world.sim, "a")
    assert not ext.state.is_assumed(pod["metadata"]["uid"])
    # The GPU is free for another pod at once, not after the record lapses.
    other = world.sim.create_pod(gpu_pod("p2", [(60, 4)]))
    code, result = post(ext, "filter", {"Pod": other, "NodeNames": ["a"]})
    assert result["NodeNames"] == ["a"], result


def test_a_given_up_choice_is_not_counted_while_the_node_watch_still_shows_it(world: World) -> None:
    """The bind takes its choice off the node when it gives up, but the node's watch may still show the choice
    when the next filter comes: a filter then refused the node for GPUs that were free (once in five CI runs)."""
    world.node("a", 1, 16)
    ext = world.extender()
    pod = world.sim.create_pod(gpu_pod("p1", [(60, 4)]))
    uid = pod["metadata"]["uid"]
    wait_for(lambda: ext.pods.get(uid) is not None)
    # The annotation patch waits, then meets a conflict, and reading the pod again fails.
    world.sim.delay(r"/namespaces/default/pods/p1$", 1.0, method="PATCH", count=1)
    world.sim.fail_next("PATCH", r"/namespaces/default/pods/p1$", 409, message="the object has been modified")
    world.sim.fail_next("GET", r"/namespaces/default/pods/p1$", 500, message="etcd is away")
    answers: list[tuple[int, Any]] = []
    binding = threading.Thread(target=lambda: answers.append(post(ext, "bind", bind_args(pod, "a"))))
    binding.start()
    try:
        wait_for(lambda: uid in ext.state.node_claims("a"))  # the watch showed the choice recorded
        world.sim.hold_watches(True)  # and shows nothing more for now: not the choice taken off
        binding.join(timeout=30)
        assert answers and answers[0][0] == 200 and "etcd is away" in answers[0][1]["Error"], answers
        assert uid not in _recorded(world.sim, "a")
        other = world.sim.create_pod(gpu_pod("p2", [(60, 4)]))
        code, result = post(ext, "filter", {"Pod": other, "NodeNames": ["a"]})
        assert code == 200 and result["NodeNames"] == ["a"], result
    finally:
        world.sim.hold_watches(False)
        binding.join(timeout=30)


def test_a_bind_refused_on_its_second_turn_takes_the_first_turns_choice_off_the_node(world: World) -> None:
    world.node("a", 1, 16)
    ext = world.extender()
    pod = world.sim.create_pod(gpu_pod("p1", [(60, 4)]))
    wait_for(lambda: ext.pods.get(pod["metadata"]["uid"]) is not None)
    # The first annotation patch meets a conflict; on the second turn the node cannot be read.
    world.sim.fail_next("PATCH", r"/namespaces/default/pods/p1$", 409, message="the object has been modified")
    calls: list[str] = []
    original = ext.binder._core.read_node

    def read_node(name: str, **kw: Any) -> Any:
        calls.append(name)
        if len(calls) == 2:
            raise RuntimeError("node read failed")
        return original(name, **kw)

    ext.binder._core.read_node = read_node  # type: ignore[method-assign]
    code, answer = post(ext, "bind", bind_args(pod, "a"))
    assert code == 200 and "node read failed" in answer["Error"], answer
    ext.binder._core.read_node = original  # type: ignore[method-assign]
    assert pod["metadata"]["uid"] not in _recorded(world.sim, "a")


def _inventory(healthy: dict[int, bool]) -> str:
    from gpumanager.device.types import GPUInfo, NodeTopology
    from gpumanager.kube.gpu_inventory import encode

    gpus = [
        GPUInfo(index=i, uuid=f"GPU-{i}", name="T4", minor=i, memory_total=16 << 30, pci_bus_id=f"0000:0{i}:00.0")
        for i in range(len(healthy))
    ]
    levels = tuple(tuple(0 if i == j else 50 for j in range(len(gpus))) for i in range(len(gpus)))
    return encode(gpus, NodeTopology(levels=levels), healthy, share_mode=True)


def test_bind_chooses_among_the_gpus_of_the_node_it_reads_not_of_a_lagging_watch(world: World) -> None:
    world.sim.add_node(
        "a",
        capacity={CORE: 200, MEMORY: 128},
        annotations={"tencent.com/gpu-inventory": _inventory({0: True, 1: True})},
    )
    ext = world.extender()
    busy = world.sim.create_pod(gpu_pod("busy", [(30, 4)]))
    assert post(ext, "bind", bind_args(busy, "a"))[1]["Error"] == ""
    pod = world.sim.create_pod(gpu_pod("p1", [(50, 4)]))
    wait_for(lambda: ext.pods.get(pod["metadata"]["uid"]) is not None)
    world.sim.hold_watches(True)  # the watch lags; the node read is current
    try:
        # The agent marks GPU 0 (where binpack would put the share, beside 'busy') unhealthy.
        sick = _inventory({0: False, 1: True})
        world.sim.update_node("a", lambda n: n["metadata"]["annotations"].update({"tencent.com/gpu-inventory": sick}))
        _code, answer = post(ext, "bind", bind_args(pod, "a"))
    finally:
        world.sim.hold_watches(False)
    assert answer["Error"] == ""
    notes = world.sim.get_pod("default", "p1")["metadata"]["annotations"]
    assert notes["tencent.com/predicate-gpu-idx-0"] == "1"


def test_a_choice_recorded_for_a_pod_deleted_before_the_start_holds_nothing_once_the_verbs_answer(
    world: World,
) -> None:
    gone = {"pod": "default/gone", "at": time.time(), "time": "1", "gpus": [[0, 60, 1 << 30]]}
    world.sim.add_node(
        "a",
        capacity={CORE: 100, MEMORY: 16},
        annotations={"tencent.com/gpu-extender-binds": json.dumps({"u-gone": gone})},
    )
    ext = Extender(world.sim.client(), ExtenderSettings(host="127.0.0.1", port=0))
    world.extenders.append(ext)
    original = ext.state.relisted

    def slow_relisted(listed: Any, since: float) -> int:
        time.sleep(1.0)  # a busy process: the pods' list is in, its consequences not yet drawn
        return original(listed, since)

    ext.state.relisted = slow_relisted  # type: ignore[method-assign]
    ext.start()
    wait_for(ext.synced)
    pod = gpu_pod("p1", [(60, 4)])
    pod["metadata"]["uid"] = "u-p1"
    code, result = post(ext, "filter", {"Pod": pod, "NodeNames": ["a"]})
    assert code == 200 and result["NodeNames"] == ["a"], result


def test_a_bind_taking_its_choice_back_puts_back_the_record_another_bind_of_the_pod_made(world: World) -> None:
    world.node("a", 1, 16)
    r1 = world.extender()
    r2 = world.extender()
    pod = world.sim.create_pod(gpu_pod("p1", [(60, 4)]))
    uid = pod["metadata"]["uid"]
    wait_for(lambda: r1.pods.get(uid) is not None)
    world.sim.hold_watches(True)  # neither replica's watch shows what the other does
    try:
        # Replica 2 binds the pod to node a (a scheduler that lost its lease had sent it there).
        assert post(r2, "bind", bind_args(pod, "a"))[1]["Error"] == ""
        theirs = _recorded(world.sim, "a")[uid]
        # Replica 1 binds it to the same node from its stale cached copy: its patch meets a conflict,
        # and it finds the pod bound there.
        code, answer = post(r1, "bind", bind_args(pod, "a"))
        assert code == 200 and answer["Error"] == "", answer
        # The record of the choice the pod was bound with is on the node, not replica 1's unused one.
        assert _recorded(world.sim, "a").get(uid) == theirs
    finally:
        world.sim.hold_watches(False)


def test_a_bind_in_flight_when_the_extender_is_told_to_stop_is_finished_and_answered(tmp_path: Any) -> None:
    import threading

    from simnode.extender_process import ExtenderProcess

    with ApiServerSimulator(bookmark_interval=1.0) as sim:
        sim.add_node("a", capacity={CORE: 100, MEMORY: 16})
        pod = sim.create_pod(gpu_pod("p1", [(60, 4)]))
        proc = ExtenderProcess(tmp_path, sim.write_kubeconfig(tmp_path / "kubeconfig")).start()
        try:
            sim.delay(r"/pods/p1/binding$", 2.0)  # the Binding is on its way when the rollout stops this pod
            answers: list[object] = []

            def bind() -> None:
                try:
                    answers.append(proc.post("bind", bind_args(pod, "a")))
                except Exception as exc:
                    answers.append(exc)

            caller = threading.Thread(target=bind)
            caller.start()
            # The node's record and the pod's annotations are written, the Binding is held.
            wait_for(
                lambda: (
                    "tencent.com/predicate-node"
                    in (sim.get_pod("default", "p1") or {})["metadata"].get("annotations", {})
                )
            )
            time.sleep(0.3)
            assert proc.proc is not None
            proc.proc.send_signal(15)
            caller.join(20)
            assert answers == [{"Error": ""}], answers
            assert proc.wait(20) == 0
            assert (sim.get_pod("default", "p1") or {})["spec"].get("nodeName") == "a"
        finally:
            proc.stop()
