"""The node lock is taken whatever sits at its path; quarantined checkpoint files never overwrite each
other; a nearly full checkpoint disk still takes allocations durably."""

from __future__ import annotations

import contextlib
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

from gpumanager.allocation import checkpoint
from gpumanager.allocation.journal import CheckpointStore
from gpumanager.cli import LOCK_FILE, hold_node_lock
from gpumanager.signals import SignalPipe


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
        segment.write_bytes(data)
        loaded = CheckpointStore(path).load()
        assert loaded.problems and not segment.exists()
    kept = sorted(p.read_bytes() for p in tmp_path.glob("cp.journal-1.corrupt-*"))
    assert kept == sorted(contents)
