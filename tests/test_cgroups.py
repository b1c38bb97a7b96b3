"""Finding a container's host PIDs in cgroup v1/v2 trees, cgroupfs and systemd naming, every runtime."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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


def count_walks(monkeypatch: pytest.MonkeyPatch, root: Path) -> list[str]:
    """Every walk of the whole tree at ``root`` from now on (a search's): each lists ``root`` once."""
    walks: list[str] = []
    real_scandir = os.scandir

    def counted(path: Any = ".") -> Any:
        if Path(path) == root:
            walks.append(str(path))
        return real_scandir(path)

    monkeypatch.setattr(cgroups.os, "scandir", counted)
    return walks


def test_a_missing_cgroup_is_searched_for_in_the_whole_tree_at_most_every_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A terminating pod's containers are asked for each second until their allocation ends: a node with
    hundreds of pods must not walk its whole cgroup tree for each of them each time."""
    for i in range(3):
        make(tmp_path, f"kubepods/pod{i:08d}-0000-0000-0000-000000000000/c{i}", [100 + i])
    walks = count_walks(monkeypatch, tmp_path)
    now = [1000.0]
    locator = cgroups.CgroupLocator(tmp_path, search_backoff=30.0, clock=lambda: now[0])
    for _ in range(5):
        assert locator.pids(UID, CID, "Guaranteed") == []
    assert len(walks) == 1
    now[0] += 30.0
    assert locator.pids(UID, CID, "Guaranteed") == []
    assert len(walks) == 2
    # A registration (its container certainly runs) searches at once, in a walk of its own.
    assert locator.pids(UID, CID, "Guaranteed", search=True) == []
    assert locator.find(UID, CID, "Guaranteed", search=True) is None
    assert len(walks) == 4
    # Made under a standard name meanwhile: found at once, without a search.
    make(tmp_path, f"kubepods/pod{UID}/{CID}", [5])
    assert locator.pids(UID, CID, "Guaranteed") == [5]
    assert len(walks) == 4


def test_containers_missed_together_share_one_walk_of_the_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fifty pods that end together: each of their containers is asked for in the same sweep, their
    cgroups gone. One walk of the tree answers them all, and still finds the one among them whose cgroup
    has a name of its own; a container missed once that walk is older than TREE_WALK_SECONDS walks again."""
    running = [(f"{i:08d}-1111-2222-3333-444444444444", f"run{i}") for i in range(20)]
    for uid, cid in running:
        make(tmp_path, f"kubepods/pod{uid}/{cid}", [7])
    ended = [(f"{i:08d}-5555-6666-7777-888888888888", f"{i:064x}") for i in range(50)]
    odd_uid, odd_cid = ended[17]
    make(
        tmp_path,
        f"system.slice/containerd.service/kubepods-pod{odd_uid.replace('-', '_')}.slice:cri-containerd:{odd_cid}",
        [321],
    )
    walks = count_walks(monkeypatch, tmp_path)
    now = [50.0]
    locator = cgroups.CgroupLocator(tmp_path, clock=lambda: now[0])
    for uid, cid in running:
        assert locator.pids(uid, cid, "Guaranteed") == [7]
    assert walks == []  # found by their standard names
    got = {cid: locator.pids(uid, cid, "Guaranteed") for uid, cid in ended}
    assert got == {cid: ([321] if cid == odd_cid else []) for _, cid in ended}
    assert len(walks) == 1
    # A directory the walk saw is gone since: not found in the walk (a container that restarted meanwhile).
    gone_uid, gone_cid = ended[3]
    make(tmp_path, f"odd/pod-{gone_uid}/{gone_cid}", [5])
    assert locator.pids(gone_uid, gone_cid, "Guaranteed", search=True) == [5]
    assert len(walks) == 2
    (tmp_path / f"odd/pod-{gone_uid}/{gone_cid}/cgroup.procs").unlink()
    (tmp_path / f"odd/pod-{gone_uid}/{gone_cid}").rmdir()
    assert locator.find(gone_uid, gone_cid, "Guaranteed") is None  # searched in that walk
    assert not locator.located(gone_uid, gone_cid)
    assert len(walks) == 2
    now[0] += cgroups.TREE_WALK_SECONDS
    assert locator.pids(UID, CID, "Guaranteed") == []  # missed for the first time, the walk too old
    assert len(walks) == 3


@pytest.mark.parametrize(
    "name",
    [
        CID,
        f"cri-containerd-{CID}.scope",
        f"crio-{CID}",
        f"docker-{CID}.scope",
        f"kubepods-pod{U_}.slice:cri-containerd:{CID}",
        f"kubepods-pod{U_}.slice:crio:x:containerd:{CID}",
    ],
)
def test_a_walk_finds_what_a_search_finds(tmp_path: Path, name: str) -> None:
    """The walk shared by a sweep's misses finds the directory a search of the tree for that one container
    finds, whichever name a runtime gave it, and not a piece of a name or a monitor's."""
    make(tmp_path, f"odd/pod-{UID}/{name}", [1])
    make(tmp_path, f"odd/pod-{UID}/crio-conmon-{CID}", [2])
    make(tmp_path, f"odd/pod-{UID}/x{CID}", [3])
    index = cgroups._index_tree(tmp_path)
    for asked in (CID, CID[:-1], "conmon-" + CID, "x" + CID, "pod", "slice"):
        assert cgroups._search_index(index, UID, asked) == cgroups._search(tmp_path, UID, asked), asked
    assert cgroups._search_index(index, UID, CID) == tmp_path / f"odd/pod-{UID}/{name}"


def test_an_unusual_layout_is_found_by_the_search_after_the_backoff(tmp_path: Path) -> None:
    now = [0.0]
    locator = cgroups.CgroupLocator(tmp_path, search_backoff=30.0, clock=lambda: now[0])
    assert locator.pids(UID, CID) == []
    make(tmp_path, f"system.slice/containerd.service/kubepods-pod{U_}.slice:cri-containerd:{CID}", [9])
    assert locator.pids(UID, CID) == []  # within the backoff: the standard names only
    now[0] += 30.0
    assert locator.pids(UID, CID) == [9]
    locator.forget_pod(UID)  # forgetting a pod forgets its misses too
    assert locator.pids(UID, CID) == [9]


@pytest.mark.parametrize("asked", ["pod", "kubepods", "9c2a", "4f9c2", "slice"])
def test_a_piece_of_a_name_is_no_container(tmp_path: Path, asked: str) -> None:
    """The search takes a directory for the container's only when it is the ID whole (after the
    runtime's prefix): ``pod`` found the pod's own cgroup, a piece of an ID another container's."""
    make(tmp_path, f"kubepods/pod{UID}/{CID}", [10])
    make(tmp_path, f"kubepods.slice/kubepods-pod{U_}.slice/cri-containerd-{CID}.scope", [11])
    assert cgroups.find_container_cgroup(tmp_path, UID, asked) is None
    assert cgroups.find_container_cgroup(tmp_path, UID, CID) is not None


@pytest.mark.parametrize(
    "rel", [f"kubepods/burstable/pod{UID}/crio-{CID}", f"kubepods/burstable/pod{UID}/crio-{CID}.scope"]
)
def test_crio_with_cgroupfs_is_found_by_name_and_its_conmon_is_not_the_container(tmp_path: Path, rel: str) -> None:
    """CRI-O under the cgroupfs driver: ``pod<uid>/crio-<id>``, beside ``crio-conmon-<id>`` (its
    monitor's cgroup, which is no part of the container)."""
    make(tmp_path, f"kubepods/burstable/pod{UID}/crio-conmon-{CID}", [777])
    make(tmp_path, rel, [4242, 4243])
    assert cgroups.find_container_cgroup(tmp_path, UID, CID, "Burstable", search=False) == tmp_path / rel
    assert cgroups.container_pids(tmp_path, UID, CID, "Burstable") == [4242, 4243]


@pytest.mark.parametrize("name", [f"crio-conmon-{CID}", f"crio-conmon-{CID}.scope", f"foo-{CID}", f"x_{CID}"])
def test_only_a_runtimes_own_prefix_names_the_container(tmp_path: Path, name: str) -> None:
    make(tmp_path, f"somewhere/pod{UID}/{name}", [777])
    assert cgroups.find_container_cgroup(tmp_path, UID, CID) is None


def test_a_cgroup_procs_larger_than_one_read_is_read_whole(tmp_path: Path) -> None:
    """A container of thousands of processes: its cgroup.procs is longer than one read gives."""
    pids = list(range(100000, 130000))
    make(tmp_path, f"kubepods/pod{UID}/{CID}", pids)
    assert (tmp_path / f"kubepods/pod{UID}/{CID}/cgroup.procs").stat().st_size > 3 * cgroups._READ_BYTES
    assert cgroups.CgroupLocator(tmp_path).pids(UID, CID) == pids


def test_a_cgroup_made_after_a_shared_walk_is_not_missed_for_the_backoff(tmp_path: Path) -> None:
    """A walk made for another container (a pod that ended) does not show a cgroup made after it: a container
    first asked for then is searched for again at its next ask, not only 30 s later (a node whose cgroups
    have names of their own, which only the search finds)."""
    now = [100.0]
    locator = cgroups.CgroupLocator(tmp_path, search_backoff=30.0, clock=lambda: now[0])
    assert locator.pids("ended-pod", "ended") == []  # walks the tree
    uid = "bbbb-cccc"
    make(tmp_path, f"kubelet.slice/kubelet-kubepods.slice/pod-{uid}.slice/cri-containerd-bbb.scope", [4242])
    now[0] += 0.3
    assert locator.pids(uid, "bbb") == []  # the walk shared, made before the cgroup
    now[0] += 1.0
    assert locator.pids(uid, "bbb") == [4242]
    # A walk made since the first miss is believed: no search again within the backoff.
    now[0] += 1.0
    assert locator.pids("ended-pod", "ended") == []
    assert locator.pids(uid, "gone") == []
    make(tmp_path, f"kubelet.slice/kubelet-kubepods.slice/pod-{uid}.slice/cri-containerd-gone.scope", [7])
    now[0] += 1.0
    assert locator.pids(uid, "gone") == []
    now[0] += 30.0
    assert locator.pids(uid, "gone") == [7]


def test_a_directory_that_cannot_be_listed_is_not_taken_by_a_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a search of the tree for one container leaves out a directory it cannot list, so does the walk."""
    make(tmp_path, f"odd/pod-{UID}/crio-{CID}", [1])
    real_scandir = os.scandir

    def refusing(path: Any = ".") -> Any:
        if str(path).endswith(f"crio-{CID}"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(cgroups.os, "scandir", refusing)
    assert cgroups._search(tmp_path, UID, CID) is None
    assert cgroups._search_index(cgroups._index_tree(tmp_path), UID, CID) is None
