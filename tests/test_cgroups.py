"""Finding a container's host PIDs in cgroup v1/v2 trees, cgroupfs and systemd naming, every runtime."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumanager.vmanager import cgroups

UID = "0d7a6c3e-1f2b-4c5d-8e9f-001122334455"
CID = "4f9c2a"
U_ = UID.replace("-", "_")


def make(root: Path, rel: str, pids: list[int], child_pids: list[int] | None = None) -> None:
    d = root / rel
    d.mkdir(parents=True)
    (d / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    if child_pids is not None:
        (d / "sub").mkdir()
        (d / "sub" / "cgroup.procs").write_text("".join(f"{p}\n" for p in child_pids))


@pytest.mark.parametrize(
    ("rel", "qos"),
    [
        (f"memory/kubepods/burstable/pod{UID}/{CID}", "Burstable"),
        (f"memory/kubepods/pod{UID}/{CID}", "Guaranteed"),
        (f"kubepods/besteffort/pod{UID}/{CID}", "BestEffort"),
        (
            f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice/cri-containerd-{CID}.scope",
            "Burstable",
        ),
        (f"memory/kubepods.slice/kubepods-pod{U_}.slice/docker-{CID}.scope", "Guaranteed"),
        (
            f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{U_}.slice/crio-{CID}.scope",
            None,
        ),
        (f"system.slice/containerd.service/kubepods-pod{U_}.slice:cri-containerd:{CID}", None),
    ],
)
def test_layouts(tmp_path: Path, rel: str, qos: str | None) -> None:
    make(tmp_path, rel, [42, 7], child_pids=[99])
    make(tmp_path, f"kubepods/pod{UID}/other", [1000])  # another container of the pod
    assert cgroups.container_pids(tmp_path, UID, CID, qos) == [7, 42, 99]


def test_missing_cgroup_gives_no_pids(tmp_path: Path) -> None:
    make(tmp_path, f"kubepods/pod{UID}/other", [1000])
    assert cgroups.container_pids(tmp_path, UID, CID) == []


def test_the_locator_follows_children_that_come_and_go(tmp_path: Path) -> None:
    """A container's cgroup read alone while it has no child, and with its children once it has."""
    rel = f"kubepods/pod{UID}/{CID}"
    make(tmp_path, rel, [42, 7])
    locator = cgroups.CgroupLocator(tmp_path)
    assert locator.pids(UID, CID) == [7, 42]
    child = tmp_path / rel / "sub"
    child.mkdir()
    (child / "cgroup.procs").write_text("99\n")
    assert locator.pids(UID, CID) == [7, 42, 99]
    (child / "cgroup.procs").unlink()
    child.rmdir()
    assert locator.pids(UID, CID) == [7, 42]


def test_a_directory_whose_links_are_not_counted_is_walked(tmp_path: Path) -> None:
    """Some file systems give every directory one link: the tree is walked, not the top alone."""
    make(tmp_path, "c", [5], child_pids=[6])
    assert cgroups._pids_of(str(tmp_path / "c"), 1) == [5, 6]
    assert cgroups._pids_of(str(tmp_path / "c"), 3) == [5, 6]


def test_the_locator_finds_a_cgroup_that_moved(tmp_path: Path) -> None:
    """The remembered directory is gone (the runtime moved the container): it is looked up again."""
    make(tmp_path, f"kubepods/burstable/pod{UID}/{CID}", [3])
    locator = cgroups.CgroupLocator(tmp_path)
    assert locator.pids(UID, CID) == [3]
    (tmp_path / f"kubepods/burstable/pod{UID}/{CID}/cgroup.procs").unlink()
    (tmp_path / f"kubepods/burstable/pod{UID}/{CID}").rmdir()
    make(tmp_path, f"kubepods/besteffort/pod{UID}/{CID}", [4, 8])
    assert locator.pids(UID, CID) == [4, 8]
    (tmp_path / f"kubepods/besteffort/pod{UID}/{CID}/cgroup.procs").unlink()
    (tmp_path / f"kubepods/besteffort/pod{UID}/{CID}").rmdir()
    assert locator.pids(UID, CID) == []
