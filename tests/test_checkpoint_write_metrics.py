"""How long each durable checkpoint write takes, as the agent measures and exports it
(``gpu_manager_checkpoint_write_duration_seconds{kind}``): what an Allocate waits for the disk, on the
operator's own node, beside the agent's whole answer time. (A write that failed is not timed:
tests/test_checkpoint_journal.py, the failed flush.)"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpumanager.allocation.journal import CheckpointStore
from simnode.cluster import SimCluster, gpu_pod
from tests.alloc_fixtures import core_ids
from tests.test_checkpoint_journal import gated_allocator, put

WRITES = "gpu_manager_checkpoint_write_duration_seconds"


def test_each_durable_write_is_timed_once_with_its_kind(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "gpumanager_internal_checkpoint")
    seen: list[tuple[str, float]] = []
    store.on_write = lambda kind, seconds: seen.append((kind, seconds))
    store.write_snapshot({"PodGPUMapping": {}}, store.switch())
    tickets = [store.stage(put(f"p{i}", "c", 10)) for i in range(5)]
    store.sync(tickets[-1])  # the five staged changes go in one write
    store.sync(tickets[0])  # written already: nothing more
    assert [kind for kind, _ in seen] == ["snapshot", "journal"], seen
    assert all(seconds > 0 for _, seconds in seen), seen
    store.close()


def test_concurrent_allocations_are_timed_once_per_shared_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _pods, alloc, gated = gated_allocator(tmp_path, monkeypatch, 8)
    seen: list[tuple[str, float]] = []
    alloc.observe_checkpoint_writes(lambda kind, seconds: seen.append((kind, seconds)))
    gated.hold(alloc, 8, lambda i: gated.done.append(alloc.allocate(core_ids(0, 10, start=10 * i))))
    journal_writes = [seconds for kind, seconds in seen if kind == "journal"]
    assert len(journal_writes) == len(gated.writes) == 2, (seen, gated.writes)
    # The first write was held at the gate until every call had staged: its time is the disk's, as the
    # callers waited for it.
    assert max(journal_writes) > 0


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path) -> Iterator[SimCluster]:
    c = SimCluster(tmp_path, "h100-nvlink-x8", agent_flags=["--allocation-check-period=30"]).start()
    yield c
    c.stop()


def _counts(c: SimCluster) -> dict[str, float]:
    assert c.agent is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{c.agent.query_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        s.labels["kind"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == WRITES + "_count"
    }


def test_the_agent_exports_the_time_of_its_checkpoint_writes(cluster: SimCluster) -> None:
    before = _counts(cluster)
    assert set(before) == {"journal", "snapshot"}, "both series exist before the first write of their kind"
    cluster.run_pod(gpu_pod("timed", [("main", 30, 4)]))
    # Its Allocate and its start each waited for a journal write (the observation is made once the answer
    # has left, so it may land a moment after the call).
    deadline = time.monotonic() + 10
    while (after := _counts(cluster))["journal"] < before["journal"] + 2:
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.05)
