"""Shared pieces of the adversarial battery: node specs the other tests never use, and invariants.

The invariants are read from outside the agent only: what the kubelet recorded for each
container (the Allocate answer it passed to the runtime) and what the agent publishes on
``/metrics`` and ``/readyz``.

* No over-commit: on every GPU the containers still alive were answered with at most 100 cores
  and at most the GPU's memory (a whole GPU counts as all of both).
* Nothing lost or leaked: the agent's per-GPU allocated cores and memory equal what the live
  containers hold.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpumanager import names
from simnode.agent_process import SPEC_DIR
from simnode.cluster import PodRun, SimCluster

MIB = 1 << 20
_TOPO = {"PIX": 10, "PXB": 20, "PHB": 30, "NODE": 40, "SYS": 50}


def gpu(
    i: int,
    *,
    name: str = "NVIDIA A100-PCIE-40GB",
    memory_mib: int = 40960,
    numa: int = 0,
    minor: int | None = None,
    bus: str | None = None,
) -> dict[str, Any]:
    """One GPU entry of a node spec."""
    return {
        "uuid": f"GPU-{i:08x}-7e57-4b1d-9a00-{random.Random(i).getrandbits(48):012x}",
        "name": name,
        "minor": i if minor is None else minor,
        "memory_mib": memory_mib,
        "pci_bus_id": bus or f"00000000:{0x10 + i * 0x10:02X}:00.0",
        "numa_node": numa,
        "sm_count": 108,
        "multi_gpu_board": False,
    }


def write_spec(
    path: Path,
    gpus: Sequence[Mapping[str, Any]],
    level: Any,
    nvlink: Sequence[tuple[int, int, int]] = (),
) -> Path:
    """A node spec file; ``level(i, j)`` names the topology level ("PIX", ..., "SYS") of two GPUs."""
    n = len(gpus)
    topology = [[0 if i == j else _TOPO[level(i, j)] for j in range(n)] for i in range(n)]
    doc: dict[str, Any] = {
        "driver_version": "535.183.01",
        "cuda_driver_version": 12020,
        "gpus": list(gpus),
        "topology": topology,
    }
    if nvlink:
        doc["nvlink"] = [list(link) for link in nvlink]
    path.write_text(json.dumps(doc, indent=1))
    return path


def spec_one_gpu(path: Path) -> Path:
    """One A100 PCIe (MIG disabled), minor 3."""
    return write_spec(path, [gpu(0, name="NVIDIA A100 80GB PCIe", memory_mib=81920, minor=3)], lambda i, j: "SYS")


def spec_odd_mixed(path: Path) -> Path:
    """Three GPUs of different sizes (16, 24, 40 GiB), minors out of order, two NUMA nodes."""
    gpus = [
        gpu(0, name="Tesla T4", memory_mib=15360, numa=0, minor=2),
        gpu(1, name="NVIDIA A10", memory_mib=23028, numa=0, minor=0),
        gpu(2, name="NVIDIA A100-PCIE-40GB", memory_mib=40960, numa=1, minor=1),
    ]
    return write_spec(path, gpus, lambda i, j: "PHB" if {i, j} == {0, 1} else "SYS")


def spec_islands(path: Path) -> Path:
    """Seven GPUs on three NUMA nodes: NVLink islands {0,1,2} and {3,4}, two loners; one smaller GPU."""
    numa = [0, 0, 0, 1, 1, 2, 2]
    gpus = [
        gpu(
            i,
            name="NVIDIA A100-SXM4-80GB" if i != 6 else "NVIDIA A100-SXM4-40GB",
            memory_mib=81920 if i != 6 else 40960,
            numa=numa[i],
            minor=10 + i,
        )
        for i in range(7)
    ]

    def level(i: int, j: int) -> str:
        if numa[i] != numa[j]:
            return "SYS"
        return "PIX" if {i, j} <= {0, 1, 2} or {i, j} <= {3, 4} else "NODE"

    links = [(0, 1, 12), (0, 2, 12), (1, 2, 12), (3, 4, 6)]
    return write_spec(path, gpus, level, links)


def spec_a100_pcie_x2(path: Path) -> Path:
    """Two A100 80GB PCIe, MIG disabled, across the host bridge."""
    gpus = [gpu(i, name="NVIDIA A100 80GB PCIe", memory_mib=81920, minor=i) for i in range(2)]
    return write_spec(path, gpus, lambda i, j: "PHB")


def _shipped(name: str) -> Any:
    def copy(path: Path) -> Path:
        path.write_text((SPEC_DIR / f"{name}.json").read_text())
        return path

    return copy


SPECS = {
    "one-a100": spec_one_gpu,
    "odd-mixed": spec_odd_mixed,
    "islands-x7": spec_islands,
    "a100-pcie-x2": spec_a100_pcie_x2,
    # Shipped in deploy/sim: minors in reverse PCI order with one smaller GPU; PCI domains other than 0.
    "a800-small-one-x8": _shipped("a800-small-one-x8"),
    "l40s-domains-x4": _shipped("l40s-domains-x4"),
}


# ---- what the containers hold ------------------------------------------------------------------


def answered(run: PodRun) -> dict[str, tuple[tuple[int, ...], int, int]]:
    """container -> (GPU minors, cores, memory bytes) from the Allocate answers the kubelet recorded."""
    out = {}
    for name, rec in run.core.items():
        ann = dict(rec.response.annotations)
        minors = tuple(int(d.removeprefix("/dev/nvidia")) for d in ann[names.VDEVICE_ANNOTATION].split(",") if d)
        out[name] = (minors, int(ann[names.VCORE_RESOURCE]), int(ann[names.VMEMORY_RESOURCE]))
    return out


def held(runs: Iterable[PodRun], memory_of: Mapping[int, int]) -> dict[int, tuple[int, int]]:
    """minor -> (cores, memory bytes) the given containers hold (a whole GPU: 100 and all of it).

    Init containers run one at a time before the others: a pod holds on a GPU the most of any one
    init container and of its other containers together.
    """
    out = {m: (0, 0) for m in memory_of}
    for run in runs:
        inits = {
            c.get("name")
            for c in run.manifest["spec"].get("initContainers") or []
            if c.get("restartPolicy") != "Always"  # a sidecar runs beside the others
        }
        per_init: dict[str, dict[int, tuple[int, int]]] = {}
        rest: dict[int, tuple[int, int]] = {}
        for name, (minors, cores, memory) in answered(run).items():
            target = per_init.setdefault(name, {}) if name in inits else rest
            for m in minors:
                c, b = target.get(m, (0, 0))
                whole = cores >= names.HUNDRED_CORES
                target[m] = (c + (names.HUNDRED_CORES if whole else cores), b + (memory_of[m] if whole else memory))
        for m in memory_of:  # each figure the most of any one group, not the pair with the most cores
            groups = [rest.get(m, (0, 0)), *(d.get(m, (0, 0)) for d in per_init.values())]
            c, b = max(g[0] for g in groups), max(g[1] for g in groups)
            out[m] = (out[m][0] + c, out[m][1] + b)
    return out


def assert_no_overcommit(runs: Iterable[PodRun], memory_of: Mapping[int, int], when: str = "") -> None:
    """Every GPU's live containers together hold at most 100 cores and its memory."""
    runs = list(runs)
    for minor, (cores, memory) in held(runs, memory_of).items():
        holders = [f"{r.name}/{c}={v}" for r in runs for c, v in answered(r).items() if minor in v[0]]
        assert cores <= names.HUNDRED_CORES, f"{when}: GPU {minor} over-committed: {cores} cores: {holders}"
        assert memory <= memory_of[minor], f"{when}: GPU {minor} over-committed: {memory} bytes: {holders}"


# ---- what the agent publishes ------------------------------------------------------------------


def http_get(cluster: SimCluster, path: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body) of the agent's HTTP endpoint."""
    assert cluster.agent is not None
    url = f"http://127.0.0.1:{cluster.agent.query_port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def agent_allocated(cluster: SimCluster) -> dict[int, tuple[int, int]]:
    """minor -> (cores, memory bytes) the agent says are allocated (``/metrics``)."""
    _, body = http_get(cluster, "/metrics")
    # By UUID: the agent's GPU index is the place of its device IDs, which stays when NVML numbers the
    # GPUs otherwise across a restart (a GPU gone, added or moved).
    minor_of = {g.uuid: g for g in gpus_of(cluster)}
    cores: dict[int, int] = {}
    memory: dict[int, int] = {}
    for line in body.splitlines():
        for metric, out in (
            ("gpu_manager_gpu_core_allocated_ratio", cores),
            ("gpu_manager_gpu_memory_allocated_bytes", memory),
        ):
            if line.startswith(metric + "{"):
                labels, value = line[len(metric) + 1 :].rsplit("} ", 1)
                uuid = labels.split('uuid="', 1)[1].split('"', 1)[0]
                if uuid in minor_of:  # not a GPU the driver no longer counts
                    out[minor_of[uuid].minor] = round(float(value) * (100 if out is cores else 1))
    return {m: (cores.get(m, 0), memory.get(m, 0)) for m in memory}


class _Gpu:
    def __init__(self, index: int, minor: int, memory: int, uuid: str) -> None:
        self.index, self.minor, self.memory, self.uuid = index, minor, memory, uuid


def gpus_of(cluster: SimCluster) -> list[_Gpu]:
    """The spec's GPUs (NVML index, minor, memory bytes, UUID)."""
    doc = json.loads(Path(cluster.spec).read_text())
    return [_Gpu(i, g["minor"], g["memory_mib"] * MIB, g["uuid"]) for i, g in enumerate(doc["gpus"])]


def memory_of(cluster: SimCluster) -> dict[int, int]:
    """minor -> memory bytes."""
    return {g.minor: g.memory for g in gpus_of(cluster)}


def wait_agent_matches(cluster: SimCluster, live: Iterable[PodRun], timeout: float = 30.0) -> None:
    """Wait until the agent's allocated figures equal what the live containers hold."""
    live = list(live)
    want = held(live, memory_of(cluster))
    deadline = time.monotonic() + timeout
    got: dict[int, tuple[int, int]] = {}
    while time.monotonic() < deadline:
        got = agent_allocated(cluster)
        if got == want:
            return
        time.sleep(0.2)
    raise AssertionError(
        f"agent's allocations {got} differ from the live containers' {want} "
        f"(live: {[(r.name, answered(r)) for r in live]})"
    )


def readyz(cluster: SimCluster) -> tuple[int, dict[str, Any]]:
    """(status, body as JSON) of /readyz."""
    status, body = http_get(cluster, "/readyz")
    return status, json.loads(body)
