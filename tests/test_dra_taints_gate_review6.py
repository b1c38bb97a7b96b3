"""DRA mode: whether the API server keeps device taints (feature gate ``DRADeviceTaints``) is known
whatever the GPUs' health, and found again when the gate changes while every GPU is healthy.

Facts (Kubernetes ``dropDisabledFields`` of ResourceSlices): a server with ``DRADeviceTaints`` off drops
device ``taints`` from a write without an error, unless the stored slice already has some; a dry run
(``dryRun=All``) does the same and stores nothing. A server whose gate is off has a scheduler that
ignores taints: the agent leaves unhealthy GPUs out of its slice then, and reports the gate off
(log, /healthz ``feature_gates_off``, ``gpu_manager_dra_feature_gate_off``)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gpumanager.dra import devices
from gpumanager.dra.publisher import SlicePublisher
from simnode.apiserver import ApiServerSimulator
from tests.dra_slice_fixtures import DRIVER, settle, slice_content, stored_slices

TAINTS = "DRADeviceTaints"
CAPACITY = "DRAConsumableCapacity"


def _count_calls(pub: SlicePublisher) -> list[tuple[str, bool]]:
    """Every API call of the publisher that goes through its JSON helper, as (method, dry run)."""
    calls: list[tuple[str, bool]] = []
    rest = pub._rest
    plain = rest.json

    def json_(method: str, path: str, **kwargs: Any) -> Any:
        calls.append((method, any(k == "dryRun" for k, _ in kwargs.get("query") or ())))
        return plain(method, path, **kwargs)

    rest.json = json_  # type: ignore[method-assign]
    return calls


def _devices(sim: ApiServerSimulator) -> dict[str, bool]:
    """Device name -> whether it is stored with a taint."""
    [stored] = stored_slices(sim)
    return {d["name"]: bool(d.get("taints")) for d in stored["spec"]["devices"]}


def test_taints_off_is_known_at_start_with_every_gpu_healthy(tmp_path: Path) -> None:
    # Kubernetes 1.35 (DRADeviceTaints alpha, off): the operator must see the gate off from the start,
    # not only once a GPU first goes unhealthy (and then leaves the slice).
    seen: list[frozenset[str]] = []
    with ApiServerSimulator(disabled_features=[TAINTS]) as sim:
        pub = SlicePublisher(
            sim.client(), node="node-a", driver=DRIVER, content=slice_content(tmp_path, {}), on_gates=seen.append
        )
        pub.sync()
        assert pub.gates_off == {TAINTS} and seen == [frozenset({TAINTS})]
        assert settle(pub, passes=8) == 0
        # What finding out did is never stored: both GPUs published, untainted.
        assert _devices(sim) == {"gpu-0": False, "gpu-1": False}


def test_taints_on_is_known_at_start_and_costs_no_call_per_sync_after(tmp_path: Path) -> None:
    seen: list[frozenset[str]] = []
    with ApiServerSimulator() as sim:
        sim.add_node("node-a")  # the slice's owner: found once
        pub = SlicePublisher(
            sim.client(), node="node-a", driver=DRIVER, content=slice_content(tmp_path, {}), on_gates=seen.append
        )
        calls = _count_calls(pub)
        settle(pub, passes=8)
        assert pub.gates_off == frozenset() and seen == []
        assert sum(dry for _m, dry in calls) == 1, calls
        del calls[:]
        for _ in range(5):
            assert not pub.sync()
        assert calls == [("GET", False)] * 5, "a settled sync lists the slices, nothing more"
        assert _devices(sim) == {"gpu-0": False, "gpu-1": False}


def test_taints_turned_on_while_every_gpu_is_healthy_clears_the_gate_at_the_next_sync(tmp_path: Path) -> None:
    # The gate turned on while no GPU is unhealthy: the metric and its alert must clear at the next
    # sync, not stay on until a GPU goes unhealthy or the agent restarts.
    seen: list[frozenset[str]] = []
    with ApiServerSimulator(disabled_features=[TAINTS]) as sim:
        pub = SlicePublisher(
            sim.client(), node="node-a", driver=DRIVER, content=slice_content(tmp_path, {}), on_gates=seen.append
        )
        settle(pub, passes=8)
        assert pub.gates_off == {TAINTS}
        sim.add_node("node-a")
        settle(pub, passes=8)  # the slice gets its owner
        sim.set_disabled_features([])
        assert settle(pub, passes=8) == 0, "nothing to write: every GPU is healthy"
        assert pub.gates_off == frozenset() and seen == [frozenset({TAINTS}), frozenset()]
        # Known on: an unhealthy GPU is published tainted at once.
        calls = _count_calls(pub)
        for _ in range(3):
            pub.sync()
        assert not any(dry for _m, dry in calls), calls


def test_taints_turned_off_while_healthy_then_a_gpu_unhealthy_is_never_stored_untainted(tmp_path: Path) -> None:
    taints: dict[int, devices.Taint] = {}
    with ApiServerSimulator() as sim:
        pub = SlicePublisher(sim.client(), node="node-a", driver=DRIVER, content=slice_content(tmp_path, taints))
        settle(pub, passes=8)
        sim.set_disabled_features([TAINTS])
        taints[0] = devices.Taint("XID 79", "2026-11-23T00:00:00Z")
        settle(pub, passes=8)
        assert _devices(sim) == {"gpu-1": False}
        assert pub.gates_off == {TAINTS}


def test_one_dry_run_per_sync_while_both_gates_are_off(tmp_path: Path) -> None:
    # Kubernetes 1.34 (both gates off): finding out whether either gate was turned on is one dry run
    # a sync, not one for each gate.
    with ApiServerSimulator(disabled_features=[TAINTS, CAPACITY]) as sim:
        sim.add_node("node-a")
        pub = SlicePublisher(sim.client(), node="node-a", driver=DRIVER, content=slice_content(tmp_path, {}))
        settle(pub, passes=8)
        assert pub.gates_off == {TAINTS, CAPACITY}
        calls = _count_calls(pub)
        for _ in range(4):
            assert not pub.sync()
        assert calls == [("GET", False), ("PUT", True)] * 4, calls
        sim.set_disabled_features([CAPACITY])
        settle(pub, passes=8)
        assert pub.gates_off == {CAPACITY}
        sim.set_disabled_features([])
        settle(pub, passes=8)
        assert pub.gates_off == frozenset()
        [stored] = stored_slices(sim)
        assert all(d.get("allowMultipleAllocations") is True for d in stored["spec"]["devices"]), stored


def _http_json(port: int, path: str) -> Any:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


def test_an_agent_on_a_server_without_device_taints_reports_it_with_every_gpu_healthy(
    tmp_path: Path, sim_built: Path
) -> None:
    # The whole agent, as the shipped manifests let it talk to the API server (its service account's
    # rules): the gate off is in /healthz and the metric before any GPU goes unhealthy.
    from simnode.dra_cluster import DRACluster

    with DRACluster(tmp_path / "node", "t4-x1", features_off=[TAINTS]) as cluster:
        assert cluster.agent is not None
        port = cluster.agent.query_port
        deadline = time.monotonic() + 20
        health: Any = {}
        while time.monotonic() < deadline:
            health = _http_json(port, "/healthz")
            if health.get("feature_gates_off"):
                break
            time.sleep(0.2)
        assert health["feature_gates_off"] == [TAINTS], health
        assert TAINTS in health["errors"]["resourceslice-fields"], health
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            lines = resp.read().decode().splitlines()
        assert f'gpu_manager_dra_feature_gate_off{{gate="{TAINTS}"}} 1.0' in lines
        assert cluster.api.forbidden() == [], "the shipped rules allow what finding out takes"
        stored = cluster.slice()
        assert stored is not None and not any(d.get("taints") for d in stored["spec"]["devices"])


def _refuse_dry_runs(pub: SlicePublisher) -> list[tuple[str, bool]]:
    """Have the publisher's dry runs answered as a server with an admission webhook on ResourceSlices
    that does not declare ``sideEffects: None`` answers them (400); its calls, counted."""
    from kubernetes.client.exceptions import ApiException

    calls = _count_calls(pub)
    counting = pub._rest.json

    def refusing(method: str, path: str, **kwargs: Any) -> Any:
        out = counting(method, path, **kwargs)  # counted (the simulator stores nothing for a dry run)
        if any(k == "dryRun" for k, _ in kwargs.get("query") or ()):
            exc = ApiException(status=400, reason="Bad Request")
            exc.body = json.dumps({"kind": "Status", "code": 400, "message": NO_DRY_RUN})
            raise exc
        return out

    pub._rest.json = refusing  # type: ignore[method-assign]
    return calls


NO_DRY_RUN = 'admission webhook "slices.example.com" does not support dry run'


def test_a_server_refusing_dry_runs_is_warned_once_not_asked_at_every_sync(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Every dry run refused: finding out at start must not turn into a refused call at every sync
    # (with every GPU healthy, nor after a restart with an unhealthy GPU already published tainted),
    # and the slice is published all the same.
    taints: dict[int, devices.Taint] = {}
    with ApiServerSimulator() as sim:
        sim.add_node("node-a")
        pub = SlicePublisher(sim.client(), node="node-a", driver=DRIVER, content=slice_content(tmp_path, taints))
        calls = _refuse_dry_runs(pub)
        with caplog.at_level("WARNING", logger="gpumanager.dra.publisher"):
            settle(pub, passes=8)
            del calls[:]
            for _ in range(4):
                assert not pub.sync()
        assert calls == [("GET", False)] * 4, calls
        assert _devices(sim) == {"gpu-0": False, "gpu-1": False}
        refused = [r.getMessage() for r in caplog.records if "as a dry run" in r.getMessage()]
        assert len(refused) == 1 and "does not support dry run" in refused[0], refused
        taints[0] = devices.Taint("XID 79", "2026-11-23T00:00:00Z")
        settle(pub, passes=8)
        assert _devices(sim) == {"gpu-0": True, "gpu-1": False}
        assert pub.gates_off == frozenset()

        restarted = SlicePublisher(sim.client(), node="node-a", driver=DRIVER, content=slice_content(tmp_path, taints))
        calls = _refuse_dry_runs(restarted)
        assert settle(restarted, passes=8) == 0, "the stored slice is current"
        del calls[:]
        for _ in range(4):
            assert not restarted.sync()
        assert calls == [("GET", False)] * 4, calls


def test_a_node_without_gpus_makes_no_dry_run(tmp_path: Path) -> None:
    # No device to put a probe taint on: nothing to find out, no call per sync.
    with ApiServerSimulator(disabled_features=[TAINTS]) as sim:
        sim.add_node("node-a")
        whole = slice_content(tmp_path, {})

        def empty(generation: int) -> dict[str, Any]:
            return {**whole(generation), "devices": []}

        pub = SlicePublisher(sim.client(), node="node-a", driver=DRIVER, content=empty)
        settle(pub, passes=8)
        calls = _count_calls(pub)
        for _ in range(3):
            assert not pub.sync()
        assert calls == [("GET", False)] * 3, calls
        assert pub.gates_off == frozenset()
