"""Battery: the agent's checkpoint and journal damaged while it was down (SIGKILL, then damage).

Whatever was damaged, the agent starts, serves, and ends with allocations equal to the live
containers' (rebuilt from the kubelet's records where its own are gone); new pods are never
placed on what was lost; /readyz says 200 once settled.
"""

from __future__ import annotations

import json
import random
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from gpumanager import names
from simnode.cluster import PodRun, SimCluster, gpu_pod
from tests.battery_fixtures import assert_no_overcommit, memory_of, readyz, spec_odd_mixed, wait_agent_matches


def _snapshot(cluster: SimCluster) -> Path:
    return cluster.checkpoint_dir / names.OWN_CHECKPOINT


def _segments(cluster: SimCluster) -> list[Path]:
    return sorted(
        (
            p
            for p in cluster.checkpoint_dir.glob(names.OWN_CHECKPOINT + ".journal-*")
            if p.name.split("-")[-1].isdigit()
        ),
        key=lambda p: int(p.name.split("-")[-1]),
    )


def _used_bytes(path: Path) -> int:
    data = path.read_bytes()
    return len(data.rstrip(b"\0"))


def null_snapshot(cluster: SimCluster) -> None:
    _snapshot(cluster).write_text("null")


def truncated_snapshot(cluster: SimCluster) -> None:
    data = _snapshot(cluster).read_bytes()
    _snapshot(cluster).write_bytes(data[: len(data) // 2])


def bad_entries(cluster: SimCluster) -> None:
    doc = json.loads(_snapshot(cluster).read_text())
    mapping = doc["PodGPUMapping"]
    for i, containers in enumerate(mapping.values()):
        for entry in containers.values():
            if i % 2:
                entry["Cores"] = "thirty"
            else:
                entry["Devices"] = ["/dev/nvidia99"]
    _snapshot(cluster).write_text(json.dumps(doc))


def garbage_in_journal(cluster: SimCluster) -> None:
    for seg in _segments(cluster):
        used = _used_bytes(seg)
        if used > 8:
            data = bytearray(seg.read_bytes())
            rng = random.Random(seg.name)
            for _ in range(8):
                data[rng.randrange(used)] ^= 0xFF
            seg.write_bytes(bytes(data))


def journal_cut_short(cluster: SimCluster) -> None:
    for seg in _segments(cluster):
        used = _used_bytes(seg)
        if used > 8:
            with open(seg, "r+b") as f:
                f.truncate(used - 5)


def snapshot_is_a_directory(cluster: SimCluster) -> None:
    _snapshot(cluster).unlink(missing_ok=True)
    _snapshot(cluster).mkdir()


def everything_and_the_kubelets_checkpoint(cluster: SimCluster) -> None:
    null_snapshot(cluster)
    garbage_in_journal(cluster)
    cluster.kubelet.checkpoint_path.write_text('{"Data": ')


DAMAGE: dict[str, Callable[[SimCluster], None]] = {
    f.__name__: f
    for f in (
        null_snapshot,
        truncated_snapshot,
        bad_entries,
        garbage_in_journal,
        journal_cut_short,
        snapshot_is_a_directory,
        everything_and_the_kubelets_checkpoint,
    )
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_checkpoint_loses_and_leaks_nothing(tmp_path: Path, damage: str) -> None:
    spec = spec_odd_mixed(tmp_path / "spec.json")
    cluster = SimCluster(tmp_path / "node", spec, fill="random")
    with cluster:
        assert cluster.agent is not None
        live: list[PodRun] = []
        shapes = [[("main", 30, 8)], [("main", 100, 0)], [("a", 20, 4), ("b", 40, 4)], [("main", 50, 16)]]
        for i, shape in enumerate(shapes):
            live.append(cluster.run_pod(gpu_pod(f"p{i}", shape)))
        cluster.delete(live.pop(1))
        live.append(cluster.run_pod(gpu_pod("late", [("main", 10, 2)])))  # in the journal only, likely
        cluster.agent.signal(signal.SIGKILL)
        cluster.agent.wait()
        DAMAGE[damage](cluster)
        cluster.start_agent()
        wait_agent_matches(cluster, live, timeout=60)
        # Fill every GPU as far as it goes: nothing lands on what was lost.
        for i in range(8):
            try:
                live.append(cluster.run_pod(gpu_pod(f"new-{i}", [("main", 40, 8)])))
            except Exception:  # full: refused
                run = next(r for r in cluster.runs.values() if r.name == f"new-{i}")
                cluster.kubelet.remove_pod(run.uid)
                cluster.api.delete_pod(run.namespace, run.name)
            assert_no_overcommit(live, memory_of(cluster), f"new-{i}")
        wait_agent_matches(cluster, live)
        status, body = readyz(cluster)
        assert status == 200, body  # what was damaged is moved aside and written anew
