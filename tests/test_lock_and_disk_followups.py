"""The node lock is taken whatever sits at its path; quarantined checkpoint files never overwrite each
other; a nearly full checkpoint disk still takes allocations durably."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumanager import names
from gpumanager.allocation import checkpoint, journal
from gpumanager.allocation.allocator import AllocationError
from gpumanager.allocation.journal import CheckpointStore, read_document
from gpumanager.cli import LOCK_FILE, hold_node_lock
from gpumanager.signals import SignalPipe
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod


@pytest.fixture
def signal_pipe() -> Iterator[SignalPipe]:
    pipe = SignalPipe()  # not installed: signals are written into it by hand
    yield pipe
    pipe.close()


def _second_agent_waits(directory: Path, caplog: pytest.LogCaptureFixture) -> bool:
    """Whether a second agent on ``directory`` waits for the lock (a SIGTERM already queued ends its wait)."""
    pipe = SignalPipe()
    try:
        os.write(pipe._write, bytes([signal.SIGTERM]))
        with caplog.at_level(logging.WARNING, logger="gpumanager.cli"):
            fd, stopped = hold_node_lock(directory, pipe)
        if fd is not None:
            os.close(fd)
        return fd is None and stopped == signal.SIGTERM and "holds the node" in caplog.text
    finally:
        pipe.close()


def _plant(kind: str, path: Path, victim: Path) -> contextlib.AbstractContextManager[object]:
    if kind == "symlink":
        path.symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        return contextlib.closing(sock)
    return contextlib.nullcontext()


@pytest.mark.parametrize("kind", ["symlink", "fifo", "socket"])
def test_an_unusable_lock_file_still_locks_the_node(
    tmp_path: Path, signal_pipe: SignalPipe, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """A symbolic link, a FIFO or a socket at gpu-manager.lock: the agent neither follows nor blocks on it,
    says so, and still holds the node: a second agent waits."""
    victim = tmp_path / "victim"
    victim.write_text("important data\n")
    node = tmp_path / "ck"
    node.mkdir()
    with _plant(kind, node / LOCK_FILE, victim):
        with caplog.at_level(logging.WARNING, logger="gpumanager.cli"):
            fd, stopped = hold_node_lock(node, signal_pipe)
        assert fd is not None and stopped is None
        try:
            assert str(node / LOCK_FILE) in caplog.text
            assert victim.read_text() == "important data\n"
            caplog.clear()
            assert _second_agent_waits(node, caplog), caplog.text
        finally:
            os.close(fd)


@contextlib.contextmanager
def _read_only(directory: Path) -> Iterator[Path]:
    """``directory`` as a read-only tmpfs (needs root for mount(2); skipped without)."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(directory)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def test_a_read_only_checkpoint_disk_without_a_lock_file_still_locks_the_node(
    tmp_path: Path, signal_pipe: SignalPipe, caplog: pytest.LogCaptureFixture
) -> None:
    with _read_only(tmp_path / "ck") as node:
        fd, stopped = hold_node_lock(node, signal_pipe)
        assert fd is not None and stopped is None
        try:
            assert not (node / LOCK_FILE).exists()
            assert _second_agent_waits(node, caplog), caplog.text
        finally:
            os.close(fd)


def test_a_lock_that_cannot_be_taken_at_all_is_refused_naming_the_path(tmp_path: Path, signal_pipe: SignalPipe) -> None:
    """Nothing at --checkpoint-path can be opened to lock (a FIFO there): an error naming it, never a start
    without the lock."""
    node = tmp_path / "ck"
    os.mkfifo(node)
    with pytest.raises(RuntimeError, match=str(node)) as info:
        hold_node_lock(node, signal_pipe)
    assert "\n" not in str(info.value)


def test_the_agent_exits_2_when_it_cannot_lock_the_node(tmp_path: Path) -> None:
    from gpumanager import cli

    node = tmp_path / "ck"
    os.mkfifo(node)
    done = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "gpu-manager"), f"--checkpoint-path={node}", "--logtostderr"],
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == cli.EXIT_CONFIG, done.stderr.decode()[-2000:]
    lines = [line for line in done.stderr.decode().splitlines() if "single-instance lock" in line]
    assert len(lines) == 1 and str(node) in lines[0], done.stderr.decode()[-2000:]


# -- checkpoint files moved aside never overwrite each other ------------------------------------------


@pytest.fixture
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every quarantine in one second (or after the clock stepped back to it)."""
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)


def test_two_unusable_snapshots_in_one_second_are_both_kept(tmp_path: Path, frozen_clock: None) -> None:
    path = tmp_path / "cp"
    path.write_text("first bad snapshot")
    first = checkpoint.quarantine(path)
    path.write_text("second bad snapshot")
    second = checkpoint.quarantine(path)
    assert first is not None and second is not None and first != second
    assert first.read_text() == "first bad snapshot" and second.read_text() == "second bad snapshot"
    assert not path.exists()
    kept = sorted(p.read_text() for p in tmp_path.glob("cp.corrupt-*"))
    assert kept == ["first bad snapshot", "second bad snapshot"]


def test_two_damaged_segments_set_aside_in_one_second_are_both_kept(tmp_path: Path, frozen_clock: None) -> None:
    path = tmp_path / "cp"
    segment = tmp_path / "cp.journal-1"
    contents = []
    for n in range(3):
        data = b"zzzzzzzz 00000000 {damaged record %d}\n" % n
        contents.append(data)
        segment.unlink(missing_ok=True)  # a new segment of that number is a new file (the copy aside keeps the old)
        segment.write_bytes(data)
        loaded = CheckpointStore(path).load()
        assert loaded.problems and segment.exists()  # kept until the start's snapshot replaces it
    kept = sorted(p.read_bytes() for p in tmp_path.glob("cp.journal-1.corrupt-*"))
    assert kept == sorted(contents)


# -- a checkpoint disk with less room than one journal segment -----------------------------------------


@contextlib.contextmanager
def _small_disk(directory: Path, size: str) -> Iterator[Path]:
    """``directory`` as a tmpfs of ``size`` (needs root for mount(2); skipped without)."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def _leave_free(directory: Path, free: int) -> None:
    """Fill the file system of ``directory`` until about ``free`` bytes are left."""
    st = os.statvfs(directory)
    take = st.f_bavail * st.f_frsize - free
    with open(directory / "filler", "wb") as f:
        f.write(b"\1" * take)


def _allocate_many(tmp_path: Path, count: int) -> list[str]:
    """Start an allocator on the checkpoint in ``tmp_path`` and allocate ``count`` containers; their keys."""
    pods = FakePods([make_pod(f"p{i}", [("c", 1, 1)]) for i in range(count)])
    alloc = make_allocator(tmp_path, pods)
    try:
        assert alloc.probe_checkpoint() == ""
        for i in range(count):
            alloc.allocate(core_ids(i % 4, 1, start=i // 4))
        return sorted(str(a.key) for a in alloc.allocations())
    finally:
        alloc.close()


def _recorded(tmp_path: Path) -> int:
    document = read_document(tmp_path / "checkpoint" / names.OWN_CHECKPOINT)
    assert document is not None
    return sum(len(per) for per in document["PodGPUMapping"].values())


def test_a_checkpoint_disk_with_less_room_than_a_journal_segment_still_takes_allocations(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real small file system with ~300 KiB free (no room for a 1 MiB segment, room for a snapshot):
    allocations are taken and are on disk; why is said once."""
    with _small_disk(tmp_path / "checkpoint", "3m") as disk:
        _leave_free(disk, 300 << 10)
        with caplog.at_level(logging.WARNING, logger="gpumanager.allocation"):
            keys = _allocate_many(tmp_path, 120)
        assert len(keys) == 120
        assert _recorded(tmp_path) == 120
        said = [r.getMessage() for r in caplog.records if "journal segment" in r.getMessage()]
        assert 1 <= len(said) <= 2, said


@pytest.mark.parametrize("room", [200 << 10, 8 << 10])
def test_segments_shrink_and_then_snapshots_take_over_as_the_disk_fills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, room: int
) -> None:
    """A disk that has ``room`` bytes for journal segments (fault injection): a smaller segment, or none and
    each change written as the whole snapshot before it is answered."""
    made: list[int] = []
    real_fill = journal._fill_zeros

    def fill(fd: int, size: int) -> None:
        if size > room:
            raise OSError(errno.ENOSPC, "No space left on device")
        made.append(size)
        real_fill(fd, size)

    monkeypatch.setattr(journal, "_fill_zeros", fill)
    monkeypatch.setattr(journal, "_free_bytes", lambda directory: room)
    with caplog.at_level(logging.WARNING, logger="gpumanager.allocation"):
        keys = _allocate_many(tmp_path, 40)
    assert len(keys) == 40 and _recorded(tmp_path) == 40
    assert all(size < journal.SEGMENT_BYTES for size in made)
    said = [r.getMessage() for r in caplog.records if "journal segment" in r.getMessage()]
    assert 1 <= len(said) <= 2, said


def test_nothing_is_answered_when_not_even_the_snapshot_can_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No segment of any size and no snapshot can be written: the allocation is refused, naming why."""

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    pods = FakePods([make_pod("a", [("c", 1, 1)])])
    alloc = make_allocator(tmp_path, pods)
    try:
        assert alloc.probe_checkpoint() == ""
        monkeypatch.setattr(journal, "_fill_zeros", full)
        monkeypatch.setattr(journal, "_free_bytes", lambda directory: 0)
        monkeypatch.setattr(checkpoint, "write_json", full)
        segment = alloc._store._segment
        assert segment is not None
        segment.offset = journal.SEGMENT_BYTES  # the active segment is full: a new one is needed
        with pytest.raises(AllocationError, match="No space left"):
            alloc.allocate(core_ids(0, 1))
        assert alloc.allocations() == []
    finally:
        alloc.close()
