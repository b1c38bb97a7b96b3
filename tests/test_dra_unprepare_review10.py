"""NodeUnprepareResources when the checkpoint cannot be written: the claim stays prepared (in memory as on
disk) and the kubelet is told the Unprepare failed, so that its retry writes the release again. Freed in
memory only, the claim came back from the checkpoint at the next start, files rewritten, its share held
for good: the kubelet, told the retry succeeded, never unprepares it again."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from gpumanager.allocation import journal
from gpumanager.allocation.allocator import AllocationError
from gpumanager.allocation.journal import read_document
from gpumanager.dra.claims import ClaimError, ClaimRef
from tests.test_dra_checkpoint import Node, allocator, api_claim, share


def _full(self: object, *args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _disk_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every checkpoint write fails: journal records and whole snapshots."""
    monkeypatch.setattr(journal._Segment, "write_at", _full)
    monkeypatch.setattr(journal.CheckpointStore, "write_snapshot", _full)


def _on_disk(tmp_path: Path) -> list[str]:
    """The claims the next start finds (the snapshot with the journal replayed)."""
    after = allocator(tmp_path)
    after.load()
    return [c.uid for c in after.claims()]


@pytest.mark.parametrize("fails", ["record", "snapshot"])
def test_an_unprepare_that_cannot_be_written_keeps_the_claim(
    tmp_path: Path, fails: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``record``: the journal record cannot be written (sync); ``snapshot``: a write failed before, so the
    release is staged as a whole snapshot, which fails too (stage)."""
    a = allocator(tmp_path)
    a.probe_checkpoint()
    a.prepare_claim(share("u1", "one"))
    a.prepare_claim(share("u2", "two"))
    if fails == "record":
        monkeypatch.setattr(journal._Segment, "write_at", _full)
    else:
        _disk_full(monkeypatch)
        with pytest.raises(AllocationError):
            a.prepare_claim(share("u3", "three"))  # a failed write: the next one is a whole snapshot
    generation = a.generation
    with pytest.raises(AllocationError, match=r"claim ml/one \(u1\): .*ENOSPC.*kept prepared") as err:
        a.unprepare_claim("u1")
    assert err.value.kind == "unavailable"
    assert [c.uid for c in a.claims()] == ["u1", "u2"], "still prepared, as the checkpoint says"
    assert a.tree_snapshot()[0][1] == 40, "its 30 cores still held"
    assert a.generation >= generation
    monkeypatch.undo()
    assert _on_disk(tmp_path) == ["u1", "u2"]
    # The kubelet's retry, once the disk has room, writes the release.
    assert a.unprepare_claim("u1") == share("u1", "one")
    assert [c.uid for c in a.claims()] == ["u2"] and a.tree_snapshot()[0][1] == 70
    assert _on_disk(tmp_path) == ["u2"]
    assert sorted((read_document(a.checkpoint_path) or {}).get("Claims", {})) in (["u1", "u2"], ["u2"])


def test_write_fails_then_the_agent_restarts_the_kubelets_retry_frees_the_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = {"one": api_claim("u1", "one"), "two": api_claim("u2", "two")}
    node = Node(tmp_path, api)
    node.allocator.probe_checkpoint()
    node.prepare("u1", "one")
    node.prepare("u2", "two")
    _disk_full(monkeypatch)
    out = node.preparer.unprepare([ClaimRef("ml", "one", "u1")])
    assert "ENOSPC" in out["u1"]
    assert node.allocator.claim("u1") is not None and node.files("u1"), "left prepared, files and all"
    # The kubelet retries while the disk is still full: refused again, never 'done' with the release unwritten.
    out = node.preparer.unprepare([ClaimRef("ml", "one", "u1")])
    assert "ENOSPC" in out["u1"] and node.allocator.claim("u1") is not None and node.files("u1")
    monkeypatch.undo()
    # The agent restarts before anything could be written: the claim is back, as the kubelet still has it.
    after = Node(tmp_path, api)
    after.allocator.load()
    assert after.preparer.restore_files(verify_recovered=after.allocator.claims_in_doubt) == []
    assert [c.uid for c in after.allocator.claims()] == ["u1", "u2"] and after.files("u1")
    # The kubelet's retry of the Unprepare it was refused frees it for good.
    assert after.preparer.unprepare([ClaimRef("ml", "one", "u1")]) == {"u1": ""}
    assert not after.files("u1") and after.allocator.tree_snapshot()[0][1] == 70
    third = Node(tmp_path, api)
    third.allocator.load()
    third.preparer.restore_files(verify_recovered=third.allocator.claims_in_doubt)
    assert [c.uid for c in third.allocator.claims()] == ["u2"] and not third.files("u1")
    assert third.allocator.tree_snapshot()[0][1] == 70, "no share of u1 held after any number of starts"


def test_write_fails_then_the_retry_succeeds_and_the_agent_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order of the defect: the release unwritten, the kubelet's retry answered 'done', a restart before any
    later write. The retry now writes the release before it answers."""
    api = {"one": api_claim("u1", "one"), "two": api_claim("u2", "two")}
    node = Node(tmp_path, api)
    node.allocator.probe_checkpoint()
    node.prepare("u1", "one")
    node.prepare("u2", "two")
    monkeypatch.setattr(journal._Segment, "write_at", _full)
    assert "ENOSPC" in node.preparer.unprepare([ClaimRef("ml", "one", "u1")])["u1"]
    monkeypatch.undo()
    assert node.preparer.unprepare([ClaimRef("ml", "one", "u1")]) == {"u1": ""}
    assert not node.files("u1")
    # SIGKILL now: no compaction, no close.
    after = Node(tmp_path, api)
    after.allocator.load()
    after.preparer.restore_files(verify_recovered=after.allocator.claims_in_doubt)
    assert [c.uid for c in after.allocator.claims()] == ["u2"]
    assert not after.files("u1"), "its files must not be rewritten"
    assert after.allocator.tree_snapshot()[0][1] == 70


def test_the_files_are_left_until_the_release_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether the files were already gone (removed by hand, or a tmpfs /var/run/cdi after a reboot) or not,
    a failed write leaves the claim prepared, and the retry removes what is left."""
    api = {"one": api_claim("u1", "one")}
    node = Node(tmp_path, api)
    node.allocator.probe_checkpoint()
    node.prepare("u1", "one")
    node.preparer._remove_files("u1")
    _disk_full(monkeypatch)
    assert "ENOSPC" in node.preparer.unprepare([ClaimRef("ml", "one", "u1")])["u1"]
    assert node.allocator.claim("u1") is not None
    monkeypatch.undo()
    assert node.preparer.unprepare([ClaimRef("ml", "one", "u1")]) == {"u1": ""}
    assert node.allocator.claims() == [] and not node.files("u1") and _on_disk(tmp_path) == []


def test_a_claim_rebuilt_at_start_while_the_checkpoint_cannot_be_written_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim with files but no record (its record lost) is rebuilt from the API server at start; when its
    record cannot be written then, it is not left with its files and no record (its GPUs free to another
    claim, for good): it waits with the claims the API server could not be asked about, its GPUs taking no
    new claim, and is rebuilt once the checkpoint can be written."""
    api = {"one": api_claim("u1", "one", cores=30), "big": api_claim("u2", "big", cores=80)}
    node = Node(tmp_path, api)
    node.allocator.probe_checkpoint()
    node.prepare("u1", "one")
    for f in (tmp_path / "cp").iterdir():  # the record lost (a checkpoint directory wiped)
        f.unlink()
    after = Node(tmp_path, api)
    after.allocator.load()
    _disk_full(monkeypatch)
    assert after.preparer.restore_files(verify_recovered=after.allocator.claims_in_doubt) == []
    assert after.allocator.claims() == [] and after.files("u1")
    assert set(after.preparer.unreadable()) == {"u1"}, "its rebuild waits; meanwhile its GPU takes no new claim"
    monkeypatch.undo()
    out = after.preparer.prepare([ClaimRef("ml", "big", "u2")])["u2"]
    assert "u1" in out.error and not out.devices, "80 cores beside u1's 30 would over-commit gpu-0"
    assert after.preparer.retry_unreadable() == 0
    assert [c.uid for c in after.allocator.claims()] == ["u1"] and after.files("u1")
    assert after.allocator.tree_snapshot()[0][1] == 70
    assert _on_disk(tmp_path) == ["u1"]


def _damage_u1s_release(tmp_path: Path, api: dict[str, Any]) -> None:
    """u1 and u2 prepared and in the snapshot; u1 unprepared, its release damaged in the journal; u1's pod gone."""
    node = Node(tmp_path, api)
    node.allocator.probe_checkpoint()
    node.prepare("u1", "one")
    node.prepare("u2", "two")
    node.allocator.compact()
    node.preparer.unprepare([ClaimRef("ml", "one", "u1")])
    api["one"] = api_claim("u1", "one", reserved=False)
    (segment,) = (tmp_path / "cp").glob("gpumanager_internal_checkpoint.journal-*")
    data = bytearray(segment.read_bytes())
    data[30] ^= 0xFF  # u1's release lost
    segment.write_bytes(bytes(data))


def test_a_claim_the_check_after_damage_cannot_free_is_checked_again_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start after damage writes the whole state (the damage gone from disk), then checks the recovered
    claims: u1, whose release the damage lost, is reserved for no pod. When its release cannot be written and
    the agent restarts before any later write, the next start must still check u1 (no kubelet unprepares it)."""
    api = {"one": api_claim("u1", "one"), "two": api_claim("u2", "two")}
    _damage_u1s_release(tmp_path, api)
    first = Node(tmp_path, api)
    first.allocator.load()
    assert first.allocator.claims_in_doubt and not first.allocator.checkpoint_error, "the whole state written"
    _disk_full(monkeypatch)
    first.preparer.restore_files(verify_recovered=True)
    assert first.allocator.claim("u1") is not None and first.files("u1"), "kept as the checkpoint has it"
    monkeypatch.undo()
    # SIGKILL before any later write.
    second = Node(tmp_path, api)
    second.allocator.load()
    assert second.allocator.claims_in_doubt, "u1 was never checked: still in doubt"
    assert second.preparer.restore_files(verify_recovered=second.allocator.claims_in_doubt) == ["u1"]
    assert [c.uid for c in second.allocator.claims()] == ["u2"] and not second.files("u1")
    third = Node(tmp_path, api)
    third.allocator.load()
    assert not third.allocator.claims_in_doubt, "checked: no doubt left"
    assert [c.uid for c in third.allocator.claims()] == ["u2"]


def test_a_claim_the_check_after_damage_cannot_free_is_freed_once_the_checkpoint_can_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = {"one": api_claim("u1", "one"), "two": api_claim("u2", "two")}
    _damage_u1s_release(tmp_path, api)
    first = Node(tmp_path, api)
    first.allocator.load()
    _disk_full(monkeypatch)
    first.preparer.restore_files(verify_recovered=True)
    monkeypatch.undo()
    first.preparer.retry_unreadable()
    assert [c.uid for c in first.allocator.claims()] == ["u2"] and not first.files("u1")
    assert _on_disk(tmp_path) == ["u2"]


@pytest.mark.parametrize("then", ["restart", "retry"])
def test_a_check_after_damage_the_api_server_cannot_answer_is_made_again(tmp_path: Path, then: str) -> None:
    """The check of u1 and u2 cannot ask the API server: both stay in doubt (in the checkpoint too); the next
    start, or the retry in the background, checks them: u1 freed, u2 (reserved) no longer in doubt."""
    api = {"one": api_claim("u1", "one"), "two": api_claim("u2", "two")}
    _damage_u1s_release(tmp_path, api)
    node = Node(tmp_path, api)
    node.allocator.load()

    def unreachable(namespace: str, name: str) -> dict[str, Any]:
        raise ClaimError(f"claim {namespace}/{name}: cannot read it: connection refused")

    node.preparer._read = unreachable
    assert node.preparer.restore_files(verify_recovered=True) == []
    assert node.preparer.unchecked() == ["u1", "u2"]
    if then == "restart":
        node.allocator._closing.set()
        node.allocator._store.close()  # SIGKILL
        node = Node(tmp_path, api)
        node.allocator.load()
        assert node.allocator.claims_in_doubt, "the marks are in the checkpoint"
        assert node.preparer.restore_files(verify_recovered=node.allocator.claims_in_doubt) == ["u1"]
    else:
        node.preparer._read = node.read
        assert node.preparer.retry_unreadable() == 0
    assert node.preparer.unchecked() == [] and [c.uid for c in node.allocator.claims()] == ["u2"]
    assert not node.files("u1") and node.files("u2")
    node.allocator._closing.set()
    node.allocator._store.close()
    after = Node(tmp_path, api)
    after.allocator.load()
    assert not after.allocator.claims_in_doubt and [c.uid for c in after.allocator.claims()] == ["u2"]
