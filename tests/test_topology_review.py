"""Placement depends on the allocation state only, and odd topologies are placed sensibly."""

from __future__ import annotations

from pathlib import Path

from tests.alloc_fixtures import MIB, FakePods, core_ids, make_allocator, make_pod, uid_of


def test_showing_the_graph_does_not_change_where_a_share_goes(tmp_path: Path) -> None:
    # /graph records each GPU's processes to print them; a process seen on GPU 0 by an earlier /graph
    # (perhaps of a pod long gone) must not steer later placements away from GPU 0.
    def place(show_graph: bool) -> tuple[int, ...]:
        pods = FakePods([make_pod("share", [("c0", 50, 4)])])
        alloc = make_allocator(tmp_path / str(show_graph), pods)
        if show_graph:
            text = alloc.graph({0: ([4242], 512 * MIB)})
            assert "4242" in text
        alloc.allocate(core_ids(0, 50))
        placed = alloc.get(uid_of("share"), "c0")
        assert placed is not None
        return placed.minors

    assert place(show_graph=True) == place(show_graph=False) == (0,)


def test_showing_the_graph_does_not_change_where_whole_gpus_go(tmp_path: Path) -> None:
    def place(show_graph: bool) -> tuple[int, ...]:
        pods = FakePods([make_pod("whole", [("c0", 200, 0)])])
        alloc = make_allocator(tmp_path / str(show_graph), pods)
        if show_graph:
            alloc.graph({0: ([1], 0), 1: ([2, 3], 0)})
        alloc.allocate(core_ids(0, 100) + core_ids(1, 100))
        placed = alloc.get(uid_of("whole"), "c0")
        assert placed is not None
        return placed.minors

    assert place(show_graph=True) == place(show_graph=False) == (0, 1)
