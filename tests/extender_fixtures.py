"""An extender served over HTTP in this process, against the API-server simulator, with synthetic nodes."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from urllib3.util.retry import Retry

from gpumanager import names
from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.extender.service import Extender, ExtenderSettings
from gpumanager.kube.gpu_inventory import ANNOTATION, encode
from simnode.apiserver import ApiServerSimulator
from simnode.apiserver_objects import pod_manifest
from simnode.apiserver_rbac import SHIPPED, resolve_rules, shipped_account

GIB = 1 << 30
BLOCK = names.MEMORY_BLOCK_BYTES
PREFIX = names.PREDICATE_GPU_IDX_PREFIX


def inventory(
    memory_gib: Sequence[int],
    *,
    unhealthy: Sequence[int] = (),
    nvlink: Sequence[tuple[int, int]] = (),
    level: int = 20,
    model: str = "NVIDIA A800 80GB PCIe",
    share_mode: bool = True,
) -> str:
    """A ``tencent.com/gpu-inventory`` value: one GPU per entry (its memory in GiB)."""
    n = len(memory_gib)
    gpus = [
        GPUInfo(i, f"GPU-{i:08d}", model, i, gib * GIB, f"00000000:{i:02X}:00.0", 0) for i, gib in enumerate(memory_gib)
    ]
    levels = tuple(tuple(0 if i == j else level for j in range(n)) for i in range(n))
    topology = NodeTopology(levels=levels, nvlink=tuple((a, b, 12) for a, b in nvlink))
    return encode(gpus, topology, {i: i not in unhealthy for i in range(n)}, share_mode=share_mode)


def gpu_pod(
    name: str,
    containers: Sequence[tuple[int, int]],
    *,
    node: str | None = None,
    annotations: Mapping[str, str] | None = None,
    phase: str = "Pending",
) -> dict[str, Any]:
    """A pod with containers ``c0, c1, ...`` asking (vcuda-core, vcuda-memory blocks)."""
    specs = []
    for i, (cores, blocks) in enumerate(containers):
        limits = {}
        if cores:
            limits[names.VCORE_RESOURCE] = str(cores)
        if blocks:
            limits[names.VMEMORY_RESOURCE] = str(blocks)
        specs.append({"name": f"c{i}", "limits": limits, "requests": limits})
    return pod_manifest(
        name, node=node, containers=specs, annotations=dict(annotations or {}), phase=phase, uid=f"uid-{name}"
    )


def with_inits(pod: dict[str, Any], inits: Sequence[tuple[str, int, int, bool]]) -> dict[str, Any]:
    """``pod`` with init containers ``(name, vcuda-core, vcuda-memory blocks, sidecar)``; a sidecar has
    ``restartPolicy: Always`` (it runs beside the app containers for the pod's whole life)."""
    specs = []
    for name, cores, blocks, sidecar in inits:
        limits = {names.VCORE_RESOURCE: str(cores)}
        if blocks:
            limits[names.VMEMORY_RESOURCE] = str(blocks)
        spec: dict[str, Any] = {"name": name, "image": "cuda", "resources": {"limits": limits, "requests": limits}}
        if sidecar:
            spec["restartPolicy"] = "Always"
        specs.append(spec)
    pod["spec"]["initContainers"] = specs
    return pod


def held(node: str, gpus: Sequence[Sequence[int]]) -> dict[str, str]:
    """Annotations of a pod that holds these GPUs (per container) on ``node``."""
    out = {f"{PREFIX}{i}": ",".join(map(str, g)) for i, g in enumerate(gpus)}
    out.update({names.PREDICATE_NODE: node, names.PREDICATE_TIME: "1", names.GPU_ASSIGNED: "true"})
    return out


@dataclass
class World:
    """The API-server simulator, an extender serving HTTP, and helpers to call its verbs."""

    api: ApiServerSimulator
    extenders: list[Extender] = field(default_factory=list)
    policy: str = "binpack"
    extender_rules: Sequence[Mapping[str, Any]] | str | None = SHIPPED
    """What the extenders may do: by default what deploy/extender.yaml grants their service
    account (refused 403 otherwise, as on a real cluster); None (explicit): anything."""
    _token: str | None = None

    @property
    def extender(self) -> Extender:
        """The extender started last."""
        return self.extenders[-1]

    @property
    def url(self) -> str:
        """Base URL of the verbs."""
        return f"http://127.0.0.1:{self.extender.server.port}/scheduler"

    def start_extender(self, policy: str | None = None, **more: Any) -> Extender:
        """Start an extender (port 0; ``more``: other :class:`ExtenderSettings`) and wait until it is ready."""
        settings = ExtenderSettings(host="127.0.0.1", port=0, policy=policy or self.policy, **more)  # type: ignore[arg-type]
        rules = resolve_rules(self.extender_rules, "extender")
        if rules is not None and self._token is None:
            self._token = self.api.add_service_account("kube-system", shipped_account("extender"), rules)
        # The pool's retries of the real command (gpu-manager-extender: api_client(wait_as_told=False)):
        # none after a read timeout, so that a bind keeps its deadline.
        retries = Retry(total=3, connect=0, read=0, respect_retry_after_header=False)
        ext = Extender(self.api.client(token=self._token, retries=retries), settings)
        ext.start()
        self.extenders.append(ext)
        deadline = time.monotonic() + 10
        while not ext.synced():
            assert time.monotonic() < deadline, "extender watches did not sync"
            time.sleep(0.01)
        return ext

    def stop_extender(self) -> None:
        """Stop the extender started last."""
        self.extenders.pop().stop()

    def add_node(self, name: str, inv: str | None, *, gpus: int = 8, memory_gib: int = 80) -> None:
        """A node with the device plugin's capacities and (optionally) an inventory annotation."""
        capacity = {
            names.VCORE_RESOURCE: str(100 * gpus),
            names.VMEMORY_RESOURCE: str(gpus * memory_gib * GIB // BLOCK),
        }
        self.api.add_node(name, capacity=capacity, annotations={ANNOTATION: inv} if inv else None)

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Create a pod (through the simulator's store)."""
        return self.api.create_pod(manifest)

    def post(self, verb: str, body: object, *, timeout: float = 30.0) -> Any:
        """POST a verb; returns the decoded answer (HTTP errors and ``timeout`` raise)."""
        req = urllib.request.Request(
            f"{self.url}/{verb}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def filter(self, pod: Mapping[str, Any], nodes: Sequence[str] | None = None) -> dict[str, Any]:
        """filter with full Node objects (nodeCacheCapable: false)."""
        items = [n for n in self.api.nodes() if nodes is None or n["metadata"]["name"] in nodes]
        answer: dict[str, Any] = self.post("filter", {"Pod": pod, "Nodes": {"items": items}, "NodeNames": None})
        return answer

    def passed(self, pod: Mapping[str, Any], nodes: Sequence[str] | None = None) -> list[str]:
        """Names of the nodes filter lets through."""
        answer = self.filter(pod, nodes)
        assert answer["Error"] == ""
        return [n["metadata"]["name"] for n in (answer["Nodes"] or {}).get("items") or []]

    def scores(self, pod: Mapping[str, Any], nodes: Sequence[str] | None = None) -> dict[str, int]:
        """prioritize: node -> score."""
        items = [n for n in self.api.nodes() if nodes is None or n["metadata"]["name"] in nodes]
        answer = self.post("prioritize", {"Pod": pod, "Nodes": {"items": items}, "NodeNames": None})
        return {h["Host"]: h["Score"] for h in answer}

    def bind(self, pod: Mapping[str, Any], node: str, *, timeout: float = 30.0) -> str:
        """bind; returns the Error string ("" on success); ``timeout``: the scheduler's ``httpTimeout``."""
        md = pod["metadata"]
        args = {
            "PodName": md["name"],
            "PodNamespace": md.get("namespace", "default"),
            "PodUID": md["uid"],
            "Node": node,
        }
        answer: dict[str, str] = self.post("bind", args, timeout=timeout)
        return answer["Error"]

    def annotations(self, pod: Mapping[str, Any]) -> dict[str, str]:
        """The pod's annotations as stored now."""
        found = self.api.get_pod(pod["metadata"].get("namespace", "default"), pod["metadata"]["name"])
        assert found is not None
        return dict(found["metadata"].get("annotations") or {})

    def wait_seen(self, pods: int, timeout: float = 10.0) -> None:
        """Wait until the extender counts ``pods`` pods (its watch caught up)."""
        deadline = time.monotonic() + timeout
        while self.extender.state.pod_count() != pods or self.extender.state.assumed_count():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"extender counts {self.extender.state.pod_count()} pods "
                    f"({self.extender.state.assumed_count()} assumed), expected {pods}"
                )
            time.sleep(0.01)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` until it holds (TimeoutError naming ``what`` otherwise)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not hold within {timeout:g} s")
        time.sleep(0.02)


def http_error(world: World, verb: str, raw: bytes) -> tuple[int, dict[str, Any]]:
    """POST a raw body; returns (status, decoded answer) also for HTTP errors."""
    req = urllib.request.Request(f"{world.url}/{verb}", data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def world() -> Iterator[World]:
    """The API-server simulator and a factory for extenders (call ``world.start_extender()``)."""
    api = ApiServerSimulator()
    api.start()
    w = World(api)
    yield w
    for ext in w.extenders:
        ext.stop()
    api.stop()
