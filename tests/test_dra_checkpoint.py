"""Prepared claims in the checkpoint journal: one durable record per change, no rewrite of the snapshot,
recovered after a restart or a crash, damage reported and what it lost rebuilt from the API server."""

from __future__ import annotations

import errno
import json
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from gpumanager.allocation import journal
from gpumanager.allocation.allocator import AllocationError, Allocator, AllocatorSettings
from gpumanager.allocation.claims import ClaimAllocation
from gpumanager.allocation.journal import read_document
from gpumanager.allocation.response import ResponseSettings
from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.dra import cdi
from gpumanager.dra.claims import ClaimNotFound, ClaimRef, parse_claim
from gpumanager.dra.prepare import ClaimPreparer
from gpumanager.topology import build_tree

GiB = 1 << 30
DRIVER = "vcuda.tencent.com"
POOL = "node-a"
GPUS = [
    GPUInfo(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", i, 81559 << 20, f"00000000:{i + 7:02x}:00.0", 0) for i in range(2)
]
TOPOLOGY = NodeTopology(levels=((0, 40), (40, 0)))


class NoPods:
    def synced(self) -> bool:
        return True

    def pods(self) -> list[Any]:
        return []

    def get(self, uid: str) -> None:
        return None

    def changes(self, since: int) -> tuple[int, frozenset[str] | None]:
        return 0, frozenset()

    def refresh(self) -> list[Any]:
        return []

    def recent(self, within: float, since: float) -> list[Any] | None:
        return None


def allocator(tmp_path: Path) -> Allocator:
    settings = AllocatorSettings(True, ResponseSettings("n", "o", str(tmp_path / "vm")))
    return Allocator(
        gpus=GPUS,
        tree=build_tree(GPUS, TOPOLOGY),
        pods=NoPods(),
        settings=settings,
        checkpoint_path=tmp_path / "cp" / "gpumanager_internal_checkpoint",
    )


def api_claim(uid: str, name: str, device: str = "gpu-0", cores: int = 30, reserved: bool = True) -> dict[str, Any]:
    result = {
        "request": "gpu",
        "driver": DRIVER,
        "pool": POOL,
        "device": device,
        "shareID": f"share-{uid}",
        "consumedCapacity": {"cores": str(cores), "memory": "4Gi"},
    }
    status: dict[str, Any] = {"allocation": {"devices": {"results": [result]}}}
    if reserved:
        status["reservedFor"] = [{"resource": "pods", "name": f"pod-{name}", "uid": f"pod-{uid}"}]
    return {"metadata": {"uid": uid, "name": name, "namespace": "ml"}, "status": status}


def share(uid: str, name: str, device: str = "gpu-0", cores: int = 30) -> ClaimAllocation:
    claim, _ = parse_claim(
        api_claim(uid, name, device, cores), ClaimRef("ml", name, uid), driver=DRIVER, pool=POOL, gpus=GPUS
    )
    return claim


def journal_records(tmp_path: Path) -> list[dict[str, Any]]:
    """Every record in the journal segments, in order."""
    out = []
    for segment in sorted((tmp_path / "cp").glob("gpumanager_internal_checkpoint.journal-*")):
        data = segment.read_bytes()
        for line in data[: data.find(b"\0") if b"\0" in data else len(data)].splitlines():
            out.append(json.loads(line[18:]))
    return out


def snapshot_state(tmp_path: Path) -> tuple[int, int]:
    st = (tmp_path / "cp" / "gpumanager_internal_checkpoint").stat()
    return st.st_ino, st.st_mtime_ns


def test_prepare_and_unprepare_are_one_journal_record_each_and_leave_the_snapshot_alone(tmp_path: Path) -> None:
    a = allocator(tmp_path)
    a.probe_checkpoint()  # the snapshot exists, as after any start
    snapshot = snapshot_state(tmp_path)
    one = share("u1", "one")
    assert a.prepare_claim(one) is True
    assert journal_records(tmp_path) == [{"op": "claim-put", "uid": "u1", "entry": one.to_json()}]
    assert a.unprepare_claim("u1") == one
    assert journal_records(tmp_path)[1:] == [{"op": "claim-del", "uid": "u1"}]
    assert snapshot_state(tmp_path) == snapshot, "a Prepare must not rewrite the whole checkpoint"
    assert a.checkpoint_writes == 3
    # The snapshot catches up in the background, in the same document.
    a.prepare_claim(share("u2", "two"))
    a.compact()
    on_disk = json.loads((tmp_path / "cp" / "gpumanager_internal_checkpoint").read_text())
    assert list(on_disk["Claims"]) == ["u2"] and on_disk["PodGPUMapping"] == {}


def test_claims_come_back_from_the_journal_after_the_process_died(tmp_path: Path) -> None:
    first = allocator(tmp_path)
    first.probe_checkpoint()
    for uid, name in (("u1", "one"), ("u2", "two"), ("u3", "three")):
        first.prepare_claim(share(uid, name))
    first.unprepare_claim("u2")
    # No compaction, no close: SIGKILL.
    second = allocator(tmp_path)
    loaded = second.load()
    assert [c.uid for c in second.claims()] == ["u1", "u3"] and loaded.problems == []
    assert not second.claims_in_doubt
    assert second.tree_snapshot()[0][1] == 40, "the recovered claims hold their 2 x 30 cores again"
    assert sorted((read_document(second.checkpoint_path) or {})["Claims"]) == ["u1", "u3"]


def test_a_claim_record_cut_short_by_a_crash_is_ignored(tmp_path: Path) -> None:
    first = allocator(tmp_path)
    first.probe_checkpoint()
    first.prepare_claim(share("u1", "one"))
    first.prepare_claim(share("u2", "two"))
    (segment,) = (tmp_path / "cp").glob("gpumanager_internal_checkpoint.journal-*")
    data = bytearray(segment.read_bytes())
    end = data.index(b"\0")
    data[end - 25 : end] = b"\0" * 25  # SIGKILL while the last record was being written: never answered
    segment.write_bytes(bytes(data))
    second = allocator(tmp_path)
    loaded = second.load()
    assert [c.uid for c in second.claims()] == ["u1"]
    assert loaded.problems == [] and not second.claims_in_doubt


class Node:
    """An allocator and a claim preparer over one checkpoint, CDI root and claim directory root."""

    def __init__(self, tmp_path: Path, api: dict[str, dict[str, Any]]) -> None:
        self.api = api
        self.reads: list[str] = []
        self.gate: threading.Event | None = None  # set: each read waits for it (a slow API server)
        self.reading = threading.Event()
        self.gate_names: set[str] | None = None  # the reads the gate holds (None: all)
        self.allocator = allocator(tmp_path)
        self.cdi = cdi.CDISettings(tmp_path / "cdi", DRIVER, "/vdriver/nvidia", "/vdriver/origin", str(tmp_path / "vm"))
        self.vm = tmp_path / "vm"
        self.preparer = ClaimPreparer(
            read_claim=self.read,
            allocator=self.allocator,
            gpus=GPUS,
            driver=DRIVER,
            pool=POOL,
            cdi_settings=self.cdi,
            vm_path=self.vm,
            driver_version="550.54.15",
        )

    def read(self, namespace: str, name: str) -> dict[str, Any]:
        self.reads.append(name)
        if self.gate_names is None or name in self.gate_names:
            self.reading.set()
            if self.gate is not None:
                assert self.gate.wait(10)
        if name not in self.api:
            raise ClaimNotFound(f"claim {namespace}/{name} not found")
        return self.api[name]

    def prepare(self, uid: str, name: str) -> None:
        outcome = self.preparer.prepare([ClaimRef("ml", name, uid)])[uid]
        assert not outcome.error and outcome.devices

    def files(self, uid: str) -> bool:
        return cdi.spec_path(self.cdi, uid).exists() and (self.vm / uid / "vcuda.config").exists()


def test_claims_a_damaged_journal_lost_are_rebuilt_from_the_api_server(tmp_path: Path) -> None:
    api = {name: api_claim(uid, name) for uid, name in (("u1", "one"), ("u2", "two"), ("u3", "three"))}
    node = Node(tmp_path, api)
    node.allocator.probe_checkpoint()
    node.prepare("u1", "one")
    node.allocator.compact()  # u1 is in the snapshot
    for uid, name in (("u2", "two"), ("u3", "three")):
        node.prepare(uid, name)
    node.preparer.unprepare([ClaimRef("ml", "one", "u1")])
    del api["one"]  # its pod ended, the claim is gone
    assert not node.files("u1")
    (segment,) = (tmp_path / "cp").glob("gpumanager_internal_checkpoint.journal-*")
    data = bytearray(segment.read_bytes())
    data[30] ^= 0xFF  # damage in u2's record: u2 is lost (u3 and u1's release, whole records after it, are not)
    segment.write_bytes(bytes(data))

    after = Node(tmp_path, api)
    loaded = after.allocator.load()
    assert [p for p in loaded.problems if "damaged record at offset 0" in p]
    assert list((tmp_path / "cp").glob("gpumanager_internal_checkpoint.journal-*.corrupt-*"))
    assert after.allocator.claims_in_doubt
    assert [c.uid for c in after.allocator.claims()] == ["u3"], "the snapshot's u1, released after; u3 replayed"
    removed = after.preparer.restore_files(verify_recovered=after.allocator.claims_in_doubt)
    assert removed == []
    assert [c.uid for c in after.allocator.claims()] == ["u2", "u3"]
    assert after.allocator.claim("u2") == share("u2", "two")
    assert after.files("u2") and after.files("u3") and not after.files("u1")
    assert after.allocator.tree_snapshot()[0][1] == 40, "u1's 30 cores are free again, u2's and u3's held"
    # The rebuilt state is durable: a third start finds it without asking anyone.
    third = Node(tmp_path, {})
    assert third.allocator.load().problems == [] and not third.allocator.claims_in_doubt
    assert [c.uid for c in third.allocator.claims()] == ["u2", "u3"]


def test_after_damage_a_recovered_claim_the_api_server_no_longer_reserves_is_freed(tmp_path: Path) -> None:
    api = {"one": api_claim("u1", "one"), "two": api_claim("u2", "two"), "three": api_claim("u3", "three")}
    node = Node(tmp_path, api)
    node.allocator.probe_checkpoint()
    for uid, name in (("u1", "one"), ("u2", "two"), ("u3", "three")):
        node.prepare(uid, name)
    node.allocator.compact()  # all three in the snapshot; their releases go to the journal
    node.preparer.unprepare([ClaimRef("ml", "one", "u1"), ClaimRef("ml", "two", "u2")])
    api["one"] = api_claim("u1", "one", reserved=False)  # its pods are gone, the claim stays
    api["two"] = api_claim("u2-new", "two")  # deleted and made again under the same name
    (segment,) = (tmp_path / "cp").glob("gpumanager_internal_checkpoint.journal-*")
    data = bytearray(segment.read_bytes())
    data[30] ^= 0xFF  # u1's release lost (u2's, the whole record after it, is replayed)
    segment.write_bytes(bytes(data))
    after = Node(tmp_path, api)
    after.allocator.load()
    assert [c.uid for c in after.allocator.claims()] == ["u1", "u3"] and after.allocator.claims_in_doubt
    assert sorted(after.preparer.restore_files(verify_recovered=True)) == ["u1"]
    assert [c.uid for c in after.allocator.claims()] == ["u3"] and after.files("u3")
    assert after.allocator.tree_snapshot()[0][1] == 70


def test_without_damage_recovered_claims_are_not_checked_against_the_api_server(tmp_path: Path) -> None:
    node = Node(tmp_path, {"one": api_claim("u1", "one")})
    node.allocator.probe_checkpoint()
    node.prepare("u1", "one")
    node.reads.clear()
    after = Node(tmp_path, {})  # the API server would say it is gone: it is not asked
    after.allocator.load()
    assert not after.allocator.claims_in_doubt
    assert after.preparer.restore_files(verify_recovered=after.allocator.claims_in_doubt) == []
    assert after.reads == [] and [c.uid for c in after.allocator.claims()] == ["u1"] and after.files("u1")


@pytest.mark.parametrize("write_fails", ["prepare", "unprepare"])
def test_a_claim_record_that_cannot_be_written_refuses_the_change(
    tmp_path: Path, write_fails: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = allocator(tmp_path)
    a.probe_checkpoint()
    one = share("u1", "one")
    if write_fails == "unprepare":
        a.prepare_claim(one)

    def full(self: object, offset: int, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(journal._Segment, "write_at", full)
    with pytest.raises(AllocationError, match=r"claim ml/one \(u1\): cannot write checkpoint .*ENOSPC") as err:
        if write_fails == "prepare":
            a.prepare_claim(one)
        else:
            a.unprepare_claim("u1")
    assert err.value.kind == "unavailable" and "ENOSPC" in a.checkpoint_error
    # Refused: nothing prepared. Unprepared: kept prepared, as the checkpoint has it (the kubelet retries an
    # Unprepare that failed, and that retry writes the release).
    if write_fails == "prepare":
        assert a.claims() == [] and a.tree_snapshot()[0][1] == 100
    else:
        assert a.claims() == [one] and a.tree_snapshot()[0][1] == 70
    monkeypatch.undo()
    a.prepare_claim(share("u2", "two"))
    assert not a.checkpoint_error
    kept = ["u1"] if write_fails == "unprepare" else []
    assert sorted((read_document(a.checkpoint_path) or {}).get("Claims", {})) == [*kept, "u2"]


def test_generation_moves_when_a_claim_is_prepared_or_unprepared(tmp_path: Path) -> None:
    a = allocator(tmp_path)
    before = a.generation
    a.prepare_claim(share("u1", "one"))
    prepared = a.generation
    a.unprepare_claim("u1")
    assert len({before, prepared, a.generation}) == 3


def restarted_without_records(tmp_path: Path) -> Node:
    """Claims u1 ("one") and u2 ("two") prepared, then every record lost (both keep their files): the
    restarted node, its local restoration done, its check against the API server not begun."""
    api = {"one": api_claim("u1", "one"), "two": api_claim("u2", "two")}
    node = Node(tmp_path, api)
    node.allocator.probe_checkpoint()
    node.prepare("u1", "one")
    node.prepare("u2", "two")
    node.allocator.compact()
    shutil.rmtree(tmp_path / "cp")
    after = Node(tmp_path, api)
    after.allocator.load()
    after.preparer.restore_local()
    return after


@pytest.mark.parametrize("kubelet", ["unprepares", "prepares"])
def test_the_kubelets_word_during_the_check_after_a_restart_is_kept(tmp_path: Path, kubelet: str) -> None:
    """The check against the API server runs while the kubelet is served: a claim the kubelet
    unprepares meanwhile is not recorded again from what the API server said before, and one it
    prepares meanwhile is left as the kubelet's Prepare recorded it."""
    after = restarted_without_records(tmp_path)
    gate = after.gate = threading.Event()
    removed: list[list[str]] = []
    check = threading.Thread(target=lambda: removed.append(after.preparer.reconcile(verify_recovered=True)))
    check.start()
    assert after.reading.wait(10)
    after.gate = None  # the kubelet's own reads are answered at once; the check's first one waits
    if kubelet == "unprepares":
        assert after.preparer.unprepare([ClaimRef("ml", "one", "u1"), ClaimRef("ml", "two", "u2")]) == {
            "u1": "",
            "u2": "",
        }
    else:
        after.prepare("u1", "one")
        after.prepare("u2", "two")
    gate.set()
    check.join(10)
    assert removed == [[]]
    held = [c.uid for c in after.allocator.claims()]
    if kubelet == "unprepares":
        assert held == [] and not after.files("u1") and not after.files("u2")
    else:
        assert held == ["u1", "u2"] and after.files("u1") and after.files("u2")


def test_a_claim_unprepared_after_it_was_rebuilt_does_not_get_its_files_back(tmp_path: Path) -> None:
    """The check rebuilds u1, then waits on the API server for u2; the kubelet unprepares u1 meanwhile.
    u1's files stay removed: written again with no record behind them, the next restart would
    record it again and hold its GPU for a claim the kubelet has let go."""
    after = restarted_without_records(tmp_path)
    gate = after.gate = threading.Event()
    after.gate_names = {"two"}
    removed: list[list[str]] = []
    check = threading.Thread(target=lambda: removed.append(after.preparer.reconcile()))
    check.start()
    assert after.reading.wait(10)
    assert [c.uid for c in after.allocator.claims()] == ["u1"], "u1 was rebuilt first"
    assert after.preparer.unprepare([ClaimRef("ml", "one", "u1")]) == {"u1": ""}
    gate.set()
    check.join(10)
    assert removed == [[]]
    assert [c.uid for c in after.allocator.claims()] == ["u2"]
    assert not after.files("u1") and after.files("u2")
