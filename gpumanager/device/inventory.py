"""The node's last complete GPU inventory, kept beside the checkpoint.

Device IDs are numbered from each GPU's index and memory size, so a GPU that is
lost when the agent starts must still be counted with its old size: its IDs are
kept (listed Unhealthy) and the other GPUs' IDs do not move. What NVML cannot
tell about a lost GPU comes from this file, written after every start at which
every GPU answered.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.fileio import atomic_write

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


def load(path: Path) -> tuple[dict[int, GPUInfo], NodeTopology | None]:
    """The saved GPUs by index and topology; empty when missing or unreadable."""
    try:
        data = json.loads(path.read_text())
        gpus = {int(g["index"]): GPUInfo(**g) for g in data["gpus"]}
        topology = NodeTopology(
            levels=tuple(tuple(int(v) for v in row) for row in data["levels"]),
            nvlink=tuple((int(a), int(b), int(c)) for a, b, c in data.get("nvlink", [])),
        )
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the GPU inventory %s: %s", path, exc)
        return {}, None
    return gpus, topology
