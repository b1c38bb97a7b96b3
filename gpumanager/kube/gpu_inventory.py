"""The ``tencent.com/gpu-inventory`` Node annotation: every GPU of a node, as the agent sees it.

The agent (device-plugin mode) writes it; the scheduler extender reads it to know each GPU's
own capacity instead of dividing the node's totals evenly (GPUs of one node may differ). The
value is JSON::

    {"version": 1, "shareMode": true,
     "gpus": [{"index": 0, "minor": 0, "uuid": "GPU-...", "model": "NVIDIA A800 80GB PCIe",
               "memory": 85899345920, "cores": 100, "health": "Healthy",
               "nvlinkGroup": 0, "nvlinkPeers": [1], "numa": 0, "multiGpuBoard": false,
               "levels": [0, 10, 20, 20]}, ...]}

``memory`` is in bytes; ``cores`` is always 100 (``tencent.com/vcuda-core`` units of one GPU);
``health`` is ``Healthy`` or ``Unhealthy``; ``nvlinkGroup`` is the lowest index of the GPUs
joined to this one by NVLink (null without NVLink); ``levels`` is the GPU's row of NVML's
topology-level matrix (by index), so a reader can rebuild the same topology tree as the agent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpumanager import names
from gpumanager.device.types import GPUInfo, NodeTopology

ANNOTATION = "tencent.com/gpu-inventory"
VERSION = 1


class InventoryError(ValueError):
    """The annotation cannot be used; the message names the field and the value."""


@dataclass(frozen=True)
class InventoryGPU:
    """One GPU of the annotation."""

    index: int
    minor: int
    uuid: str
    model: str
    memory: int  # bytes
    healthy: bool
    numa: int | None
    nvlink_group: int | None
    nvlink_peers: tuple[int, ...]
    levels: tuple[int, ...]
    multi_gpu_board: bool = False
    cores: int = names.HUNDRED_CORES

    def info(self) -> GPUInfo:
        """The GPU as the topology code knows it (no PCI bus id: the annotation does not carry one)."""
        return GPUInfo(
            index=self.index,
            uuid=self.uuid,
            name=self.model,
            minor=self.minor,
            memory_total=self.memory,
            pci_bus_id="",
            numa_node=self.numa,
            multi_gpu_board=self.multi_gpu_board,
        )


@dataclass(frozen=True)
class Inventory:
    """Every GPU of a node (by index) and whether the agent allows shares."""

    gpus: tuple[InventoryGPU, ...]
    share_mode: bool

    def topology(self) -> NodeTopology:
        """The NVML level matrix and NVLink pairs, as the agent's tree builder takes them."""
        levels = tuple(g.levels for g in self.gpus)
        pairs = sorted({(min(g.index, p), max(g.index, p)) for g in self.gpus for p in g.nvlink_peers})
        return NodeTopology(levels=levels, nvlink=tuple((a, b, 1) for a, b in pairs))


def _nvlink_groups(gpus: Sequence[GPUInfo], topology: NodeTopology) -> tuple[dict[int, int], dict[int, list[int]]]:
    """Lowest index of each GPU's NVLink component, and each GPU's NVLink peers."""
    peers: dict[int, list[int]] = {g.index: [] for g in gpus}
    for a, b, links in topology.nvlink:
        if links > 0 and a in peers and b in peers and a != b:
            peers[a].append(b)
            peers[b].append(a)
    group: dict[int, int] = {}
    for g in sorted(peers):
        if g in group or not peers[g]:
            continue
        stack, seen = [g], {g}
        while stack:
            for p in peers[stack.pop()]:
                if p not in seen:
                    seen.add(p)
                    stack.append(p)
        for member in seen:
            group[member] = min(seen)
    return group, {k: sorted(set(v)) for k, v in peers.items()}


def encode(gpus: Sequence[GPUInfo], topology: NodeTopology, healthy: Mapping[int, bool], *, share_mode: bool) -> str:
    """The annotation value for these GPUs (compact JSON, GPUs by index; a GPU missing from
    ``healthy`` counts as healthy)."""
    group, peers = _nvlink_groups(gpus, topology)
    rows = topology.levels
    out = []
    for g in sorted(gpus, key=lambda x: x.index):
        levels = list(rows[g.index]) if g.index < len(rows) else []
        out.append(
            {
                "index": g.index,
                "minor": g.minor,
                "uuid": g.uuid,
                "model": g.name,
                "memory": g.memory_total,
                "cores": names.HUNDRED_CORES,
                "health": names.HEALTHY if healthy.get(g.index, True) else names.UNHEALTHY,
                "nvlinkGroup": group.get(g.index),
                "nvlinkPeers": peers.get(g.index, []),
                "numa": g.numa_node,
                "multiGpuBoard": g.multi_gpu_board,
                "levels": levels,
            }
        )
    return json.dumps({"version": VERSION, "shareMode": share_mode, "gpus": out}, separators=(",", ":"))


def _int(raw: Mapping[str, object], key: str, where: str, *, lo: int = 0, optional: bool = False) -> int | None:
    value = raw.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= _INT64_MAX:
        raise InventoryError(f"{where}.{key}={_shown(value)} is not an integer from {lo} to 2^63-1")
    return value


#: The largest integer the agent writes (its Go peers read int64s).
_INT64_MAX = 2**63 - 1


def _shown(value: object) -> str:
    """``repr(value)``, cut short for a message (repr() of an int of more than 4300 digits raises)."""
    try:
        text = repr(value)
    except ValueError:
        return "<a number of more than 4300 digits>"
    return text if len(text) <= 80 else f"{text[:80]}... ({len(text)} characters)"


def _gpu(raw: object, position: int, count: int) -> InventoryGPU:
    where = f"gpus[{position}]"
    if not isinstance(raw, dict):
        raise InventoryError(f"{where} is not an object: {_shown(raw)}")
    index = _int(raw, "index", where)
    minor = _int(raw, "minor", where)
    memory = _int(raw, "memory", where)
    cores = _int(raw, "cores", where, lo=1)
    assert index is not None and minor is not None and memory is not None and cores is not None
    if cores != names.HUNDRED_CORES:
        raise InventoryError(f"{where}.cores={cores!r}: only {names.HUNDRED_CORES} cores per GPU are understood")
    health = raw.get("health")
    if health not in (names.HEALTHY, names.UNHEALTHY):
        raise InventoryError(f"{where}.health={health!r} is neither {names.HEALTHY!r} nor {names.UNHEALTHY!r}")
    peers = raw.get("nvlinkPeers") or []
    levels = raw.get("levels") or []
    if not isinstance(peers, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in peers):
        raise InventoryError(f"{where}.nvlinkPeers={peers!r} is not a list of GPU indices")
    if not isinstance(levels, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in levels):
        raise InventoryError(f"{where}.levels={levels!r} is not a list of topology levels")
    if count > 1 and len(levels) != count:
        raise InventoryError(f"{where}.levels has {len(levels)} entries for {count} GPUs")
    return InventoryGPU(
        index=index,
        minor=minor,
        uuid=str(raw.get("uuid", "")),
        model=str(raw.get("model", "")),
        memory=memory,
        healthy=health == names.HEALTHY,
        numa=_int(raw, "numa", where, optional=True),
        nvlink_group=_int(raw, "nvlinkGroup", where, optional=True),
        nvlink_peers=tuple(peers),
        levels=tuple(levels) if count > 1 else (),
        multi_gpu_board=bool(raw.get("multiGpuBoard", False)),
        cores=cores,
    )


def decode(text: str) -> Inventory:
    """Parse an annotation value; :class:`InventoryError` names what is wrong."""
    try:
        data = json.loads(text)
    except (TypeError, json.JSONDecodeError) as exc:
        raise InventoryError(f"not JSON: {exc}") from None
    except RecursionError:
        raise InventoryError("JSON nested too deeply to read") from None
    except ValueError as exc:  # a number of more than 4300 digits (int() refuses it)
        raise InventoryError(f"cannot read its JSON: {str(exc)[:120]}") from None
    if not isinstance(data, dict):
        raise InventoryError(f"not a JSON object: {text[:80]!r}")
    if data.get("version") != VERSION:
        raise InventoryError(f"version={_shown(data.get('version'))}, only {VERSION} is understood")
    raw_gpus = data.get("gpus")
    if not isinstance(raw_gpus, list):
        raise InventoryError(f"gpus={_shown(raw_gpus)} is not a list")
    gpus = tuple(sorted((_gpu(g, i, len(raw_gpus)) for i, g in enumerate(raw_gpus)), key=lambda g: g.index))
    if [g.index for g in gpus] != list(range(len(gpus))):
        raise InventoryError(f"GPU indices {[g.index for g in gpus]} are not 0..{len(gpus) - 1}")
    minors = [g.minor for g in gpus]
    if len(set(minors)) != len(minors):
        raise InventoryError(f"duplicate GPU minor numbers {minors}")
    for g in gpus:
        bad = [p for p in g.nvlink_peers if not 0 <= p < len(gpus) or p == g.index]
        if bad:
            raise InventoryError(f"GPU {g.index}: nvlinkPeers {bad} are not other GPUs of this node")
    return Inventory(gpus=gpus, share_mode=bool(data.get("shareMode", True)))
