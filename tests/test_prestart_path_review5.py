"""PreStartContainer's prepared forms match what they stand for: the index of a PodResources List answers
what the plain per-device reading of every entry answers, whatever the answer's shape, and the journal
record of a container now started, made by template, is the encoder's."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpumanager.allocation import journal
from gpumanager.allocation.allocator import _put
from gpumanager.api import podresources_v1_pb2 as pb
from gpumanager.kube.podresources import _Holders
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of

CORE = "tencent.com/vcuda-core"
MEMORY = "tencent.com/vcuda-memory"


def _reference(pods: list[pb.PodResources], resource: str) -> dict[frozenset[str], tuple[str, str, str]]:
    """Each device entry read on its own: a container's lists of the resource joined, the first holder of
    a set named."""
    merged: dict[tuple[str, str, str], list[str]] = {}
    for pod in pods:
        for container in pod.containers:
            for dev in container.devices:
                if dev.resource_name == resource:
                    merged.setdefault((pod.namespace, pod.name, container.name), []).extend(dev.device_ids)
    index: dict[frozenset[str], tuple[str, str, str]] = {}
    for holder, ids in merged.items():
        index.setdefault(frozenset(ids), holder)
    return index


def _devices(resource: str, ids: list[str]) -> pb.ContainerDevices:
    return pb.ContainerDevices(resource_name=resource, device_ids=ids)


def _odd_answer() -> list[pb.PodResources]:
    """NUMA-split lists, a pod listed twice under one name (a pod recreated while the old one ends), two
    containers with the same set, an entry of no IDs, other resources, a container holding nothing."""
    return [
        pb.PodResources(
            namespace="a",
            name="p",
            containers=[
                pb.ContainerResources(
                    name="main", devices=[_devices(CORE, ["c-1"]), _devices(MEMORY, ["m-1"]), _devices(CORE, ["c-2"])]
                ),
                pb.ContainerResources(name="idle", devices=[]),
                pb.ContainerResources(name="side", devices=[_devices(CORE, ["c-3"])]),
            ],
        ),
        pb.PodResources(
            namespace="a",
            name="q",
            containers=[
                pb.ContainerResources(name="main", devices=[_devices(CORE, ["c-3"])]),
                pb.ContainerResources(name="empty", devices=[_devices(CORE, [])]),
                pb.ContainerResources(name="mem", devices=[_devices(MEMORY, ["m-2", "m-3"])]),
            ],
        ),
        pb.PodResources(
            namespace="a",
            name="p",
            containers=[pb.ContainerResources(name="side", devices=[_devices(CORE, ["c-4"])])],
        ),
        pb.PodResources(
            namespace="b",
            name="p",
            containers=[pb.ContainerResources(name="main", devices=[_devices(CORE, ["c-2", "c-1"])])],
        ),
    ]


def test_the_index_of_an_odd_answer_is_the_plain_readings() -> None:
    pods = list(pb.ListPodResourcesResponse(pod_resources=_odd_answer()).pod_resources)
    for resource in (CORE, MEMORY, "example.com/other"):
        want = _reference(pods, resource)
        holders = _Holders(pods)
        for ids in [*want, frozenset({"c-3", "c-4"}), frozenset({"c-4"}), frozenset()]:
            assert holders.holder(resource, ids) == want.get(ids), (resource, ids)
    holders = _Holders(pods)
    assert holders.holder(CORE, frozenset({"c-1", "c-2"})) == ("a", "p", "main")  # split lists, first holder
    assert holders.holder(CORE, frozenset({"c-3", "c-4"})) == ("a", "p", "side")  # one name, two entries
    assert holders.holder(CORE, frozenset()) == ("a", "q", "empty")


def _random_pods(
    rng: random.Random, last_id: int, container_name: Callable[[int], str], pod_names: Sequence[str]
) -> list[pb.PodResources]:
    """Up to six pods in namespaces x and y named from pod_names, each of up to three containers (the c-th named
    container_name(c)) holding up to three device lists of core or memory IDs d-0 to d-<last_id>."""
    pods = []
    for _p in range(rng.randint(0, 6)):
        containers = []
        for c in range(rng.randint(0, 3)):
            devices = [
                _devices(rng.choice((CORE, MEMORY)), [f"d-{rng.randint(0, last_id)}" for _ in range(rng.randint(0, 2))])
                for _d in range(rng.randint(0, 3))
            ]
            containers.append(pb.ContainerResources(name=container_name(c), devices=devices))
        pods.append(pb.PodResources(namespace=rng.choice("xy"), name=rng.choice(pod_names), containers=containers))
    return pods


def test_the_index_of_random_answers_is_the_plain_readings() -> None:
    rng = random.Random(5)
    for _ in range(200):
        pods = _random_pods(rng, 5, lambda c: f"c{c % 2}", "pq")
        listed = list(pb.ListPodResourcesResponse(pod_resources=pods).pod_resources)
        want = _reference(listed, CORE)
        holders = _Holders(listed)
        for ids in want:
            assert holders.holder(CORE, ids) == want[ids]
        assert holders.holder(CORE, frozenset({"none"})) is None


def test_a_started_containers_journal_record_is_the_encoders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PreStartContainer's record of a container now started, made by template, is what the encoder writes
    of the change; and the loaded state shows it started."""
    staged: list[tuple[Mapping[str, Any], str | None]] = []
    record = journal._record

    def seen(change: Mapping[str, Any], text: str | None = None) -> bytes:
        staged.append((change, text))
        return record(change, text)

    pods = FakePods([make_pod("a", [("c", 50, 4)])])
    alloc = make_allocator(tmp_path, pods)
    ids = core_ids(0, 50)
    alloc.allocate(ids)
    monkeypatch.setattr(journal, "_record", seen)
    started = alloc.pre_start(ids, (uid_of("a"), "c"))
    assert started.started
    assert len(staged) == 1 and staged[0][1] is not None
    change, text = staged[0]
    assert change == _put(started)
    assert record(change, text) == record(change)
    monkeypatch.setattr(journal, "_record", record)
    again = make_allocator(tmp_path, FakePods(pods.items))
    again.load()
    loaded = again.get(uid_of("a"), "c")
    assert loaded is not None and loaded.started and loaded.device_ids == started.device_ids


def _first_lookups(pods: list[pb.PodResources], resource: str, asked: list[frozenset[str]]) -> None:
    """Each set asked first of a fresh answer (the look at the few pods whose bytes hold an ID), then a
    second set of the same answer (the whole index): both what the plain readings say."""
    reply = pb.ListPodResourcesResponse(pod_resources=pods)
    want = _reference(list(reply.pod_resources), resource)
    for ids in asked:
        holders = _Holders.of_list(pb.ListPodResourcesResponse.FromString(reply.SerializeToString()))
        assert holders.holder(resource, ids) == want.get(ids), (resource, ids)
        assert holders.holder(resource, ids) == want.get(ids), (resource, ids)  # asked again: the same
        other = frozenset({"c-1", "c-2"})
        assert holders.holder(resource, other) == want.get(other), (resource, ids)


def test_a_first_lookup_reads_few_pods_and_answers_as_the_index() -> None:
    pods = [
        pb.PodResources(
            namespace="ns",
            name=f"p-{i}",
            containers=[pb.ContainerResources(name="main", devices=[_devices(CORE, [f"c-{i}", f"c-{i}0"])])],
        )
        for i in range(1, 13)
    ]
    reply = pb.ListPodResourcesResponse(pod_resources=pods)
    holders = _Holders.of_list(reply)
    assert holders.holder(CORE, frozenset({"c-1", "c-10"})) == ("ns", "p-1", "main")  # c-1 is in c-10, c-11, c-12
    assert holders._by_resource == {}, "no whole index for the first lookup"
    assert holders.holder(CORE, frozenset({"c-1", "c-10"})) == ("ns", "p-1", "main")
    assert holders._by_resource == {}
    assert holders.holder(CORE, frozenset({"c-12", "c-120"})) == ("ns", "p-12", "main")
    assert CORE in holders._by_resource, "the second lookup of the answer indexes it"
    _first_lookups(
        pods,
        CORE,
        [frozenset({"c-1"}), frozenset({"c-12", "c-120"}), frozenset({"c-3", "c-30", "c-4"}), frozenset({"x"})],
    )


def test_a_first_lookup_of_an_odd_answer_answers_as_the_index() -> None:
    odd = _odd_answer()
    asked = [
        frozenset({"c-1", "c-2"}),
        frozenset({"c-3"}),
        frozenset({"c-3", "c-4"}),
        frozenset({"c-4"}),
        frozenset({"m-1"}),
        frozenset({"m-2", "m-3"}),
        frozenset(),
        frozenset({"\udcff"}),  # no UTF-8 for it
    ]
    for resource in (CORE, MEMORY):
        _first_lookups(odd, resource, asked)
    twice = [  # one container listed twice in a pod, a pod without a name, a name also a container's
        pb.PodResources(
            namespace="n",
            name="main",
            containers=[
                pb.ContainerResources(name="main", devices=[_devices(CORE, ["u-1"])]),
                pb.ContainerResources(name="main", devices=[_devices(CORE, ["u-2"])]),
            ],
        ),
        pb.PodResources(
            namespace="n", name="", containers=[pb.ContainerResources(name="c", devices=[_devices(CORE, ["u-3"])])]
        ),
        pb.PodResources(
            namespace="n", name="", containers=[pb.ContainerResources(name="c", devices=[_devices(CORE, ["u-4"])])]
        ),
        pb.PodResources(
            namespace="n",
            name="\u00fc",
            containers=[pb.ContainerResources(name="c", devices=[_devices(CORE, ["\u00e9"])])],
        ),
    ]
    _first_lookups(
        twice,
        CORE,
        [
            frozenset({"u-1"}),
            frozenset({"u-1", "u-2"}),
            frozenset({"u-3"}),
            frozenset({"u-3", "u-4"}),
            frozenset({"\u00e9"}),
        ],
    )


def test_a_first_lookup_of_random_answers_answers_as_the_index() -> None:
    rng = random.Random(7)
    for _ in range(300):
        pods = _random_pods(rng, 12, lambda _c: rng.choice(["c0", "c1", "d-1"]), ["p", "q", "d-1", ""])
        reply = pb.ListPodResourcesResponse(pod_resources=pods)
        want = _reference(list(reply.pod_resources), CORE)
        asked = [*want, *(frozenset(rng.sample([f"d-{i}" for i in range(13)], rng.randint(1, 3))) for _ in range(3))]
        _first_lookups(pods, CORE, asked)
