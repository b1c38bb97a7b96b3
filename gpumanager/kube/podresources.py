"""Client of the kubelet's PodResources v1 API: which pod and container hold given device IDs."""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gpumanager.api import podresources_v1_pb2 as pb
from gpumanager.api import podresources_v1_pb2_grpc as pb_grpc
from gpumanager.kube.shared_call import SharedCall

log = logging.getLogger(__name__)


#: The kubelet's rate limit on PodResources calls (its DefaultQPS and DefaultBurstTokens): a token
#: bucket refilled at 100 a second that holds at most 10; a call without a token is refused.
KUBELET_QPS = 100.0
KUBELET_BURST = 10
#: What a kubelet whose KubeletPodResourcesGet feature gate is off answers every Get with (code Unknown).
GET_DISABLED = "PodResources API Get method disabled"
#: Tokens a lookup leaves, when others are in progress, for the List they share and for the
#: kubelet's other clients (monitoring agents list pods too).
GET_RESERVE = 3


class PodResourcesUnavailableError(RuntimeError):
    """The PodResources socket is missing or does not answer."""


class PodResourcesBusyError(PodResourcesUnavailableError):
    """The kubelet refused a call for its rate limit (ResourceExhausted)."""


class CallBudget:
    """Our reckoning of the kubelet's token bucket for the calls this client makes.

    The kubelet's bucket also pays for other clients' calls, so this is an upper bound: a call it
    allows may still be refused, and is then answered another way.
    """

    def __init__(
        self, qps: float = KUBELET_QPS, burst: int = KUBELET_BURST, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._qps = qps
        self._burst = float(burst)
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()
        self._lock = threading.Lock()

    def take(self, *, keep: int = 0) -> bool:
        """Take a token if one is left beyond ``keep``; whether one was taken."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self._burst, self._tokens + (now - self._at) * self._qps)
            self._at = now
            if self._tokens - 1 < keep:
                return False
            self._tokens -= 1
            return True


@dataclass(frozen=True)
class ContainerDevices:
    """Device IDs of one resource held by one container."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


def _flatten(pods: Iterable[pb.PodResources]) -> list[ContainerDevices]:
    """One entry per (pod, container, resource): the kubelet splits a container's devices by NUMA node."""
    merged: dict[tuple[str, str, str, str], list[str]] = {}
    for pod in pods:
        for container in pod.containers:
            for dev in container.devices:
                key = (pod.namespace, pod.name, container.name, dev.resource_name)
                merged.setdefault(key, []).extend(dev.device_ids)
    return [
        ContainerDevices(namespace=ns, pod=name, container=c, resource=r, device_ids=tuple(ids))
        for (ns, name, c, r), ids in merged.items()
    ]


class _Holders:
    """Who holds which device IDs in one List answer, indexed per resource when first asked: the
    lookups sharing the answer (fifty PreStartContainer calls at once) index it once, not each.

    The first lookup of an answer (most often the only one: a pod started alone) reads only the pods
    whose bytes hold one of its IDs, found in the answer's encoding, when that gives the index's answer
    for certain; reading every device entry costs about 5 us a pod."""

    def __init__(self, pods: Iterable[pb.PodResources], encoded: Callable[[], bytes] | None = None) -> None:
        self._pods = pods
        self._encoded = encoded  # the answer's wire encoding, made when first needed
        self._lock = threading.Lock()
        self._by_resource: dict[str, dict[frozenset[str], tuple[str, str, str]]] = {}
        self._looked: dict[tuple[str, frozenset[str]], tuple[str, str, str] | None] = {}

    @classmethod
    def of_list(cls, reply: pb.ListPodResourcesResponse) -> _Holders:
        """The holders of a List answer."""
        return cls(reply.pod_resources, reply.SerializeToString)

    def holder(self, resource: str, device_ids: frozenset[str]) -> tuple[str, str, str] | None:
        """(namespace, pod name, container) holding exactly ``device_ids`` of ``resource``."""
        with self._lock:
            index = self._by_resource.get(resource)
            if index is None:
                key = (resource, device_ids)
                if key in self._looked:
                    return self._looked[key]
                if not self._looked and self._encoded is not None:
                    certain, found = self._targeted(resource, device_ids)
                    if certain:
                        self._looked[key] = found
                        return found
                index = self._by_resource[resource] = self._index(resource)
        return index.get(device_ids)

    def _targeted(self, resource: str, device_ids: frozenset[str]) -> tuple[bool, tuple[str, str, str] | None]:
        """(True, the index's answer for ``device_ids``) from the few pods whose encoding holds one of
        them; (False, None) when that is not certain (the whole index is made then)."""
        assert self._encoded is not None
        unsure = (False, None)
        if not device_ids:
            return unsure
        try:
            wanted = next(iter(device_ids)).encode()
        except UnicodeError:
            return unsure
        data = self._encoded()
        at = data.find(wanted)
        if at < 0:
            return (True, None)  # a holder of these IDs names this one: its bytes are in the answer
        starts = _pod_starts(data)
        if starts is None:
            return unsure
        pods = self._pods if isinstance(self._pods, Sequence) else list(self._pods)
        if len(pods) != len(starts):
            return unsure
        holding: list[int] = []  # the pods whose bytes hold the ID, in the answer's order
        while at >= 0:
            i = bisect.bisect_right(starts, at) - 1
            if i >= 0 and (not holding or holding[-1] != i):
                holding.append(i)
            at = data.find(wanted, at + 1)
        for i in holding:
            pod = pods[i]
            name = pod.name.encode()
            # A container's lists of one pod are joined with those of any other pod of the same namespace
            # and name: the name's field met once in the whole answer says there is none.
            field = b"\x0a" + _varint(len(name)) + name
            first = data.find(field) if name else -1
            if first < 0 or data.find(field, first + 1) >= 0:
                return unsure
            merged: dict[str, list[str]] = {}
            for container in pod.containers:
                held = [dev.device_ids for dev in container.devices if dev.resource_name == resource]
                if held:
                    merged.setdefault(container.name, []).extend(x for each in held for x in each)
            for container_name, ids in merged.items():
                if frozenset(ids) == device_ids:
                    return (True, (pod.namespace, pod.name, container_name))
        return (True, None)

    def _index(self, resource: str) -> dict[frozenset[str], tuple[str, str, str]]:
        # Each field read of a message makes a Python object: a container's entries of the resource are
        # picked in one comprehension, and the pod's names read once, only for a pod holding some.
        merged: dict[tuple[str, str, str], list[str]] = {}  # a container's NUMA-split lists, joined
        for pod in self._pods:
            names: tuple[str, str] | None = None
            for container in pod.containers:
                held = [dev.device_ids for dev in container.devices if dev.resource_name == resource]
                if not held:
                    continue
                if names is None:
                    names = (pod.namespace, pod.name)
                key = (names[0], names[1], container.name)
                ids = merged.get(key)
                if ids is None:
                    ids = merged[key] = []
                for each in held:
                    ids.extend(each)
        index: dict[frozenset[str], tuple[str, str, str]] = {}
        for holder, ids in merged.items():
            index.setdefault(frozenset(ids), holder)
        return index


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _pod_starts(data: bytes) -> list[int] | None:
    """Where each PodResources of an encoded ListPodResourcesResponse starts, in order (each ends where
    the next one's tag is); None when the encoding holds anything else (another field, a tag of more
    bytes)."""
    starts: list[int] = []
    pos, size = 0, len(data)
    while pos < size:
        if data[pos] != 0x0A:  # field 1 (pod_resources), length-delimited
            return None
        pos += 1
        length = shift = 0
        while True:
            if pos >= size or shift > 63:
                return None
            byte = data[pos]
            pos += 1
            length |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
        end = pos + length
        if end > size:
            return None
        starts.append(pos)
        pos = end
    return starts


class PodResourcesClient:
    """Asks the kubelet (``/var/lib/kubelet/pod-resources/kubelet.sock``) over one long-lived channel.

    A call the kubelet cannot be reached for closes the channel; the next call dials again (the socket path
    stays across a kubelet restart).

    The kubelet allows 100 calls a second in bursts of 10 and refuses the rest
    (``ResourceExhausted``), and a List costs it (and us) every pod of the node. So a lookup
    asks ``Get`` for the pod we believe holds the IDs when it is the only one in progress, or
    while our reckoning of the kubelet's tokens (:class:`CallBudget`) leaves
    :data:`GET_RESERVE` of them; the other concurrent lookups share one List
    (:class:`~gpumanager.kube.shared_call.SharedCall`), as does a Get the kubelet refuses.
    """

    def __init__(self, socket_path: Path, *, timeout: float = 5.0, budget: CallBudget | None = None) -> None:
        self.socket_path = socket_path
        self._timeout = timeout
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub_of_channel: Any = None  # made once per channel (three method objects each time otherwise)
        self._get_supported = True
        self._shared_list = SharedCall(lambda: _Holders.of_list(self._list()))
        self._lookups = 0  # owner lookups in progress
        self._budget = budget or CallBudget()

    def _stub(self) -> Any:
        if not self.socket_path.exists():
            raise PodResourcesUnavailableError(f"PodResources socket {self.socket_path} does not exist")
        with self._lock:
            if self._channel is None:
                # A connection of its own: one from grpc's shared pool may be one that waits out a backoff.
                self._channel = grpc.insecure_channel(
                    f"unix://{self.socket_path}", options=[("grpc.use_local_subchannel_pool", 1)]
                )
                self._stub_of_channel = pb_grpc.PodResourcesListerStub(self._channel)
            return self._stub_of_channel

    def _unreachable(self, stub: Any) -> None:
        """The kubelet could not be reached through ``stub``'s channel: the next call dials afresh. A channel
        kept would wait out its reconnect backoff (grown over a kubelet's outage to seconds, up to two
        minutes) before it dials again, failing every call meanwhile, the kubelet long back."""
        with self._lock:
            if self._stub_of_channel is not stub or self._channel is None:
                return  # another call replaced it already
            channel, self._channel, self._stub_of_channel = self._channel, None, None
        channel.close()

    @property
    def waiting_for_list(self) -> int:
        """Owner lookups waiting for a List now (one of them making it)."""
        return self._shared_list.waiting

    def close(self) -> None:
        """Close the channel."""
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None
                self._stub_of_channel = None

    def list_all(self) -> list[ContainerDevices]:
        """Every container's devices, as the kubelet sees them now."""
        return _flatten(self._list().pod_resources)

    def _list(self) -> pb.ListPodResourcesResponse:
        self._budget.take()  # asked even without a token: the last way to know
        stub = self._stub()
        try:
            reply: pb.ListPodResourcesResponse = stub.List(pb.ListPodResourcesRequest(), timeout=self._timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._unreachable(stub)
            raise PodResourcesUnavailableError(
                f"PodResources List on {self.socket_path} failed: {exc.code().name}: {exc.details()}"
            ) from exc
        except ValueError as exc:  # the channel closed under it by another call that found the kubelet gone
            raise PodResourcesUnavailableError(f"PodResources List on {self.socket_path} failed: {exc}") from exc
        return reply

    def get(self, namespace: str, name: str) -> list[ContainerDevices] | None:
        """One pod's devices (PodResources ``Get``); None when the kubelet does not offer Get or has no such pod."""
        self._budget.take()
        return self._get(namespace, name)

    def _get(self, namespace: str, name: str) -> list[ContainerDevices] | None:
        """:meth:`get` with its token already reckoned."""
        if not self._get_supported:
            return None
        stub = self._stub()
        try:
            reply = stub.Get(pb.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace), timeout=self._timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._unreachable(stub)
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("the kubelet's PodResources has no Get (older than 1.27?); using List")
                self._get_supported = False
                return None
            if exc.code() == grpc.StatusCode.UNKNOWN and GET_DISABLED in (exc.details() or ""):
                # Kubelets 1.27 to 1.33 serve Get with its feature gate (KubeletPodResourcesGet) off by
                # default: a plain error, as for a pod they do not know, on every call.
                log.info(
                    "the kubelet's PodResources Get is turned off (feature gate KubeletPodResourcesGet); using List"
                )
                self._get_supported = False
                return None
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNKNOWN):
                return None
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise PodResourcesBusyError(f"PodResources Get on {self.socket_path}: {exc.details()}") from exc
            raise PodResourcesUnavailableError(
                f"PodResources Get on {self.socket_path} failed: {exc.code().name}: {exc.details()}"
            ) from exc
        except ValueError as exc:  # the channel closed under it by another call that found the kubelet gone
            raise PodResourcesUnavailableError(f"PodResources Get on {self.socket_path} failed: {exc}") from exc
        return _flatten([reply.pod_resources])

    def owner_of(
        self,
        resource: str,
        device_ids: Sequence[str],
        hint: tuple[str, str] | None = None,
        *,
        since: float | None = None,
        trust: Callable[[tuple[str, str, str]], bool] | None = None,
    ) -> tuple[str, str, str] | None:
        """(namespace, pod name, container) holding exactly ``device_ids`` of ``resource``.

        ``hint`` (namespace, pod name) is asked first with ``Get`` when no other lookup is in
        progress; otherwise, or when the hinted pod does not hold them, the answer comes from a
        ``List`` shared with the other lookups (one that started after this call), indexed once.

        ``since``: the ``time.monotonic()`` moment the kubelet's Allocate of these IDs reached us. The
        kubelet gives a container only IDs that no other container of a running pod holds (bar its
        pod's init containers, whose IDs it hands on), so a List that started after that moment and
        shows a holder ``trust`` accepts (the caller rules out init containers) names the right one:
        such a List, running or just answered, is used before a new one is asked for.
        """
        wanted = frozenset(device_ids)

        def match(entries: Iterable[ContainerDevices]) -> tuple[str, str, str] | None:
            for entry in entries:
                if entry.resource == resource and frozenset(entry.device_ids) == wanted:
                    return (entry.namespace, entry.pod, entry.container)
            return None

        with self._lock:
            alone = self._lookups == 0
            self._lookups += 1
        try:
            # Alone, a lookup asks Get even when our reckoning says no token is left (as it always did).
            if hint is not None and (self._budget.take(keep=0 if alone else GET_RESERVE) or alone):
                try:
                    found = match(self._get(*hint) or [])
                except PodResourcesBusyError as exc:
                    log.debug("%s; sharing a List instead", exc)
                else:
                    if found is not None:
                        return found
            if since is None:
                return self._shared_list().holder(resource, wanted)

            def holds(holders: _Holders) -> bool:
                found = holders.holder(resource, wanted)
                return found is not None and (trust is None or trust(found))

            return self._shared_list(since=since, accept=holds).holder(resource, wanted)
        finally:
            with self._lock:
                self._lookups -= 1
