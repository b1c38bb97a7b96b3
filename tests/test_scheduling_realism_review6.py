"""Scheduling as a real cluster does it: two extender replicas whose clocks disagree and whose
watches lag, a kube-scheduler that promises no order of nodes, a kubelet that admits one pod at a time."""

from __future__ import annotations

import http.server
import itertools
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from gpumanager.extender import claims, service
from gpumanager.extender.nodes import Charge
from simnode.apiserver import ApiServerSimulator
from simnode.cluster import SimCluster
from simnode.cluster import gpu_pod as gpu_pod_on_node
from simnode.multinode import MultiNodeCluster, pending_pod
from simnode.scheduler import ExtenderConfig, SchedulerStandIn
from tests import extender_fixtures
from tests.extender_fixtures import World, gpu_pod, inventory, wait_for

world = extender_fixtures.world

BLOCK = names.MEMORY_BLOCK_BYTES


def _note_node(world: World, name: str, value: str) -> None:
    def change(node: dict[str, Any]) -> None:
        node["metadata"].setdefault("annotations", {})[claims.ANNOTATION] = value

    world.api.update_node(name, change)


def _other_replicas_choice(at: float, minor: int = 0, cores: int = 60, predicate_time: str = "1") -> str:
    """The node annotation as another replica writes it when it chose ``cores`` of GPU ``minor``
    for pod ``uid-elsewhere`` at its own clock's ``at``."""
    claim = claims.Claim("default/elsewhere", at, predicate_time, (Charge(minor, cores, 4 * BLOCK),))
    return claims.encode_claims({"uid-elsewhere": claim})


def _watch_shows_note(world: World, name: str) -> None:
    state = world.extender.state

    def shown() -> bool:
        return bool(state.node_claims(name))

    wait_for(shown, what=f"the extender's node watch shows the recorded choices on {name}")


def test_a_choice_recorded_by_a_replica_whose_clock_is_behind_still_counts(world: World) -> None:
    """The other replica's clock is a minute behind: its choice, made just now, carries a time that
    reads as long past here. It must hold the GPU all the same (else two pods share 120 % of it)."""
    world.add_node("n", inventory([16]))
    world.start_extender()
    pod = world.create(gpu_pod("p", [(60, 4)]))
    _note_node(world, "n", _other_replicas_choice(time.time() - 60))
    assert "no longer fits" in world.bind(pod, "n")


def test_a_choice_recorded_by_a_replica_whose_clock_is_ahead_lapses(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other replica's clock is an hour ahead and its bind died after recording its choice: the
    choice holds the GPU for the claim's lifetime as this replica measures it, not for an hour."""
    monkeypatch.setattr(claims, "CLAIM_TTL", 1.0)
    world.add_node("n", inventory([16]))
    world.start_extender()
    pod = world.create(gpu_pod("p", [(60, 4)]))
    _note_node(world, "n", _other_replicas_choice(time.time() + 3600))
    assert "no longer fits" in world.bind(pod, "n")
    time.sleep(1.2)
    assert world.bind(pod, "n") == ""


def test_prioritize_counts_the_choices_another_replica_recorded_on_the_node(world: World) -> None:
    """The other replica chose 60 % of the only GPU of ``full`` (recorded on the node; its pod's
    annotations not shown by this replica's watch yet): ``full`` scores 0, and filter fails it since
    ``free`` has room, so the scheduler sends the pod to ``free`` rather than to a bind that can only
    refuse it. (Where no node has room, filter passes it: see
    test_a_node_filled_only_by_a_recorded_choice_costs_the_scheduler_retries_until_it_lapses.)"""
    world.add_node("full", inventory([16]))
    world.add_node("free", inventory([16]))
    world.start_extender()
    _note_node(world, "full", _other_replicas_choice(time.time()))
    _watch_shows_note(world, "full")
    pod = world.create(gpu_pod("p", [(60, 4)]))
    scores = world.scores(pod)
    assert scores["full"] == 0 and scores["free"] > 0, scores
    assert sorted(world.passed(pod)) == ["free"]
    assert "no longer fits" in world.bind(pod, "full")


def test_a_newer_choice_from_a_replica_whose_clock_is_behind_is_not_taken_for_an_older_one(world: World) -> None:
    """Pod ``x`` was chosen for GPU 0 (its annotations, as this replica's watch still shows them, carry
    this replica's predicate time); the other replica, whose clock is behind, chose it again since, for
    GPU 1, and recorded that on the node with a smaller predicate time. GPU 1 is x's now: a pod that
    fits only there must not be bound there."""
    world.add_node("n", inventory([16, 16]))
    world.start_extender()
    now = time.time_ns()
    old = {
        f"{names.PREDICATE_GPU_IDX_PREFIX}0": "0",
        names.PREDICATE_NODE: "n",
        names.PREDICATE_TIME: str(now),
        names.GPU_ASSIGNED: "false",
    }
    x = world.create(gpu_pod("x", [(60, 4)], annotations=old))
    world.wait_seen(1)
    newer = claims.Claim("default/x", time.time(), str(now - 60 * 10**9), (Charge(1, 60, 4 * BLOCK),))
    _note_node(world, "n", claims.encode_claims({x["metadata"]["uid"]: newer}))
    pod = world.create(gpu_pod("p", [(60, 4)]))
    assert "no longer fits" in world.bind(pod, "n")


# -- the kube-scheduler stand-in: no order of nodes is promised -------------------------------------


class _RecordingExtender(http.server.ThreadingHTTPServer):
    """A filter-only extender (nodeCacheCapable) that passes every node and records the order offered."""

    def __init__(self) -> None:
        self.orders: list[list[str]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                args = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.orders.append(list(args["NodeNames"]))
                body = json.dumps({"NodeNames": args["NodeNames"], "FailedNodes": {}, "Error": ""}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def test_the_scheduler_stand_in_offers_the_nodes_in_no_fixed_order_and_names_its_seed(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """kube-scheduler filters nodes in parallel from a rotating start: an extender gets them in no
    fixed order. The stand-in shuffles them with a seed it prints, which SIMNODE_SCHEDULER_SEED repeats."""
    monkeypatch.delenv("SIMNODE_SCHEDULER_SEED", raising=False)
    recorder = _RecordingExtender()
    threading.Thread(target=recorder.serve_forever, daemon=True).start()
    config = ExtenderConfig(
        url_prefix=f"http://127.0.0.1:{recorder.server_address[1]}", filter_verb="filter", node_cache_capable=True
    )
    with ApiServerSimulator() as sim:
        for i in range(6):
            sim.add_node(f"node-{i}")
        scheduler = SchedulerStandIn(sim.client(), [config], initial_backoff=0.1, max_backoff=0.5)
        seed = scheduler.seed
        assert f"seed {seed} (SIMNODE_SCHEDULER_SEED={seed} repeats it)" in capfd.readouterr().err
        scheduler.start()
        try:
            for i in range(8):
                sim.create_pod(pending_pod(f"web-{i}", [(0, 0)]))
            wait_for(lambda: len(recorder.orders) >= 8, what="eight filter calls")
        finally:
            scheduler.stop()
            recorder.shutdown()
            recorder.server_close()
    assert all(sorted(o) == [f"node-{i}" for i in range(6)] for o in recorder.orders), recorder.orders
    assert len({tuple(o) for o in recorder.orders}) > 1, recorder.orders
    monkeypatch.setenv("SIMNODE_SCHEDULER_SEED", str(seed))
    with ApiServerSimulator() as sim:
        assert SchedulerStandIn(sim.client()).seed == seed


# -- the kubelet admits the pods of its node one at a time ------------------------------------------


def test_the_simulated_kubelet_admits_the_pods_of_its_node_one_at_a_time(tmp_path: Path, sim_built: Path) -> None:
    """The kubelet's sync loop handles pod additions one after another (HandlePodAdditions), and the
    device manager's Allocate calls run inside that admission: pods handed to the simulated kubelet
    together never have their Allocate calls overlap."""
    with SimCluster(tmp_path, "v100-pcie-x4") as cluster:
        for i in range(6):
            cluster.create(gpu_pod_on_node(f"p{i}", [("c", 25, 2)]))
        runs = list(cluster.runs.values())
        go = threading.Event()
        errors: list[BaseException] = []

        def admit(i: int) -> None:
            go.wait()
            try:
                cluster.admit(runs[i].manifest, create=False)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=admit, args=(i,)) for i in range(len(runs))]
        for t in threads:
            t.start()
        go.set()
        for t in threads:
            t.join(120)
        assert errors == []
        spans = sorted(
            (min(r.timings.started_at for r in records), max(r.timings.finished_at for r in records))
            for records in (cluster.kubelet.allocations(run.uid) for run in runs)
        )
    assert len(spans) == len(runs)
    overlapping = [(a, b) for a, b in itertools.pairwise(spans) if b[0] < a[1]]
    assert overlapping == [], "admissions of one node overlapped"


def test_a_node_filled_only_by_a_recorded_choice_keeps_the_pod_unschedulable_until_it_lapses(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The only node is full by another replica's recorded choice: filter fails it, so the pod is parked
    as unschedulable (never sent to a bind that can only refuse it); once the choice lapsed the extender
    takes it off the node, a Node update that sends the pod back, and it is bound on a GPU not
    over-committed (long before the scheduler's 5-minute flush)."""
    monkeypatch.setattr(claims, "CLAIM_TTL", 1.5)
    monkeypatch.setattr(service, "SWEEP_EVERY", 0.2)
    world.add_node("n", inventory([16]))
    world.start_extender()
    _note_node(world, "n", _other_replicas_choice(time.time()))
    _watch_shows_note(world, "n")
    config = ExtenderConfig(
        url_prefix=world.url,
        filter_verb="filter",
        prioritize_verb="prioritize",
        bind_verb="bind",
        managed_resources=(names.VCORE_RESOURCE, names.VMEMORY_RESOURCE),
        ignored_by_scheduler=(names.VCORE_RESOURCE, names.VMEMORY_RESOURCE),
    )
    scheduler = SchedulerStandIn(world.api.client(), [config], initial_backoff=0.2, max_backoff=0.5).start()
    try:
        world.create(gpu_pod("p", [(60, 4)]))

        def bound() -> bool:
            found = world.api.get_pod("default", "p")
            return found is not None and found["spec"].get("nodeName") == "n"

        wait_for(bound, timeout=30, what="pod p bound")
    finally:
        scheduler.stop()
    assert scheduler.stats.bind_failures == 0
    assert scheduler.stats.unschedulable >= 1
    assert world.extender.state.over_committed() == {}


def test_a_container_slow_to_start_holds_up_no_other_pod_of_its_node(tmp_path: Path, sim_built: Path) -> None:
    """The kubelet admits pods one at a time, but starts each in its own pod worker: a PreStartContainer
    that takes long (a slow device plugin) delays that pod only, not the admission of the next one."""
    cluster = MultiNodeCluster(tmp_path / "c", [("v", "v100-pcie-x4")], extender=False, node_status_period=0.3)
    with cluster:
        node = cluster.nodes["v"]
        release = threading.Event()
        real = node.kubelet.pre_start
        slow = {str(uuid.uuid4())}

        def pre_start(resource: str, *, pod_uid: str, container_name: str, **kw: Any) -> Any:
            if pod_uid in slow:
                release.wait(30)
            return real(resource, pod_uid=pod_uid, container_name=container_name, **kw)

        node.kubelet.pre_start = pre_start  # type: ignore[method-assign]
        try:
            manifest = pending_pod("slow", [(50, 4)], node="v")
            manifest["metadata"]["uid"] = next(iter(slow))
            cluster.create(manifest)
            wait_for(lambda: bool(node.kubelet.allocations(next(iter(slow)))), what="pod slow admitted")
            cluster.create(pending_pod("quick", [(50, 4)], node="v"))
            cluster.wait_phase("quick", timeout=20)
            assert cluster.pod("slow")["status"]["phase"] == "Pending"
        finally:
            release.set()
        cluster.wait_phase("slow", timeout=20)


def test_a_replica_started_after_a_pod_was_deleted_does_not_count_the_pods_recorded_choice(world: World) -> None:
    """A choice recorded on the node for a pod deleted before this replica started: the replica reads the
    node, then lists the pods, which no longer show it, so the choice holds nothing (before, a restarted
    replica refused every bind to that GPU for the choice's 30 s)."""
    world.add_node("n", inventory([16]))
    gone = claims.Claim("default/gone", time.time(), "1", (Charge(0, 60, 4 * BLOCK),))
    _note_node(world, "n", claims.encode_claims({"uid-gone": gone}))
    world.start_extender()
    pod = world.create(gpu_pod("p", [(60, 4)]))
    assert world.bind(pod, "n") == ""
