"""Prometheus metrics of prepared ResourceClaims (DRA mode).

Labels as in every family of the agent: ``gpu`` (the NVML index) and ``uuid`` for the
GPU, ``namespace`` and ``pod`` for who uses it, plus ``claim`` and ``claim_uid``:

- ``gpu_manager_claim_gpu_core_ratio``: share of a GPU's compute a prepared claim consumes
  (0-1; a whole GPU is 1), one series per claim and GPU (results of one claim on the same GPU
  are summed);
- ``gpu_manager_claim_gpu_memory_bytes``: memory of that GPU it consumes (a whole GPU: all of it);
- ``gpu_manager_claim_containers``: containers of a pod that use a prepared claim.

``share`` is ``false`` for a GPU allocated whole (no limits are enforced), else ``true``.

And ``gpu_manager_dra_feature_gate_off{gate}``: 1 for each DRA feature gate (``DRAConsumableCapacity``,
``DRADeviceTaints``) seen off: on the API server (it dropped the fields the gate guards from the node's
slice) or in kube-scheduler (it allocated claims without the capacity they ask for), else 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpumanager import names
from gpumanager.allocation.claims import ClaimAllocation
from gpumanager.allocation.pods import Pod
from gpumanager.device.types import GPUInfo
from gpumanager.dra.consumers import consumers
from gpumanager.dra.publisher import GATES

CLAIM_GPU_LABELS = ("namespace", "claim", "claim_uid", "gpu", "uuid", "share")
CLAIM_POD_LABELS = ("namespace", "claim", "claim_uid", "pod")


class ClaimCollector(Collector):
    """What each prepared claim consumes of each GPU, and which pods use it."""

    def __init__(
        self,
        claims: Callable[[], list[ClaimAllocation]],
        pods: Callable[[], list[Pod]],
        gpus: Sequence[GPUInfo],
        reserved: Callable[[], Mapping[str, AbstractSet[str]]] | None = None,
    ) -> None:
        self._claims = claims
        # Claim UID -> pods it was seen reserved for: which of several claims of one name a pod uses.
        self._reserved = reserved
        self._pods = pods
        self._by_minor = {g.minor: g for g in gpus}

    def describe(self) -> Sequence[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        cores = GaugeMetricFamily(
            "gpu_manager_claim_gpu_core_ratio",
            "Share of the GPU's compute a prepared ResourceClaim consumes (0-1; 1 for a whole GPU)",
            labels=list(CLAIM_GPU_LABELS),
        )
        memory = GaugeMetricFamily(
            "gpu_manager_claim_gpu_memory_bytes",
            "GPU memory a prepared ResourceClaim consumes on this GPU (all of it for a whole GPU)",
            labels=list(CLAIM_GPU_LABELS),
        )
        users = GaugeMetricFamily(
            "gpu_manager_claim_containers",
            "Containers of a pod that use a prepared ResourceClaim",
            labels=list(CLAIM_POD_LABELS),
        )
        pods = self._pods()
        claims = self._claims()
        reserved = self._reserved() if self._reserved is not None else {}
        for claim in claims:
            per_gpu: dict[int, tuple[int, int, bool]] = {}
            for d in claim.devices:
                gpu = self._by_minor.get(d.minor)
                if gpu is None or not d.consumes:
                    continue
                taken_cores, taken_memory, whole = per_gpu.get(gpu.index, (0, 0, False))
                per_gpu[gpu.index] = (
                    taken_cores + (names.HUNDRED_CORES if d.whole else d.cores),
                    taken_memory + (gpu.memory_total if d.whole else d.memory),
                    whole or d.whole,
                )
            by_index = {g.index: g for g in self._by_minor.values()}
            for index, (taken_cores, taken_memory, whole) in sorted(per_gpu.items()):
                gpu = by_index[index]
                values = [claim.namespace, claim.name, claim.uid, str(index), gpu.uuid, "false" if whole else "true"]
                cores.add_metric(values, min(taken_cores, names.HUNDRED_CORES) / names.HUNDRED_CORES)
                memory.add_metric(values, float(taken_memory))
            per_pod: dict[str, int] = {}
            for pod, _container in consumers(claim, pods, claims, reserved):
                name = str((pod.get("metadata") or {}).get("name", ""))
                per_pod[name] = per_pod.get(name, 0) + 1
            for name, count in sorted(per_pod.items()):
                users.add_metric([claim.namespace, claim.name, claim.uid, name], float(count))
        yield from (cores, memory, users)


class FeatureGateCollector(Collector):
    """Which DRA feature gates were seen off (the API server's or kube-scheduler's)."""

    def __init__(self, gates_off: Callable[[], AbstractSet[str]]) -> None:
        self._gates_off = gates_off

    def describe(self) -> Sequence[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "gpu_manager_dra_feature_gate_off",
            "1 when this DRA feature gate was seen off: the API server dropped the fields it guards from the "
            "node's ResourceSlice, or kube-scheduler allocated claims without the capacity they ask for; else 0",
            labels=["gate"],
        )
        off = self._gates_off()
        for gate in GATES:
            family.add_metric([gate], 1.0 if gate in off else 0.0)
        yield family


class DRAStateCollector(Collector):
    """``gpu_manager_dra_leaked_claims_freed_total``: prepared claims freed because the API server no longer has
    them and no pod of the node uses them, though the kubelet never unprepared them; and
    ``gpu_manager_dra_slice_withdrawn``: 1 while the ResourceSlice is withdrawn (the kubelet refuses the driver, or
    its sockets cannot be served)."""

    def __init__(self, leaked_freed: Callable[[], int], slice_withdrawn: Callable[[], bool]) -> None:
        self._leaked_freed = leaked_freed
        self._slice_withdrawn = slice_withdrawn

    def describe(self) -> Sequence[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        freed = CounterMetricFamily(
            "gpu_manager_dra_leaked_claims_freed",
            "Prepared claims freed because the API server no longer has them (404, or another claim of that name) "
            "and no pod of the node uses them, though the kubelet never unprepared them",
        )
        freed.add_metric([], float(self._leaked_freed()))
        yield freed
        withdrawn = GaugeMetricFamily(
            "gpu_manager_dra_slice_withdrawn",
            "1 while the node's ResourceSlice is withdrawn because the kubelet refuses the driver's registration or "
            "its sockets cannot be served, else 0",
        )
        withdrawn.add_metric([], 1.0 if self._slice_withdrawn() else 0.0)
        yield withdrawn
