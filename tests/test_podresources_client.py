"""The PodResources client against the kubelet simulator's server: owners of device IDs, Get then List."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from gpumanager.api import podresources_v1_pb2 as pb
from gpumanager.api import podresources_v1_pb2_grpc as pb_grpc
from gpumanager.kube.owners import OwnerResolver
from gpumanager.kube.podresources import (
    GET_RESERVE,
    KUBELET_BURST,
    CallBudget,
    PodResourcesClient,
    PodResourcesUnavailableError,
)


class _Lister(pb_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    """A kubelet that splits a container's devices by NUMA node, as the real one does."""

    def __init__(self, with_get: bool) -> None:
        self.with_get = with_get
        self.calls: list[str] = []
        numa0 = pb.TopologyInfo(nodes=[pb.NUMANode(ID=0)])
        numa1 = pb.TopologyInfo(nodes=[pb.NUMANode(ID=1)])
        self.pod = pb.PodResources(
            name="train",
            namespace="ml",
            containers=[
                pb.ContainerResources(
                    name="main",
                    devices=[
                        pb.ContainerDevices(resource_name="r", device_ids=["a", "b"], topology=numa0),
                        pb.ContainerDevices(resource_name="r", device_ids=["c"], topology=numa1),
                        pb.ContainerDevices(resource_name="other", device_ids=["x"]),
                    ],
                )
            ],
        )

    def List(self, request: object, context: grpc.ServicerContext) -> pb.ListPodResourcesResponse:
        self.calls.append("List")
        return pb.ListPodResourcesResponse(pod_resources=[self.pod])

    def Get(self, request: pb.GetPodResourcesRequest, context: grpc.ServicerContext) -> pb.GetPodResourcesResponse:
        self.calls.append("Get")
        if not self.with_get:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "no Get")
        if (request.pod_namespace, request.pod_name) != ("ml", "train"):
            context.abort(grpc.StatusCode.NOT_FOUND, "no such pod")
        return pb.GetPodResourcesResponse(pod_resources=self.pod)


@contextlib.contextmanager
def serving(
    lister: _Lister, sock: Path, workers: int = 2, budget: CallBudget | None = None
) -> Iterator[PodResourcesClient]:
    """``lister`` served on ``sock`` and a client of it."""
    server = grpc.server(futures.ThreadPoolExecutor(workers))
    pb_grpc.add_PodResourcesListerServicer_to_server(lister, server)
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    client = PodResourcesClient(sock, budget=budget)
    try:
        yield client
    finally:
        client.close()
        server.stop(0)


@pytest.fixture(params=[True, False], ids=["with-get", "list-only"])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[PodResourcesClient, _Lister]]:
    lister = _Lister(request.param)
    with serving(lister, tmp_path / "kubelet.sock") as client:
        yield client, lister


def test_devices_split_by_numa_are_one_owner(served: tuple[PodResourcesClient, _Lister]) -> None:
    client, lister = served
    assert client.owner_of("r", ["c", "a", "b"], hint=("ml", "train")) == ("ml", "train", "main")
    assert lister.calls[0] == "Get"
    assert ("List" in lister.calls) is (not lister.with_get)
    assert client.owner_of("r", ["a", "b"]) is None
    assert client.owner_of("other", ["x"], hint=("ml", "nope")) == ("ml", "train", "main")


def test_missing_socket_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(PodResourcesUnavailableError, match="does not exist"):
        PodResourcesClient(tmp_path / "absent.sock").list_all()


def test_concurrent_lookups_ask_get_while_the_kubelets_tokens_last_then_share_a_list(tmp_path: Path) -> None:
    """Fifty PreStartContainer calls at once must not cost fifty calls (the kubelet allows 10 at once):
    Gets while our reckoning of its tokens leaves a reserve, then one List for all the others."""
    release = threading.Event()

    class Slow(_Lister):
        def List(self, request: object, context: grpc.ServicerContext) -> pb.ListPodResourcesResponse:
            release.wait(30)
            return super().List(request, context)  # which counts it

        def Get(self, request: pb.GetPodResourcesRequest, context: grpc.ServicerContext) -> pb.GetPodResourcesResponse:
            self.calls.append("Get")
            release.wait(30)
            context.abort(grpc.StatusCode.NOT_FOUND, "no such pod")

    lister = Slow(with_get=True)
    frozen = CallBudget(clock=lambda: 0.0)  # no token comes back during the test
    gets = KUBELET_BURST - GET_RESERVE
    with serving(lister, tmp_path / "kubelet.sock", workers=64, budget=frozen) as client:
        answers: list[tuple[str, str, str] | None] = []
        threads = [
            threading.Thread(target=lambda: answers.append(client.owner_of("r", ["a", "b", "c"], hint=("ml", "wrong"))))
            for _ in range(20)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        # Every lookup is in: the first (alone) and those that found a token ask Get for their hint,
        # the others wait for one List.
        while client.waiting_for_list < 20 - gets or lister.calls.count("Get") < gets:
            assert time.monotonic() < deadline, (client.waiting_for_list, lister.calls)
            time.sleep(0.001)
        release.set()
        for t in threads:
            t.join(30)
    assert answers == [("ml", "train", "main")] * 20
    assert lister.calls.count("Get") == gets
    # The lookups that waited share the first List or the one after it; each Get caller, its hint wrong,
    # needs a List made after that, which those coming back together share: never one call a lookup.
    assert lister.calls.count("List") <= 2 + gets, lister.calls
    assert len(lister.calls) < 20, lister.calls


def test_a_get_refused_for_the_rate_limit_is_answered_by_a_list(tmp_path: Path) -> None:
    class Limited(_Lister):
        def Get(self, request: pb.GetPodResourcesRequest, context: grpc.ServicerContext) -> pb.GetPodResourcesResponse:
            self.calls.append("Get")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")

    lister = Limited(with_get=True)
    with serving(lister, tmp_path / "kubelet.sock") as client:
        assert client.owner_of("r", ["a", "b", "c"], hint=("ml", "train")) == ("ml", "train", "main")
    assert lister.calls == ["Get", "List"]


def test_the_budget_refills_at_the_kubelets_rate() -> None:
    now = [0.0]
    budget = CallBudget(qps=100, burst=10, clock=lambda: now[0])
    assert [budget.take(keep=3) for _ in range(8)] == [True] * 7 + [False]
    assert [budget.take() for _ in range(4)] == [True] * 3 + [False]
    now[0] += 0.025  # two and a half tokens
    assert [budget.take() for _ in range(3)] == [True, True, False]
    now[0] += 10.0  # never more than the burst
    assert sum(budget.take() for _ in range(20)) == 10


def test_each_lookup_reads_a_list_made_after_it_asked(tmp_path: Path) -> None:
    """The index of a List answer serves the lookups that share that answer, never a later lookup."""
    lister = _Lister(with_get=False)
    with serving(lister, tmp_path / "kubelet.sock") as client:
        assert client.owner_of("r", ["a", "b", "c"]) == ("ml", "train", "main")
        assert client.owner_of("other", ["x"]) == ("ml", "train", "main")
        lister.pod.name = "train-2"  # the kubelet gave the same devices to a new pod
        assert client.owner_of("r", ["c", "b", "a"]) == ("ml", "train-2", "main")
        assert client.owner_of("r", ["a", "b"]) is None, "exactly the IDs, not a subset"
    assert lister.calls.count("List") == 4


def test_many_holders_in_one_list(tmp_path: Path) -> None:
    lister = _Lister(with_get=False)
    pods = [
        pb.PodResources(
            name=f"p{i}",
            namespace="ns",
            containers=[
                pb.ContainerResources(
                    name=c,
                    devices=[
                        pb.ContainerDevices(resource_name="r", device_ids=[f"{i}{c}0"]),
                        pb.ContainerDevices(resource_name="r", device_ids=[f"{i}{c}1"]),
                        pb.ContainerDevices(resource_name="other", device_ids=[f"{i}{c}x"]),
                    ],
                )
                for c in ("a", "b")
            ],
        )
        for i in range(50)
    ]
    lister.List = lambda request, context: pb.ListPodResourcesResponse(pod_resources=pods)  # type: ignore[method-assign]
    with serving(lister, tmp_path / "kubelet.sock") as client:
        for i in (0, 17, 49):
            for c in ("a", "b"):
                assert client.owner_of("r", [f"{i}{c}1", f"{i}{c}0"]) == ("ns", f"p{i}", c)
                assert client.owner_of("other", [f"{i}{c}x"]) == ("ns", f"p{i}", c)
                assert client.owner_of("r", [f"{i}{c}x"]) is None, "another resource's IDs"


def test_a_lookup_with_since_uses_a_list_made_after_the_allocate_when_it_shows_a_trusted_holder(
    tmp_path: Path,
) -> None:
    """The kubelet gives a container only IDs no other app container holds, so a List made after their
    Allocate reached us that shows them held names the holder: it serves later PreStarts too."""
    lister = _Lister(with_get=False)
    with serving(lister, tmp_path / "kubelet.sock") as client:
        allocated = time.monotonic()
        assert client.owner_of("r", ["a", "b", "c"]) == ("ml", "train", "main")
        assert lister.calls == ["List"]
        assert client.owner_of("r", ["c", "b", "a"], since=allocated) == ("ml", "train", "main")
        assert lister.calls == ["List"], "a List made since the Allocate was asked again"
        # A holder the caller does not trust (an init container, whose IDs the kubelet hands on):
        # a new List is asked for.
        trusted: list[tuple[str, str, str]] = []
        assert client.owner_of("r", ["a", "b", "c"], since=allocated, trust=lambda h: bool(trusted.append(h))) == (
            "ml",
            "train",
            "main",
        )
        assert trusted == [("ml", "train", "main")] and lister.calls == ["List"] * 2
        # IDs allocated after the newest List started: that List cannot show their holder.
        lister.pod.name = "train-2"
        allocated = time.monotonic()
        assert client.owner_of("r", ["a", "b", "c"], since=allocated) == ("ml", "train-2", "main")
        assert lister.calls == ["List"] * 3
        # A List made since that does not show the IDs held: a new one, made after this lookup asked.
        assert client.owner_of("r", ["a", "b"], since=allocated) is None
        assert lister.calls == ["List"] * 4


def test_the_owner_resolver_trusts_an_early_list_only_for_an_app_container_of_a_pod_it_knows(tmp_path: Path) -> None:
    """The kubelet hands an init container's IDs on to its pod's next containers, so an init container
    shown holding them in a List made before this container's record names the wrong container."""
    lister = _Lister(with_get=False)
    spec: dict[str, object] = {"containers": [{"name": "main"}]}
    known = {"uid": "u-1"}

    def find_pod(namespace: str, name: str, listed: float | None) -> dict[str, object] | None:
        if (namespace, name) != ("ml", "train") or not known:
            return None
        return {"metadata": {"uid": known["uid"], "name": name, "namespace": namespace}, "spec": spec}

    with serving(lister, tmp_path / "kubelet.sock") as client:
        owners = OwnerResolver(
            pod_resources=client, kubelet_checkpoint_path=tmp_path / "absent-checkpoint", find_pod=find_pod
        )
        allocated = time.monotonic()
        assert owners.owner("r", ["a", "b", "c"], None, allocated) == ("u-1", "main")
        assert owners.owner("r", ["a", "b", "c"], None, allocated) == ("u-1", "main")
        assert lister.calls == ["List"], "an app container's holding, listed since the Allocate, is trusted"
        spec["initContainers"], spec["containers"] = [{"name": "main"}], [{"name": "app"}]
        assert owners.owner("r", ["a", "b", "c"], None, allocated) == ("u-1", "main")
        assert lister.calls == ["List"] * 2, "an init container's holding was trusted"
        spec["initContainers"], spec["containers"] = [], [{"name": "main"}]
        known.clear()  # the pod cache does not know the pod (yet)
        assert owners.owner("r", ["a", "b", "c"], None, allocated) is None
        assert lister.calls == ["List"] * 3


def test_the_first_call_after_the_kubelet_is_back_is_answered(tmp_path: Path) -> None:
    """The kubelet is down for a while (an upgrade) and the agent keeps asking; then it serves again on the
    same path. A long-lived channel waits out its reconnect backoff (grown to seconds, up to two minutes
    after a long outage) and fails every call meanwhile: the first call after the kubelet is back must get
    its answer."""
    sock = tmp_path / "kubelet.sock"
    lister = _Lister(with_get=True)

    def start() -> grpc.Server:
        server = grpc.server(futures.ThreadPoolExecutor(2))
        pb_grpc.add_PodResourcesListerServicer_to_server(lister, server)
        server.add_insecure_port(f"unix://{sock}")
        server.start()
        return server

    server = start()
    client = PodResourcesClient(sock)
    try:
        assert client.list_all()
        server.stop(None).wait()
        sock.unlink(missing_ok=True)
        stale = socket.socket(socket.AF_UNIX)  # a socket nobody listens on, as a killed kubelet leaves it
        stale.bind(str(sock))
        stale.close()
        failures = 0
        end = time.monotonic() + 6.0  # long enough for the backoff to grow past 2.5 s
        while time.monotonic() < end:
            with pytest.raises(PodResourcesUnavailableError):
                client.list_all()
            failures += 1
            time.sleep(0.2)
        sock.unlink()
        server = start()
        answered = client.list_all()  # no retry: the first call
        assert [d.resource for d in answered if d.resource == "other"] == ["other"], answered
        assert failures > 10
    finally:
        client.close()
        server.stop(None)


@pytest.mark.parametrize("call", ["list", "get"])
def test_a_channel_closed_under_a_call_is_an_unavailable_kubelet(
    served: tuple[PodResourcesClient, _Lister], monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """Another lookup found the kubelet gone and dropped the channel between this call's taking it and its RPC:
    grpc raises ValueError for a closed channel, which must reach callers as the kubelet being unavailable (what
    recovery and PreStartContainer fall back on), never as an error nobody catches."""
    client, _lister = served
    assert client.list_all()
    taken = client._stub

    def taken_then_closed() -> object:
        stub = taken()
        client.close()
        return stub

    monkeypatch.setattr(client, "_stub", taken_then_closed)
    with pytest.raises(PodResourcesUnavailableError, match=r"PodResources (List|Get) on .*kubelet\.sock failed"):
        if call == "list":
            client.list_all()
        else:
            client.get("ml", "train")
    monkeypatch.undo()
    assert client.list_all()  # the next call dials afresh
