"""Two extender replicas (real processes, the shipped RBAC) never give out the same GPU share."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from gpumanager.extender import claims
from gpumanager.extender.nodes import Charge
from gpumanager.kube.gpu_inventory import ANNOTATION
from simnode.apiserver import ApiServerSimulator
from simnode.extender_process import ExtenderProcess
from tests import extender_fixtures
from tests.extender_fixtures import GIB, World, gpu_pod, inventory, wait_for

world = extender_fixtures.world

NODE = "gpu-1"
CORE = names.VCORE_RESOURCE


@contextmanager
def replicas(tmp_path: Path, gpus: int) -> Iterator[tuple[ApiServerSimulator, list[ExtenderProcess]]]:
    """The API-server simulator with one node of ``gpus`` 16 GiB GPUs and two extender processes."""
    with ApiServerSimulator() as sim:
        capacity = {CORE: str(100 * gpus), names.VMEMORY_RESOURCE: str(gpus * 16 * GIB // names.MEMORY_BLOCK_BYTES)}
        sim.add_node(NODE, capacity=capacity, annotations={ANNOTATION: inventory([16] * gpus)})
        procs = []
        for i in range(2):
            kubeconfig = sim.write_component_kubeconfig(tmp_path / f"r{i}" / "kubeconfig", "extender")
            procs.append(ExtenderProcess(tmp_path / f"r{i}", kubeconfig))
        try:
            for p in procs:
                p.start()
            yield sim, procs
        finally:
            sim.hold_watches(False)
            for p in procs:
                p.stop()
            assert not sim.forbidden(), sim.forbidden()


def bind(ext: ExtenderProcess, pod: dict[str, Any]) -> str:
    md = pod["metadata"]
    args = {"PodName": md["name"], "PodNamespace": "default", "PodUID": md["uid"], "Node": NODE}
    answer: Any = ext.post("bind", args)
    return str(answer["Error"])


def held_cores(sim: ApiServerSimulator) -> dict[int, int]:
    """GPU minor -> vcuda-core held by the pods bound to (or chosen for) the node, from their annotations."""
    held: dict[int, int] = {}
    for pod in sim.pods():
        notes = pod["metadata"].get("annotations") or {}
        if pod["spec"].get("nodeName") != NODE and notes.get(names.PREDICATE_NODE) != NODE:
            continue
        for i, c in enumerate(pod["spec"]["containers"]):
            minors = notes.get(f"{names.PREDICATE_GPU_IDX_PREFIX}{i}")
            if minors:
                cores = int(c["resources"]["limits"][CORE])
                for m in minors.split(","):
                    held[int(m)] = held.get(int(m), 0) + cores
    return held


def bound(sim: ApiServerSimulator) -> list[str]:
    return sorted(p["metadata"]["name"] for p in sim.pods() if p["spec"].get("nodeName") == NODE)


def test_two_replicas_with_lagging_watches_do_not_both_take_the_last_share(tmp_path: Path) -> None:
    with replicas(tmp_path, 1) as (sim, (one, two)):
        a = sim.create_pod(gpu_pod("a", [(60, 4)]))
        b = sim.create_pod(gpu_pod("b", [(60, 4)]))
        sim.hold_watches(True)  # each replica's watch lags behind the other's writes; reads are current
        first = bind(one, a)
        second = bind(two, b)
        sim.hold_watches(False)
        assert first == ""
        assert second != "", f"both replicas placed 60 cores on one GPU: {held_cores(sim)}"
        assert "no longer fits" in second, second
        assert bound(sim) == ["a"]
        assert max(held_cores(sim).values()) <= 100


def test_a_burst_across_two_replicas_never_overcommits_and_fills_the_node(tmp_path: Path) -> None:
    with replicas(tmp_path, 2) as (sim, procs):
        pods = [sim.create_pod(gpu_pod(f"p{i}", [(50, 4)])) for i in range(8)]
        wait_for(lambda: all(p.metrics().count("\n") > 0 for p in procs), what="replicas serving")
        start = threading.Barrier(len(pods))

        def race(i: int) -> str:
            start.wait()
            return bind(procs[i % 2], pods[i])

        with ThreadPoolExecutor(len(pods)) as pool:
            list(pool.map(race, range(len(pods))))
        held = held_cores(sim)
        assert all(v <= 100 for v in held.values()), f"over-committed: {held} ({bound(sim)} bound)"
        # the scheduler retries the refused pods, on either replica: the node fills exactly
        for attempt in range(20):
            waiting = [p for p in pods if p["metadata"]["name"] not in bound(sim)]
            if len(bound(sim)) == 4:
                break
            for j, pod in enumerate(waiting):
                bind(procs[(attempt + j) % 2], pod)
        assert len(bound(sim)) == 4, bound(sim)
        held = held_cores(sim)
        assert held == {0: 100, 1: 100}, held


def test_a_replica_killed_mid_bind_leaves_the_other_to_finish_without_double_booking(tmp_path: Path) -> None:
    with replicas(tmp_path, 1) as (sim, (one, two)):
        a = sim.create_pod(gpu_pod("a", [(50, 4)]))
        b = sim.create_pod(gpu_pod("b", [(50, 4)]))
        c = sim.create_pod(gpu_pod("c", [(50, 4)]))
        # one's annotation of pod a hangs: it dies there, after choosing, before the Binding
        sim.delay(r"/namespaces/default/pods/a$", 5.0, method="PATCH", count=1)
        threading.Thread(target=_ignore, args=(lambda: bind(one, a),), daemon=True).start()
        wait_for(lambda: "uid-a" in recorded(sim), what="one's choice recorded on the node")
        time.sleep(0.2)  # one waits for the API server's answer to its annotation of pod a
        one.kill()
        stored = sim.get_pod("default", "a")
        assert stored is not None and not stored["spec"].get("nodeName")  # killed mid-bind
        # the scheduler heard nothing (connection reset) and retries pod a, on the replica left
        first_choice = recorded(sim)["uid-a"].predicate_time
        wait_for(lambda: bind(two, a) == "", timeout=15, what="pod a bound by the other replica")
        stored = sim.get_pod("default", "a")
        assert stored is not None
        when = stored["metadata"]["annotations"][names.PREDICATE_TIME]
        assert when != first_choice and recorded(sim)["uid-a"].predicate_time == when  # two's own choice
        assert bind(two, b) == ""
        assert "no longer fits" in bind(two, c)
        assert bound(sim) == ["a", "b"]
        assert held_cores(sim) == {0: 100}


def recorded(sim: ApiServerSimulator) -> dict[str, claims.Claim]:
    node = sim.get_node(NODE)
    assert node is not None
    return claims.read_claims(node, time.time())


def _ignore(fn: Callable[[], object]) -> None:
    try:
        fn()
    except OSError:
        pass


def _note_node(world: World, name: str, value: str) -> None:
    def change(node: dict[str, Any]) -> None:
        node["metadata"].setdefault("annotations", {})[claims.ANNOTATION] = value

    world.api.update_node(name, change)


def test_a_choice_another_replica_recorded_counts_until_it_lapses(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(claims, "CLAIM_TTL", 1.0)  # counted from this replica's first read of the choice
    world.add_node("n", inventory([16]))
    world.start_extender()
    pod = world.create(gpu_pod("p", [(60, 4)]))
    fresh = claims.Claim("default/elsewhere", time.time(), "1", (Charge(0, 60, 4 * names.MEMORY_BLOCK_BYTES),))
    _note_node(world, "n", claims.encode_claims({"uid-elsewhere": fresh}))
    assert "no longer fits" in world.bind(pod, "n")
    time.sleep(1.2)
    assert world.bind(pod, "n") == ""
    node = world.api.get_node("n")
    assert node is not None
    recorded = claims.read_claims(node, time.time())
    assert list(recorded) == ["uid-p"] and recorded["uid-p"].charges[0].cores == 60


def test_an_unreadable_record_on_the_node_is_replaced(world: World) -> None:
    world.add_node("n", inventory([16]))
    world.start_extender()
    pod = world.create(gpu_pod("p", [(60, 4)]))
    _note_node(world, "n", "not json")
    assert world.bind(pod, "n") == ""
    node = world.api.get_node("n")
    assert node is not None
    assert list(claims.read_claims(node, time.time())) == ["uid-p"]
    odd = {"uid-x": {"at": "yesterday", "gpus": []}, "uid-y": {"at": time.time(), "gpus": [[0, True, 1]]}}
    assert claims.read_claims({"metadata": {"annotations": {claims.ANNOTATION: json.dumps(odd)}}}, time.time()) == {}


def test_a_failed_binding_takes_its_choice_off_the_node(world: World) -> None:
    world.add_node("n", inventory([16]))
    world.start_extender()
    pod = world.create(gpu_pod("p", [(60, 4)]))
    world.api.fail_next("POST", r"/pods/p/binding$", 500)
    assert "its GPUs are released" in world.bind(pod, "n")
    node = world.api.get_node("n")
    assert node is not None
    assert claims.read_claims(node, time.time()) == {}


def test_the_choice_of_a_pod_deleted_since_holds_nothing(world: World) -> None:
    world.add_node("n", inventory([16]))
    world.start_extender()
    first = world.create(gpu_pod("first", [(60, 4)]))
    assert world.bind(first, "n") == ""
    world.wait_seen(1)
    world.api.delete_pod("default", "first")  # a short job: gone within the record's 30 s
    world.wait_seen(0)
    second = world.create(gpu_pod("second", [(60, 4)]))
    assert world.bind(second, "n") == ""
    node = world.api.get_node("n")
    assert node is not None
    assert list(claims.read_claims(node, time.time())) == ["uid-second"]
