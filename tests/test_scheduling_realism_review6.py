"""Two extender replicas as a real cluster has them: clocks that disagree, watches that lag, and a filter
that must not pass a node the other replica's recorded choices fill."""

from __future__ import annotations

import time
from typing import Any

import pytest

from gpumanager import names
from gpumanager.extender import claims
from gpumanager.extender.nodes import Charge
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


def test_filter_counts_the_choices_another_replica_recorded_on_the_node(world: World) -> None:
    """The other replica chose 60 % of the only GPU of ``full`` (recorded on the node; its pod's
    annotations not shown by this replica's watch yet): filter sends the pod to ``free``, not to a
    bind that can only refuse, again and again while the record lasts."""
    world.add_node("full", inventory([16]))
    world.add_node("free", inventory([16]))
    world.start_extender()
    _note_node(world, "full", _other_replicas_choice(time.time()))
    _watch_shows_note(world, "full")
    pod = world.create(gpu_pod("p", [(60, 4)]))
    assert world.passed(pod) == ["free"]
    scores = world.scores(pod)
    assert scores["full"] == 0 and scores["free"] > 0, scores


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
