"""Recovery of the allocation checkpoint under hostile inputs: crashes, damaged files, over-commits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.alloc_fixtures import FakePods, make_allocator, make_pod, uid_of

GIB = 1 << 30


def _ckpt(tmp_path: Path) -> Path:
    return tmp_path / "checkpoint" / "gpumanager_internal_checkpoint"


def _entry(minors: list[int], cores: int, memory: int = GIB) -> dict[str, Any]:
    return {"Devices": [f"/dev/nvidia{m}" for m in minors], "Cores": cores, "Memory": memory}


def _write_snapshot(tmp_path: Path, mapping: dict[str, Any], **extra: Any) -> Path:
    path = _ckpt(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"PodGPUMapping": mapping, **extra}))
    return path


def _free_cores(alloc: Any, index: int) -> int:
    return next(row[1] for row in alloc.tree_snapshot() if row[0] == index)


def _free_memory(alloc: Any, index: int) -> int:
    return next(row[2] for row in alloc.tree_snapshot() if row[0] == index)


# -- over-commit after recovery --------------------------------------------------------------------


def test_shares_over_capacity_then_one_released_keeps_the_others_charge(tmp_path: Path) -> None:
    """Two recovered shares of one GPU that together exceed it (60 + 60 cores): once one pod ends, the
    GPU has 40 cores free, not 60 (the other still holds 60)."""
    a, b = uid_of("a"), uid_of("b")
    _write_snapshot(tmp_path, {a: {"c0": _entry([0], 60)}, b: {"c0": _entry([0], 60)}})
    pods = FakePods([make_pod("a", phase="Running"), make_pod("b", phase="Running")])
    alloc = make_allocator(tmp_path, pods)
    try:
        alloc.load()
        assert _free_cores(alloc, 0) == 0
        alloc.release_pod(a)
        assert _free_cores(alloc, 0) == 40
        alloc.release_pod(b)
        assert _free_cores(alloc, 0) == 100
    finally:
        alloc.close()


def test_share_beside_whole_gpu_entry_then_whole_released_keeps_the_share(tmp_path: Path) -> None:
    """A recovered whole-GPU entry and a share of the same GPU (a conflict): when the whole one ends the
    share still holds its 30 cores; the GPU must not look entirely free."""
    a, b = uid_of("a"), uid_of("b")
    _write_snapshot(tmp_path, {a: {"c0": _entry([1], 100)}, b: {"c0": _entry([1], 30)}})
    pods = FakePods([make_pod("a", phase="Running"), make_pod("b", phase="Running")])
    alloc = make_allocator(tmp_path, pods)
    try:
        alloc.load()
        alloc.release_pod(a)
        assert _free_cores(alloc, 1) == 70
    finally:
        alloc.close()


def test_memory_over_capacity_then_one_released(tmp_path: Path) -> None:
    """Recovered shares whose memory exceeds the GPU's 32 GiB (20 + 20): after one ends, 12 GiB are free."""
    a, b = uid_of("a"), uid_of("b")
    _write_snapshot(tmp_path, {a: {"c0": _entry([2], 10, 20 * GIB)}, b: {"c0": _entry([2], 10, 20 * GIB)}})
    pods = FakePods([make_pod("a", phase="Running"), make_pod("b", phase="Running")])
    alloc = make_allocator(tmp_path, pods)
    try:
        alloc.load()
        alloc.release_pod(a)
        assert _free_memory(alloc, 2) == 12 * GIB
    finally:
        alloc.close()
