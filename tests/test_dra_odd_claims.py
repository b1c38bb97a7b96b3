"""Claims no API server should send, and requests no kubelet should make: each gets its own clear error,
the other claims of the request go on, and no GPU capacity is left taken."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from gpumanager.dra.claims import ClaimRef
from tests.test_dra_checkpoint import Node, api_claim


def free_cores(node: Node) -> int:
    return sum(node.allocator._tree.leaf_by_minor(m).allocatable_cores for m in (0, 1))


def _odd(kind: str) -> Any:
    claim = api_claim("u-odd", "odd")
    if kind == "claim-a-list":
        return [claim]
    if kind == "metadata-a-list":
        claim["metadata"] = [claim["metadata"]]
    elif kind == "status-a-string":
        claim["status"] = "allocated"
    elif kind == "devices-a-list":
        claim["status"]["allocation"]["devices"] = [claim["status"]["allocation"]["devices"]]
    elif kind == "results-an-int":
        claim["status"]["allocation"]["devices"]["results"] = 5
    elif kind == "tolerations-an-int":
        claim["status"]["allocation"]["devices"]["results"][0]["tolerations"] = 5
    return claim


@pytest.mark.parametrize(
    "kind",
    [
        "claim-a-list",
        "metadata-a-list",
        "status-a-string",
        "devices-a-list",
        "results-an-int",
        "tolerations-an-int",
    ],
)
def test_a_malformed_claim_fails_alone(tmp_path: Path, kind: str) -> None:
    node = Node(tmp_path, {"odd": _odd(kind), "good": api_claim("u-good", "good", device="gpu-1")})
    out = node.preparer.prepare([ClaimRef("ml", "odd", "u-odd"), ClaimRef("ml", "good", "u-good")])
    assert not out["u-good"].error and out["u-good"].devices, "the other claim of the request was not prepared"
    if kind == "tolerations-an-int":  # tolerates nothing: prepared on a healthy GPU all the same
        assert not out["u-odd"].error
        return
    assert out["u-odd"].error and "ml/odd" in out["u-odd"].error, out["u-odd"]
    assert [c.uid for c in node.allocator.claims()] == ["u-good"]


def test_a_uid_too_long_for_the_limit_file_is_refused_before_anything_is_taken(tmp_path: Path) -> None:
    uid = "a" * 60  # a plain name, but vcuda.config holds 47 bytes of it
    claim = api_claim(uid, "long")
    node = Node(tmp_path, {"long": claim})
    before = free_cores(node)
    out = node.preparer.prepare([ClaimRef("ml", "long", uid)])
    assert out[uid].error and uid in out[uid].error
    assert node.allocator.claims() == [] and free_cores(node) == before


def test_a_claim_whose_files_cannot_be_made_is_undone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumanager.vmanager import claims as claim_files

    node = Node(tmp_path, {"c": api_claim("u-c", "c")})
    before = free_cores(node)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise ValueError("the limit file refuses this claim")

    monkeypatch.setattr(claim_files, "write_config", broken)
    out = node.preparer.prepare([ClaimRef("ml", "c", "u-c")])
    assert out["u-c"].error and "ml/c" in out["u-c"].error
    assert node.allocator.claims() == [] and free_cores(node) == before, "the capacity stayed taken"


@pytest.mark.parametrize(
    "second",
    [
        {"adminAccess": True},  # the same GPU twice under one request, no share ID: one CDI device name
        {"request": "gpu", "adminAccess": True},
    ],
)
def test_results_that_would_be_one_cdi_device_are_refused(tmp_path: Path, second: dict[str, Any]) -> None:
    claim = api_claim("u-dup", "dup")
    first = claim["status"]["allocation"]["devices"]["results"][0]
    first.pop("shareID")
    first.pop("consumedCapacity")
    first["adminAccess"] = True
    claim["status"]["allocation"]["devices"]["results"].append({**copy.deepcopy(first), **second})
    node = Node(tmp_path, {"dup": claim})
    out = node.preparer.prepare([ClaimRef("ml", "dup", "u-dup")])
    assert out["u-dup"].error and "CDI device" in out["u-dup"].error, out["u-dup"]


def test_a_prepared_uid_under_another_name_is_neither_answered_nor_freed(tmp_path: Path) -> None:
    node = Node(tmp_path, {"a": api_claim("u-a", "a")})
    node.prepare("u-a", "a")
    wrong = ClaimRef("other", "b", "u-a")
    out = node.preparer.prepare([wrong])
    assert out["u-a"].error and "ml/a" in out["u-a"].error
    assert node.preparer.unprepare([wrong])["u-a"]
    assert [c.uid for c in node.allocator.claims()] == ["u-a"] and node.files("u-a")


def test_one_odd_claim_does_not_stop_the_rebuild_of_the_others(tmp_path: Path) -> None:
    api = {"a": api_claim("u-a", "a"), "b": api_claim("u-b", "b", device="gpu-1")}
    node = Node(tmp_path, api)
    node.prepare("u-a", "a")
    node.prepare("u-b", "b")
    node.allocator.close()
    for p in (tmp_path / "cp").glob("gpumanager_internal_checkpoint*"):
        p.unlink()  # the records are lost; the specs and directories stay
    api["a"] = "not a claim"  # type: ignore[assignment]
    restarted = Node(tmp_path, api)
    restarted.allocator.load()
    restarted.preparer.restore_files()
    assert [c.uid for c in restarted.allocator.claims()] == ["u-b"], "the claim after the odd one was not rebuilt"
