"""Helpers for allocator tests: pods as the API server sends them, and an in-memory pod source."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpumanager.allocation.allocator import Allocator, AllocatorSettings
from gpumanager.allocation.pods import Pod
from gpumanager.allocation.response import ResponseSettings
from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.topology import build_tree

MIB = 1 << 20


def make_pod(
    name: str,
    containers: Sequence[tuple[str, int, int]] = (("c0", 50, 4),),
    *,
    namespace: str = "default",
    annotations: dict[str, str] | None = None,
    phase: str = "Pending",
    created: str = "2026-11-21T10:00:00Z",
    uid: str | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod with (name, vcuda-core, vcuda-memory blocks) containers."""
    specs = []
    for cname, cores, blocks in containers:
        limits = {}
        if cores:
            limits["tencent.com/vcuda-core"] = str(cores)
        if blocks:
            limits["tencent.com/vcuda-memory"] = str(blocks)
        spec: dict[str, Any] = {"name": cname, "image": "cuda", "resources": {"limits": limits, "requests": limits}}
        if env:
            spec["env"] = [{"name": k, "value": v} for k, v in env.items()]
        specs.append(spec)
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or uid_of(name),
            "annotations": dict(annotations or {}),
            "creationTimestamp": created,
        },
        "spec": {"nodeName": "node-1", "containers": specs},
        "status": {"phase": phase},
    }


def uid_of(name: str) -> str:
    """The UUID that :func:`make_pod` gives a pod named ``name``."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"pod/{name}"))


class FakePods:
    """A PodSource over a list the test controls; ``refresh_error`` simulates an API server outage.

    Unlike the agent's pod cache (a new object for each version of a pod), tests may change a pod in place:
    between a GetPreferredAllocation and its Allocate, replace the pod instead, or the answer prepared for
    the old version is used (allocation/prepared.py tells versions apart by object)."""

    def __init__(self, pods: Sequence[Pod] = ()) -> None:
        self.items: list[Pod] = list(pods)
        self.is_synced = True
        self.refresh_error: Exception | None = None
        self.hidden: list[Pod] = []  # known to the API server but not yet to the cache
        self.gone_at_server: set[str] = set()  # UIDs deleted at the API server, still in the cache
        self.refreshes = 0
        self.lists = 0  # calls of pods(): a look at every pod
        # changes(): the generation, each pod's content when last compared, and the generation it last changed.
        self.generation = 0
        self._seen: dict[str, str] = {}
        self._changed_at: dict[str, int] = {}
        self.lost_track = False  # the next changes() answers None (as the cache does after a relist)
        #: refresh() also puts the hidden pods in the cache; False: as PodCache.refresh, the cache is left
        #: to its watch (call show_hidden() for the watch's delivery).
        self.refresh_fills_cache = True

    def synced(self) -> bool:
        return self.is_synced

    def pods(self) -> list[Pod]:
        self.lists += 1
        return list(self.items)

    def get(self, uid: str) -> Pod | None:
        known = self.items + self.hidden if self.refresh_fills_cache else self.items
        return next((p for p in known if p["metadata"]["uid"] == uid), None)

    def changes(self, since: int) -> tuple[int, frozenset[str] | None]:
        """As the pod cache: the pods whose content differs from the last call count as changed (tests
        change ``items`` and the pods in it in place)."""
        now = {str(p["metadata"]["uid"]): json.dumps(p, sort_keys=True) for p in self.items}
        for uid in sorted(set(now) | set(self._seen)):
            if now.get(uid) != self._seen.get(uid):
                self.generation += 1
                self._changed_at[uid] = self.generation
        self._seen = now
        if since < 0 or self.lost_track:
            self.lost_track = False
            return self.generation, None
        return self.generation, frozenset(uid for uid, gen in self._changed_at.items() if gen > since)

    def refresh(self) -> list[Pod]:
        self.refreshes += 1
        if self.refresh_error is not None:
            raise self.refresh_error
        if not self.refresh_fills_cache:
            return [p for p in self.items + self.hidden if p["metadata"]["uid"] not in self.gone_at_server]
        self.show_hidden()
        return [p for p in self.items if p["metadata"]["uid"] not in self.gone_at_server]

    def recent(self, within: float, since: float) -> list[Pod] | None:
        """No list serves a later call: each call that needs one refreshes (counted)."""
        return None

    def show_hidden(self) -> None:
        """The cache's watch delivers the pods only the API server knew."""
        self.items.extend(self.hidden)
        self.hidden = []


def v100x4() -> tuple[list[GPUInfo], NodeTopology]:
    gpus = [
        GPUInfo(i, f"GPU-{i:04d}", "Tesla V100-PCIE-32GB", i, 32768 * MIB, f"00000000:{i + 16:02x}:00.0", 0)
        for i in range(4)
    ]
    levels = tuple(tuple(0 if a == b else 10 if a // 2 == b // 2 else 30 for b in range(4)) for a in range(4))
    return gpus, NodeTopology(levels=levels)


def make_allocator(
    tmp_path: Path,
    pods: FakePods,
    *,
    share_mode: bool = True,
    node: tuple[list[GPUInfo], NodeTopology] | None = None,
    share_problem: Callable[[], str] = lambda: "",
) -> Allocator:
    """An allocator over ``node`` (default :func:`v100x4`), its checkpoint under ``tmp_path``."""
    gpus, topo = node if node is not None else v100x4()
    return Allocator(
        share_problem=share_problem,
        gpus=gpus,
        tree=build_tree(gpus, topo),
        pods=pods,
        settings=AllocatorSettings(
            share_mode=share_mode,
            response=ResponseSettings(
                vdriver_nvidia="/etc/gpu-manager/vdriver/nvidia",
                vdriver_origin="/etc/gpu-manager/vdriver/origin",
                virtual_manager_path="/etc/gpu-manager/vm",
                extra_devices=("/dev/nvidia-uvm-tools",),
            ),
        ),
        checkpoint_path=tmp_path / "checkpoint" / "gpumanager_internal_checkpoint",
    )


def core_ids(gpu: int, count: int, start: int = 0) -> list[str]:
    """``count`` vcuda-core IDs of one GPU (per-GPU ranges of 100)."""
    return [f"tencent.com/vcuda-core-{gpu * 100 + start + i}" for i in range(count)]
