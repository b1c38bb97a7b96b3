"""Recovery of the allocation checkpoint under hostile inputs: crashes, damaged files, over-commits."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from gpumanager.allocation import journal
from gpumanager.allocation.allocator import Allocator
from gpumanager.allocation.journal import CheckpointStore
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


def _free_cores(alloc: Allocator, index: int) -> int:
    return next(row[1] for row in alloc.tree_snapshot() if row[0] == index)


def _free_memory(alloc: Allocator, index: int) -> int:
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


# -- the journal across several restarts ------------------------------------------------------------


def _put(pod: str, container: str, minors: list[int], cores: int) -> dict[str, Any]:
    return {"op": "put", "pod": pod, "container": container, "entry": _entry(minors, cores)}


def _segment_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if ".journal-" in p.name)


def test_a_write_cut_short_is_no_damage_at_the_start_after_next(tmp_path: Path) -> None:
    """A crash cut a record short at the end of the journal; the next run wrote into a new segment and
    crashed too (before the snapshot caught up). The cut-short record is still a write never answered:
    no damage is reported, nothing is moved aside, and every answered change is there."""
    path = _ckpt(tmp_path)
    first = CheckpointStore(path)
    first.load()
    first.switch()
    first.record(_put("pod-a", "c0", [0], 50))
    seg = path.with_name(path.name + ".journal-1")
    cut = journal._record(_put("pod-x", "c0", [1], 50))[:30]  # the crash: a record half written
    with seg.open("r+b") as f:
        f.seek(first._segment.offset if first._segment else 0)
        f.write(cut)
    first.close()

    second = CheckpointStore(path)
    loaded = second.load()
    assert loaded.problems == []
    second.switch()
    second.record(_put("pod-b", "c0", [2], 50))
    second.close()

    third = CheckpointStore(path)
    loaded = third.load()
    assert loaded.problems == []
    assert loaded.document is not None
    assert sorted(loaded.document["PodGPUMapping"]) == ["pod-a", "pod-b"]
    assert not [n for n in _segment_files(path) if "corrupt" in n]
    third.close()


def test_a_segment_named_beyond_the_largest_number_does_not_hide_later_changes(tmp_path: Path) -> None:
    """A stray ``journal-<huge>`` file (a number no snapshot may name) must not make the next segments and
    snapshot carry a number the next start refuses: changes written after it are read back."""
    path = _ckpt(tmp_path)
    path.parent.mkdir(parents=True)
    path.with_name(path.name + f".journal-{(1 << 63) - 1}").write_bytes(b"\0" * 64)
    pods = FakePods([make_pod("a", phase="Running")])
    alloc = make_allocator(tmp_path, pods)
    alloc.load()
    alloc.adopt(
        [journal_alloc(uid_of("a"), "c0", (0,), 50)],
        source="test",
    )
    alloc.compact()
    alloc.adopt([journal_alloc(uid_of("b"), "c0", (1,), 50)], source="test")
    # a crash here: no snapshot at stop
    alloc._store.close()

    again = make_allocator(tmp_path, FakePods([make_pod("a", phase="Running"), make_pod("b", phase="Running")]))
    try:
        parsed = again.load()
        assert parsed.problems == []
        assert sorted(a.pod_uid for a in parsed.allocations) == sorted([uid_of("a"), uid_of("b")])
    finally:
        again.close()


def journal_alloc(pod: str, container: str, minors: tuple[int, ...], cores: int) -> Any:
    from gpumanager.allocation.records import ContainerAllocation

    return ContainerAllocation(pod_uid=pod, container=container, minors=minors, cores=cores, memory=GIB)


# -- recovery from the kubelet's records ------------------------------------------------------------


class _DeadPodResources:
    """A PodResources client whose kubelet does not answer (restarting as the agent starts)."""

    def list_all(self) -> list[Any]:
        from gpumanager.kube.podresources import PodResourcesUnavailableError

        raise PodResourcesUnavailableError("connection refused")


def _recovery(tmp_path: Path, alloc: Any, kubelet_checkpoint: Path) -> Any:
    from gpumanager.deviceplugin.devices import DeviceLayout
    from gpumanager.recovery import Recovery
    from tests.alloc_fixtures import v100x4

    gpus, _ = v100x4()
    return Recovery(alloc, kubelet_checkpoint_path=kubelet_checkpoint, layout=DeviceLayout(gpus), gpus=gpus)


def test_untrusted_entry_stays_reserved_when_no_kubelet_record_exists(tmp_path: Path) -> None:
    """Our entry of a running pod has a bad field; the kubelet's checkpoint file is not there (nothing was
    read from it) and PodResources does not answer: the GPU its Devices name stays reserved, never free to
    be handed out while the container may still run on it."""
    a = uid_of("a")
    _write_snapshot(tmp_path, {a: {"c0": {"Devices": ["/dev/nvidia3"], "Cores": "fifty", "Memory": GIB}}})
    pods = FakePods([make_pod("a", phase="Running")])
    alloc = make_allocator(tmp_path, pods)
    try:
        rec = _recovery(tmp_path, alloc, tmp_path / "device-plugins" / "kubelet_internal_checkpoint")
        rec.from_disk()
        rec.from_pod_resources(_DeadPodResources(), lambda ns, name: None)
        assert alloc.holds((a, "c0"))
        assert _free_cores(alloc, 3) == 0
    finally:
        alloc.close()


# -- numbers too long to read --------------------------------------------------------------------


def test_a_number_too_long_to_read_distrusts_its_entry_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One entry's Memory is a 5000-digit number (beyond what Python converts): that entry is rebuilt from
    the kubelet's records, named with its field; the other entries are kept, and no traceback is logged."""
    a, b = uid_of("a"), uid_of("b")
    path = _ckpt(tmp_path)
    path.parent.mkdir(parents=True)
    doc = {"PodGPUMapping": {a: {"c0": _entry([0], 50)}, b: {"c0": _entry([1], 50, memory=-12345)}}}
    path.write_text(json.dumps(doc).replace("-12345", "9" * 5000))
    alloc = make_allocator(tmp_path, FakePods([make_pod("a", phase="Running"), make_pod("b", phase="Running")]))
    try:
        with caplog.at_level(logging.INFO):
            parsed = alloc.load()
        assert [x.pod_uid for x in parsed.allocations] == [a]
        assert parsed.untrusted == [(b, "c0")]
        assert any(f"pod {b} container c0" in p and "Memory" in p for p in parsed.problems)
        assert not [r for r in caplog.records if r.exc_info]
        assert path.exists()  # not moved aside: only one entry is in doubt
    finally:
        alloc.close()


def test_kubelet_checkpoint_with_a_number_too_long_to_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The kubelet's checkpoint holds a 5000-digit number: recovery says the file cannot be used, naming it,
    and goes on (our own checkpoint is still recovered), with no exception and no traceback."""
    a = uid_of("a")
    _write_snapshot(tmp_path, {a: {"c0": _entry([0], 50)}})
    kc = tmp_path / "device-plugins" / "kubelet_internal_checkpoint"
    kc.parent.mkdir()
    kc.write_text(json.dumps({"Data": {"PodDeviceEntries": [], "RegisteredDevices": {}}, "Checksum": "N"}))
    kc.write_text(kc.read_text().replace('"N"', "9" * 5000))
    alloc = make_allocator(tmp_path, FakePods([make_pod("a", phase="Running")]))
    try:
        with caplog.at_level(logging.INFO):
            _recovery(tmp_path, alloc, kc).from_disk()
        assert alloc.holds((a, "c0"))
        assert any(str(kc) in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
        assert not [r for r in caplog.records if r.exc_info]
    finally:
        alloc.close()


# -- files of the wrong kind or size -------------------------------------------------------------


def _load_in_thread(target: Any) -> tuple[Any, list[Any]]:
    import threading

    out: list[Any] = []

    def run() -> None:
        try:
            out.append(target())
        except Exception as exc:  # reported to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _unblock(fifo: Path) -> None:
    """Let a reader blocked opening ``fifo`` go (a writer opens and closes it)."""
    import os

    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    os.close(fd)


def test_a_fifo_in_place_of_a_journal_segment_is_reported_not_waited_on(tmp_path: Path) -> None:
    """A FIFO named like a journal segment: the start must not block reading it; it is reported naming the
    file, and the snapshot's entries are recovered."""
    import os

    a = uid_of("a")
    path = _write_snapshot(tmp_path, {a: {"c0": _entry([0], 50)}}, JournalSegment=1)
    fifo = path.with_name(path.name + ".journal-1")
    os.mkfifo(fifo)
    store = CheckpointStore(path)
    thread, out = _load_in_thread(store.load)
    thread.join(30)
    blocked = thread.is_alive()
    _unblock(fifo)
    thread.join(60)
    assert not blocked, "loading blocked on the FIFO"
    loaded = out[0]
    assert isinstance(loaded, journal.Loaded), loaded
    assert loaded.document is not None and a in loaded.document["PodGPUMapping"]
    assert any(str(fifo) in p and "regular file" in p for p in loaded.problems)


def test_a_fifo_in_place_of_the_snapshot_is_reported_not_waited_on(tmp_path: Path) -> None:
    """A FIFO in place of the snapshot: the start reports it as unusable instead of blocking."""
    import os

    from gpumanager.allocation import checkpoint

    path = _ckpt(tmp_path)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    thread, out = _load_in_thread(lambda: checkpoint.read_json(path))
    thread.join(30)
    blocked = thread.is_alive()
    _unblock(path)
    thread.join(60)
    assert not blocked, "reading blocked on the FIFO"
    assert isinstance(out[0], checkpoint.CheckpointError)
    assert str(path) in str(out[0]) and "regular file" in str(out[0])


def test_a_segment_far_larger_than_any_written_is_reported_not_read_whole(tmp_path: Path) -> None:
    """A segment file far larger than the segments this agent writes (a sparse file, a stray copy): it is
    reported with its size and moved aside instead of being read whole into memory."""
    path = _write_snapshot(tmp_path, {}, JournalSegment=1)
    seg = path.with_name(path.name + ".journal-1")
    with seg.open("wb") as f:
        f.write(journal._record(_put("pod-a", "c0", [0], 50)))
        f.truncate(journal.SEGMENT_BYTES * 64 + 1)
    loaded = CheckpointStore(path).load()
    assert any(str(seg) in p and str(journal.SEGMENT_BYTES * 64 + 1) in p for p in loaded.problems)
    assert not seg.exists()


# -- what a damaged segment held stays recovered --------------------------------------------------------


def _crash(alloc: Any) -> None:
    """The process ends without its stop: no snapshot written at stop (only the open files closed)."""
    alloc._closing.set()
    alloc._store.close()


def test_a_release_read_from_a_damaged_segment_survives_the_next_crash(tmp_path: Path) -> None:
    """The journal's segment holds a release of pod b, then a record of no known kind (a newer version's),
    then pod c's allocation. The start replays both changes and moves the segment aside; a crash before
    the snapshot catches up must not bring pod b's allocation back (nor lose pod c's)."""
    a, b, c = uid_of("a"), uid_of("b"), uid_of("c")
    path = _write_snapshot(tmp_path, {a: {"c0": _entry([0], 50)}, b: {"c0": _entry([1], 50)}}, JournalSegment=1)
    seg = path.with_name(path.name + ".journal-1")
    records = [
        journal._record({"op": "del", "pod": b, "container": "c0"}),
        journal._record({"op": "put-v9", "pod": c, "container": "c0"}),
        journal._record(_put(c, "c0", [2], 50)),
    ]
    body = b"".join(records)
    seg.write_bytes(body + b"\0" * (journal.SEGMENT_BYTES - len(body)))
    pods = FakePods([make_pod(n, phase="Running") for n in ("a", "b", "c")])

    first = make_allocator(tmp_path, pods)
    parsed = first.load()
    assert sorted(x.pod_uid for x in parsed.allocations) == sorted([a, c])
    assert parsed.problems  # the unknown record is reported
    _crash(first)

    second = make_allocator(tmp_path, pods)
    try:
        parsed = second.load()
        assert sorted(x.pod_uid for x in parsed.allocations) == sorted([a, c])
    finally:
        second.close()


def test_changes_after_an_upgrade_from_upstream_survive_a_crash_before_the_first_snapshot(tmp_path: Path) -> None:
    """Upgrade in place: the snapshot is upstream's (no journal key). This agent releases pod b and takes
    pod c, each journaled, then crashes before its compactor wrote a snapshot. The next start must replay
    those changes, not discard them as made before another program rewrote the snapshot."""
    a, b, c = uid_of("a"), uid_of("b"), uid_of("c")
    _write_snapshot(tmp_path, {a: {"c0": _entry([0], 50)}, b: {"c0": _entry([1], 50)}})
    pods = FakePods([make_pod(n, phase="Running") for n in ("a", "b", "c")])

    first = make_allocator(tmp_path, pods)
    first.load()
    first.release_pod(b)
    first.adopt([journal_alloc(c, "c0", (2,), 50)], source="test")
    _crash(first)

    second = make_allocator(tmp_path, pods)
    try:
        parsed = second.load()
        assert parsed.problems == []
        assert sorted(x.pod_uid for x in parsed.allocations) == sorted([a, c])
    finally:
        second.close()


def test_share_put_back_over_a_full_gpu_is_recounted_at_release(tmp_path: Path) -> None:
    """Records adopted one at a time (the kubelet's, after ours) that together exceed a GPU: the GPU's charge
    is recounted from what it holds at each release, whichever order they came in."""
    a, b = uid_of("a"), uid_of("b")
    _write_snapshot(tmp_path, {a: {"c0": _entry([0], 70)}})
    pods = FakePods([make_pod("a", phase="Running"), make_pod("b", phase="Running")])
    alloc = make_allocator(tmp_path, pods)
    try:
        alloc.load()
        alloc.adopt([journal_alloc(b, "c0", (0,), 70)], source="kubelet checkpoint")
        alloc.release_pod(b)
        assert _free_cores(alloc, 0) == 30
        alloc.release_pod(a)
        assert _free_cores(alloc, 0) == 100
    finally:
        alloc.close()


def test_temp_files_of_a_snapshot_write_cut_short_are_removed_at_start(tmp_path: Path) -> None:
    """A crash while the snapshot was being written leaves its temp file (``.<name>.<random>``) beside it;
    each such crash would leave one more for good. The start removes them, and only them."""
    path = _write_snapshot(tmp_path, {}, JournalSegment=1)
    left = path.with_name(f".{path.name}.k2j4x9_q")
    left.write_bytes(b'{"PodGPUMapping": {"half')
    other = path.with_name(".gpumanager_node_inventory.abcd")
    other.write_bytes(b"{}")
    CheckpointStore(path).load()
    assert not left.exists()
    assert other.exists()


class _PodResources:
    """A PodResources client whose kubelet answers with ``entries``."""

    def __init__(self, entries: list[Any]) -> None:
        self.entries = entries

    def list_all(self) -> list[Any]:
        return list(self.entries)


def test_untrusted_entry_stays_reserved_when_podresources_names_a_pod_the_api_server_cannot(tmp_path: Path) -> None:
    """Our entry of pod a has a bad field and the kubelet's checkpoint cannot be read. PodResources lists a
    container of pod a holding vcuda-core IDs, but the API server cannot be asked (no pod can be named):
    that is no proof that the entry holds nothing, so its GPU stays reserved."""
    from gpumanager.kube.podresources import ContainerDevices
    from tests.alloc_fixtures import core_ids

    a = uid_of("a")
    _write_snapshot(tmp_path, {a: {"c0": {"Devices": ["/dev/nvidia3"], "Cores": "fifty", "Memory": GIB}}})
    kc = tmp_path / "device-plugins" / "kubelet_internal_checkpoint"
    kc.parent.mkdir()
    kc.write_text("{not json")
    alloc = make_allocator(tmp_path, FakePods([make_pod("a", phase="Running")]))
    try:
        rec = _recovery(tmp_path, alloc, kc)
        rec.from_disk()
        listed = ContainerDevices("default", "a", "c0", "tencent.com/vcuda-core", tuple(core_ids(3, 50)))
        rec.from_pod_resources(_PodResources([listed]), lambda ns, name: None)
        assert alloc.holds((a, "c0"))
        assert _free_cores(alloc, 3) == 0
    finally:
        alloc.close()


def test_containers_podresources_lists_are_taken_once_the_api_server_can_name_their_pods(tmp_path: Path) -> None:
    """Our checkpoint is gone and the kubelet's cannot be read; PodResources lists pod a's container holding
    IDs of GPU 3, but the API server does not answer at start. Recovery is not settled then: it asks again,
    and once the pod can be named its container's GPU is taken (never left free under a running container)."""
    import threading

    from gpumanager.kube.podresources import ContainerDevices
    from gpumanager.retry import Backoff
    from tests.alloc_fixtures import core_ids

    a = uid_of("a")
    pod = make_pod("a", (("c0", 50, 4),), phase="Running")
    kc = tmp_path / "device-plugins" / "kubelet_internal_checkpoint"
    kc.parent.mkdir()
    kc.write_text("{not json")
    alloc = make_allocator(tmp_path, FakePods([pod]))
    try:
        rec = _recovery(tmp_path, alloc, kc)
        rec.from_disk()
        client = _PodResources(
            [ContainerDevices("default", "a", "c0", "tencent.com/vcuda-core", tuple(core_ids(3, 50)))]
        )
        assert rec.from_pod_resources(client, lambda ns, name: None) is False
        assert not alloc.holds((a, "c0"))
        found = rec.retry_pod_resources(
            client,
            lambda ns, name: pod if (ns, name) == ("default", "a") else None,
            threading.Event(),
            Backoff(0.001, 0.01),
        )
        assert found
        assert alloc.holds((a, "c0"))
        assert _free_cores(alloc, 3) == 50
    finally:
        alloc.close()


# -- the GPU inventory kept beside the checkpoint ------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        "[" * 100000,
        '{"gpus": [{"index": 0, "uuid": "GPU-0", "name": "T4", "minor": 0, "memory_total": "16 GiB",'
        ' "pci_bus_id": "0000:01:00.0"}], "levels": [[0]]}',
        '{"gpus": [{"index": 0, "uuid": "GPU-0", "name": "T4", "minor": -3, "memory_total": 1,'
        ' "pci_bus_id": "0000:01:00.0"}], "levels": [[0]]}',
        '{"gpus": [{"index": true, "uuid": "GPU-0", "name": "T4", "minor": 0, "memory_total": 1,'
        ' "pci_bus_id": "0000:01:00.0", "numa_node": "x"}], "levels": [[0]]}',
    ],
    ids=["nested", "memory-string", "minor-negative", "index-bool"],
)
def test_a_damaged_gpu_inventory_is_ignored_with_its_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str
) -> None:
    """A GPU inventory that is not what this agent writes is ignored with a warning naming it: never an
    exception out of the start, never a GPU described with values of the wrong type."""
    from gpumanager.device import inventory

    path = tmp_path / inventory.FILE
    path.write_text(content)
    with caplog.at_level(logging.WARNING):
        gpus, topology = inventory.load(path)
    assert gpus == {} and topology is None
    assert any(str(path) in r.getMessage() for r in caplog.records)


def test_a_fifo_in_place_of_the_gpu_inventory_is_not_waited_on(tmp_path: Path) -> None:
    import os

    from gpumanager.device import inventory

    path = tmp_path / inventory.FILE
    os.mkfifo(path)
    thread, out = _load_in_thread(lambda: inventory.load(path))
    thread.join(30)
    blocked = thread.is_alive()
    _unblock(path)
    thread.join(30)
    assert not blocked, "reading blocked on the FIFO"
    assert out == [({}, None)]
