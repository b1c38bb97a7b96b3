"""The agent's lock on its device-plugin directory follows that directory when it is removed and made again
(a kubelet reinstalled, an operator's rm -rf): a second agent started then waits for the first one, as it
does at any other time, instead of taking the new directory and replacing the first one's sockets. When
another agent locked the new directory first, the first one says so in one line naming the directory and
the holder, and does not serve there until that lock is let go."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

from gpumanager import cli, names
from simnode.agent_process import AgentProcess, vm_path_for
from simnode.gpusim_state import spec_dir

SOCKETS = (names.VCORE_SOCKET, names.VMEMORY_SOCKET)


def _inodes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in directory.iterdir() if p.name.endswith(".sock")}


def _until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.05)


def _remove(directory: Path) -> None:
    """rm -rf, in one step as the agent sees it (it serves again in a directory being emptied)."""
    gone = directory.with_name(directory.name + ".removed")
    os.rename(directory, gone)
    shutil.rmtree(gone)


def _second(tmp_path: Path, spec: Path) -> AgentProcess:
    """Another agent with its own checkpoint and pod directories: only the kubelet's directory is shared."""
    second = AgentProcess(
        tmp_path,
        spec,
        extra_args=[
            f"--checkpoint-path={tmp_path / 'other-checkpoint'}",
            f"--display-socket={tmp_path / 'o.sock'}",
            f"--virtual-manager-path={vm_path_for(tmp_path / 'other')}",
        ],
    )
    second.log_path = tmp_path / "second.log"
    return second.start()


def _served(directory: Path) -> bool:
    try:
        return set(SOCKETS) <= set(_inodes(directory))
    except OSError:
        return False


def test_a_second_agent_started_after_the_directory_was_made_again_waits_for_the_first(tmp_path: Path) -> None:
    spec = spec_dir() / "t4-x1.json"
    first = AgentProcess(tmp_path, spec, extra_args=["--kubelet-watch-period=100ms"]).start()
    second: AgentProcess | None = None
    try:
        first.wait_for_log("serving 1 GPUs", timeout=60)
        _remove(first.plugin_dir)
        first.plugin_dir.mkdir(mode=0o750, exist_ok=True)  # the agent may have made it first
        _until(lambda: _served(first.plugin_dir), 30, "the first agent serves in the directory made again")
        before = _inodes(first.plugin_dir)
        second = _second(tmp_path, spec)
        # Without the lock it goes on to serve: it replaces the sockets, or exits when they answer.
        _until(
            lambda: any(t in second.log_text() for t in ("holds the node", "serving 1 GPUs", "cannot start")),
            60,
            "the second agent waits, serves or gives up",
        )
        text = second.log_text()
        assert "holds the node" in text and f"--device-plugin-path={first.plugin_dir}" in text, text[-3000:]
        time.sleep(0.5)
        assert _inodes(first.plugin_dir) == before
        second.signal(signal.SIGTERM)
        assert second.wait(30) == cli.EXIT_OK, second.log_text()[-3000:]
        assert "serving 1 GPUs" not in second.log_text()
        assert _inodes(first.plugin_dir) == before
    finally:
        if second is not None:
            second.stop()
        first.stop()


def test_a_directory_made_again_and_locked_by_another_agent_first_is_left_to_it(tmp_path: Path) -> None:
    """Another agent (here: this process) locked the new directory before the first agent looked: one line
    names the directory and the holder, the first agent serves nothing there while the lock is held, and
    serves there again once it is let go."""
    spec = spec_dir() / "t4-x1.json"
    first = AgentProcess(tmp_path, spec, extra_args=["--kubelet-watch-period=100ms"]).start()
    made = tmp_path / "made-again"
    held: int | None = None
    try:
        first.wait_for_log("serving 1 GPUs", timeout=60)
        made.mkdir(mode=0o750)
        held = os.open(made, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        first.signal(signal.SIGSTOP)  # the other agent is quicker this time
        try:
            _remove(first.plugin_dir)
            os.rename(made, first.plugin_dir)
        finally:
            first.signal(signal.SIGCONT)
        _until(
            lambda: "holds the lock" in first.log_text() or _served(first.plugin_dir),
            30,
            "the first agent says who holds the directory, or serves there",
        )
        time.sleep(1.0)  # ten passes of its watch loop
        assert not _served(first.plugin_dir), sorted(os.listdir(first.plugin_dir))
        lines = [line for line in first.log_text().splitlines() if "holds the lock" in line]
        assert len(lines) == 1, lines
        assert str(first.plugin_dir) in lines[0] and f"pid {os.getpid()}" in lines[0], lines[0]
        assert "Traceback" not in first.log_text()
        os.close(held)
        held = None
        _until(lambda: _served(first.plugin_dir), 30, "the first agent serves there once the lock is let go")
        second = _second(tmp_path, spec)
        try:
            second.wait_for_log("holds the node", timeout=60)  # the first agent holds the directory now
        finally:
            second.stop()
    finally:
        if held is not None:
            os.close(held)
        first.stop()


def test_the_holder_is_read_from_proc_locks(tmp_path: Path) -> None:
    """The holder's pid as /proc/locks gives it; a waiter's line ("->") and a holder this PID namespace does
    not see (pid 0) name no one."""
    from gpumanager.deviceplugin.dirlock import lock_holders

    st = os.stat(tmp_path)
    file = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    locks = tmp_path / "locks"
    locks.write_text(
        f"1: POSIX  ADVISORY  WRITE 11 {file} 0 EOF\n"
        f"2: FLOCK  ADVISORY  WRITE 4321 {file} 0 EOF\n"
        f"2: -> FLOCK  ADVISORY  WRITE 99 {file} 0 EOF\n"
        f"3: FLOCK  ADVISORY  WRITE 0 {file} 0 EOF\n"
        f"4: FLOCK  ADVISORY  WRITE 77 {file}1 0 EOF\n"
    )
    assert lock_holders(st, locks) == [4321]
    assert lock_holders(st, tmp_path / "missing") == []
    held = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert os.getpid() in lock_holders(st)  # the kernel's own list
    finally:
        os.close(held)
