"""filter's reasons fold: nodes that fail for the same cause get the same reason.

The kube-scheduler counts equal reasons together in the pod's condition and FailedScheduling event
("0/1000 nodes are available: 600 container 'c0' needs ..."). A reason carrying the node's own
figures (its best GPU's free cores and MiB, the minors of its free or unhealthy GPUs, the size the
node's capacity was divided into, the pods whose binds were recorded on it) is different on every
node of a fragmented cluster, and the message lists a reason per node. The figures go to the
extender's debug log (and bind's refusal, which is about one node).
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from typing import Any

import pytest

from gpumanager import names
from gpumanager.extender.api import encode, parse_args
from gpumanager.extender.decisions import Decider
from gpumanager.extender.state import ClusterState
from simnode.apiserver_objects import node_object
from tests.extender_fixtures import BLOCK, GIB, gpu_pod, held, inventory

GPUS = 8
NODES = 1000
SHARE = (50, 40 * GIB // BLOCK)  # 50 cores, 40 GiB (40960 MiB) on one GPU
NEED = "container 'c0' needs 50 cores and 40960 MiB on one GPU"


def _blocks(gib: float) -> int:
    return max(1, round(gib * GIB / BLOCK))


def _gpu_loads(kind: int, rng: random.Random) -> list[tuple[int, int]]:
    """(cores, blocks) held on each of the 8 GPUs (80 GiB each) of a node of this kind; (100, 0): whole."""
    if kind == 0:  # cores short on every GPU: 1-49 cores free, 60+ GiB free
        return [(rng.randint(51, 99), _blocks(rng.uniform(1, 20))) for _ in range(GPUS)]
    if kind == 1:  # memory fragmented: 6-39 GiB free on each GPU, 48+ GiB free in all
        return [(rng.randint(1, 40), _blocks(80 - rng.uniform(6, 39))) for _ in range(GPUS)]
    if kind == 2:  # memory short: 0.5-4.5 GiB free on each GPU, less than 40 GiB in all
        return [(rng.randint(1, 40), _blocks(80 - rng.uniform(0.5, 4.5))) for _ in range(GPUS)]
    # kind 3: cores on one GPU, memory on another, the others taken whole
    cores_gpu = [(rng.randint(1, 40), _blocks(80 - rng.uniform(1, 30)))]  # 60+ cores, < 40 GiB
    memory_gpu = [(rng.randint(60, 99), _blocks(rng.uniform(1, 30)))]  # < 40 cores, 50+ GiB
    loads = cores_gpu + memory_gpu + [(100, 0)] * (GPUS - 2)
    rng.shuffle(loads)
    return loads


def _cluster(rng: random.Random) -> tuple[ClusterState, list[dict[str, Any]], dict[str, int]]:
    state = ClusterState()
    nodes: list[dict[str, Any]] = []
    kinds: dict[str, int] = {}
    for n in range(NODES):
        name = f"node-{n:04d}"
        kind = n % 5
        kinds[name] = kind
        if kind == 4:  # judged by capacity (no inventory): 2-8 GPUs of 16-39 GiB each, each node its own size
            count = 2 + n % 7
            blocks = _blocks(16 + (n % 23))
            capacity = {names.VCORE_RESOURCE: str(100 * count), names.VMEMORY_RESOURCE: str(blocks * count)}
            obj = node_object(name, capacity=capacity)
        else:
            sick = rng.sample(range(GPUS), rng.randint(1, 3)) if n % 10 == 0 else []
            obj = node_object(name, annotations={"tencent.com/gpu-inventory": inventory([80] * GPUS, unhealthy=sick)})
        state.node_event("ADDED", obj)
        nodes.append(obj)
        if kind == 4:
            continue
        for gpu, (cores, blocks) in enumerate(_gpu_loads(kind, rng)):
            limits = (100, 0) if cores == 100 else (cores, blocks)
            pod = gpu_pod(f"{name}-{gpu}", [limits], node=name, annotations=held(name, [[gpu]]), phase="Running")
            state.pod_event("ADDED", pod)
    return state, nodes, kinds


@pytest.fixture(scope="module")
def cluster() -> tuple[ClusterState, list[dict[str, Any]], dict[str, int]]:
    return _cluster(random.Random(12))


def _filter(decider: Decider, pod: dict[str, Any], nodes: list[dict[str, Any]]) -> dict[str, Any]:
    body = json.dumps({"Pod": pod, "Nodes": {"items": nodes}, "NodeNames": None}).encode()
    result, _ = decider.filter(parse_args(body))
    answer: dict[str, Any] = json.loads(encode(result))
    return answer


def _reasons(answer: dict[str, Any]) -> dict[str, str]:
    return {**answer["FailedNodes"], **answer["FailedAndUnresolvableNodes"]}


def _event(reasons: dict[str, str]) -> str:
    """The scheduler's FailedScheduling message: equal reasons counted together, sorted."""
    folded = sorted(f"{count} {reason}" for reason, count in Counter(reasons.values()).items())
    return f"0/{len(reasons)} nodes are available: " + ", ".join(folded) + "."


def test_a_share_refused_by_1000_fragmented_nodes_gets_a_handful_of_reasons(
    cluster: tuple[ClusterState, list[dict[str, Any]], dict[str, int]],
) -> None:
    state, nodes, kinds = cluster
    answer = _filter(Decider(state, "binpack"), gpu_pod("big", [SHARE]), nodes)
    assert answer["Nodes"]["items"] == [], "no node should hold the share"
    reasons = _reasons(answer)
    assert len(reasons) == NODES
    distinct = set(reasons.values())
    assert len(distinct) <= 8, "\n".join(sorted(distinct)[:20])
    assert len(_event(reasons)) < 2000, _event(reasons)
    for reason in distinct:  # each says what the pod needs, and not a node's own figures
        assert reason.startswith(NEED), reason
        assert "best GPU" not in reason and "unhealthy: [" not in reason, reason
    by_kind: dict[int, set[str]] = {}
    for name, reason in reasons.items():
        by_kind.setdefault(kinds[name], set()).add(reason)
    # What is missing, for each cause.
    assert all("no GPU has 50 free cores" in r for r in by_kind[0]), by_kind[0]
    assert all("GPU memory fragmented" in r and "40960 MiB" in r for r in by_kind[1]), by_kind[1]
    assert all("no GPU has 40960 MiB free" in r for r in by_kind[2]), by_kind[2]
    assert all("no single GPU has both" in r for r in by_kind[3]), by_kind[3]
    assert all("no GPU of the node has 40960 MiB" in r and "capacity" in r for r in by_kind[4]), by_kind[4]
    assert len(by_kind[4]) == 1, by_kind[4]  # whatever size each node's capacity was divided into
    # Unhealthy GPUs are said, the same way on every node that has some.
    sick = {reasons[n] for n in kinds if int(n[-4:]) % 10 == 0}
    assert sick and all("unhealthy" in r for r in sick), sick
    # Resolvable (preempting may help) and unresolvable (never fits) as before.
    assert all(kinds[n] == 4 for n in answer["FailedAndUnresolvableNodes"])


def test_whole_gpus_refused_by_1000_nodes_get_a_handful_of_reasons(
    cluster: tuple[ClusterState, list[dict[str, Any]], dict[str, int]],
) -> None:
    state, nodes, _ = cluster
    answer = _filter(Decider(state, "binpack"), gpu_pod("three", [(300, 0)]), nodes)
    reasons = _reasons(answer)
    distinct = set(reasons.values())
    assert 0 < len(distinct) <= 6, "\n".join(sorted(distinct)[:20])
    for reason in distinct:
        assert reason.startswith("container 'c0' needs 3 whole GPU(s): "), reason
        assert "[" not in reason, reason  # no list of the node's free or unhealthy minors


def test_the_figures_of_each_node_go_to_the_debug_log(caplog: pytest.LogCaptureFixture) -> None:
    state = ClusterState()
    node = node_object("n", annotations={"tencent.com/gpu-inventory": inventory([80, 80])})
    state.node_event("ADDED", node)
    for gpu in (0, 1):
        state.pod_event("ADDED", gpu_pod(f"p{gpu}", [(60, 4)], node="n", annotations=held("n", [[gpu]])))
    pod = gpu_pod("big", [SHARE])
    with caplog.at_level(logging.DEBUG, logger="gpumanager.extender.decisions"):
        answer = _filter(Decider(state, "binpack"), pod, [node])
    assert answer["FailedNodes"]["n"] == f"{NEED}: no GPU has 50 free cores", answer
    assert "node n" in caplog.text and "GPU 0: 40 cores / 80896 MiB free of 81920 MiB" in caplog.text, caplog.text
