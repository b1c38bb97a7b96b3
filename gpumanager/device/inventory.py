"""The node's last complete GPU inventory, kept beside the checkpoint.

Device IDs are numbered from each GPU's index (its place) and memory size, so a
GPU that is lost when the agent starts must still be counted with its old size:
its IDs are kept (listed Unhealthy) and the other GPUs' IDs do not move, also when
NVML no longer counts it, counts a new GPU, or numbers the GPUs otherwise (each
saved GPU keeps its place by UUID). What NVML cannot tell about a lost GPU comes
from this file, written after every start at which every GPU answered.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.fileio import atomic_write, read_regular

log = logging.getLogger(__name__)

FILE = "gpumanager_node_inventory"


def save(path: Path, gpus: Sequence[GPUInfo], topology: NodeTopology) -> None:
    """Write the inventory (errors are logged: it only helps a later start)."""
    data = {
        "gpus": [asdict(g) for g in gpus],
        "levels": [list(row) for row in topology.levels],
        "nvlink": [list(t) for t in topology.nvlink],
    }
    try:
        atomic_write(path, json.dumps(data, sort_keys=True).encode())
    except OSError as exc:
        log.warning("cannot write the GPU inventory %s: %s", path, exc)


#: The largest inventory read (a node's few GPUs take a few KiB).
_LIMIT = 1 << 20

#: What each field of a saved GPU must be (as :func:`save` writes it).
_FIELDS: dict[str, tuple[type, ...]] = {
    "index": (int,),
    "uuid": (str,),
    "name": (str,),
    "minor": (int,),
    "memory_total": (int,),
    "pci_bus_id": (str,),
    "numa_node": (int, type(None)),
    "multi_gpu_board": (bool,),
}


def gpu_entry(raw: object) -> GPUInfo:
    """One saved GPU, every field of the type :func:`save` writes (ValueError naming the one that is not).
    A field this version does not know (a newer agent's, before a downgrade) is left: the GPU's place
    matters more than what else was said of it."""
    if not isinstance(raw, dict):
        raise ValueError(f"GPU entry {raw!r:.80} is not an object")
    raw = {key: value for key, value in raw.items() if key in _FIELDS}
    for key, value in raw.items():
        kinds = _FIELDS[key]
        if bool in kinds:
            ok = isinstance(value, bool)
        else:  # a JSON true is no number here
            ok = isinstance(value, kinds) and not isinstance(value, bool)
            ok = ok and not (isinstance(value, int) and value < 0)
        if not ok:
            raise ValueError(f"GPU entry field {key} is {value!r:.80}")
    return GPUInfo(**raw)


def load(path: Path) -> tuple[dict[int, GPUInfo], NodeTopology | None]:
    """The saved GPUs by index and topology; empty when missing or unreadable (logged, naming the file)."""
    try:
        data = json.loads(read_regular(path, _LIMIT))
        gpus = {g.index: g for g in map(gpu_entry, data["gpus"])}
        topology = NodeTopology(
            levels=tuple(tuple(int(v) for v in row) for row in data["levels"]),
            nvlink=tuple((int(a), int(b), int(c)) for a, b, c in data.get("nvlink", [])),
        )
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring the GPU inventory %s: %s", path, exc)
        return {}, None
    except RecursionError:
        log.warning("ignoring the GPU inventory %s: its JSON nests too deeply to read", path)
        return {}, None
    return gpus, topology
