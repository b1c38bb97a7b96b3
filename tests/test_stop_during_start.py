"""SIGTERM while the agent is still starting: it leaves at once, whatever start-up is waiting on."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from simnode.dra_cluster import NODE, DRACluster


@pytest.mark.parametrize("mode", ["hang", "refuse", "503"])
def test_sigterm_while_dra_start_waits_on_the_api_server(tmp_path: Path, mode: str) -> None:
    with DRACluster(tmp_path / "c", "t4-x1") as c:
        assert c.agent is not None
        c.agent.stop()
        # The next agent appends to the same log: without the first one's lines, "starting on node" is
        # this start's (its signal handlers are set by then).
        c.agent.log_path.unlink()
        c.api.set_down(True, mode)
        try:
            agent = c.start_agent(wait=False)
            agent.wait_for_log("starting on node", timeout=30)
            time.sleep(1.0)  # well into start-up, the API server not answering
            agent.signal(signal.SIGTERM)
            sent = time.monotonic()
            code = agent.wait(timeout=20)
            took = time.monotonic() - sent
        finally:
            c.api.set_down(False)
        # The kubelet waits 30 s before it kills; a rolling update should not wait at all.
        assert took < 5, f"the agent took {took:.1f} s to leave after SIGTERM:\n{agent.log_text()[-3000:]}"
        assert code == 0
        assert list(c.registry_dir.glob("*.sock")) == []


def test_sigterm_while_dra_mode_is_being_started_serves_nothing_after_and_exits(tmp_path: Path) -> None:
    """A stop that lands between the check "not stopping" and the start of the DRA sockets, and takes
    a while (as stopping the health monitor may): the sockets must not come up during or after the
    stop, and nothing (a gRPC handler the kubelet holds open) may keep the process from exiting."""
    with DRACluster(tmp_path / "c", "t4-x1") as c:
        assert c.agent is not None
        c.agent.stop()
        agent = c.start_agent(wait=False, env={"GPU_MANAGER_STALL_AT": "start-dra:0.5,stop:1"})
        agent.wait_for_log("stalling 0.5 s at start-dra", timeout=60)
        agent.signal(signal.SIGTERM)
        sent = time.monotonic()
        code = agent.wait(timeout=20)
        took = time.monotonic() - sent
        log_text = agent.log_text()
        after_stop = log_text[log_text.index("received SIGTERM") :]
        assert took < 5, f"the agent took {took:.1f} s to leave after SIGTERM:\n{log_text[-3000:]}"
        assert code == 0
        assert "serving DRA" not in after_stop, after_stop
        assert "still running" not in after_stop, after_stop
        assert list(c.registry_dir.glob("*.sock")) == []
        assert not any(p.name == "dra.sock" for p in c.sockets_dir.rglob("*.sock"))


def test_a_thread_left_running_after_the_stop_does_not_keep_the_process(tmp_path: Path) -> None:
    """The last guard of "SIGTERM stops it": a non-daemon thread that never ends (as a gRPC handler
    blocked in a stream would be) holds the interpreter's exit; the watchdog ends the process and
    names the thread."""
    script = (
        "import logging, sys, threading, time\n"
        "logging.basicConfig(stream=sys.stderr, level=logging.INFO)\n"
        "from gpumanager.cli import exit_watchdog\n"
        "threading.Thread(target=time.sleep, args=(60,), name='stuck-handler').start()\n"
        "exit_watchdog(0.5)\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert took < 10, took
    assert "threads still running 0.5 s after the stop: stuck-handler; exiting now" in done.stderr


def test_dra_mode_publishes_its_slice_before_loading_the_allocation_state(tmp_path: Path) -> None:
    """The ResourceSlice needs only the GPUs and their health; the scheduler waits on it, so it does not
    wait for the allocation state, the endpoints or the pod cache (here the allocation step stalls)."""
    with DRACluster(tmp_path / "c", "t4-x1") as c:
        assert c.agent is not None
        c.agent.stop()
        c.resource.delete_collection_resource_slice(field_selector=f"spec.nodeName={NODE}")
        assert c.slice() is None
        agent = c.start_agent(wait=False, env={"GPU_MANAGER_STALL_AT": "start-allocation:15"})
        c.wait_slice(lambda s: s is not None, timeout=12)
        # The slice is seen as soon as it is written, maybe before the agent has gone on to the stall.
        text = agent.wait_for_log("stalling 15 s at start-allocation", timeout=10)
        this_start = text[text.rindex("starting on node") :]
        assert "topology ROOT" not in this_start, "the slice waited for the allocation state"


def test_sigterm_while_nvml_starts_exits_at_once_and_registers_nothing(tmp_path: Path) -> None:
    """NVML's start hangs (a GPU falling off the bus): a SIGTERM meanwhile ends the agent at once, and the
    start that resumes afterwards serves and registers nothing."""
    from simnode.agent_process import AgentProcess
    from simnode.kubelet import KubeletSimulator
    from tests.agent_fixtures import spec_path

    kubelet = KubeletSimulator(tmp_path / "device-plugins", dial_timeout=10.0)
    kubelet.start()
    try:
        agent = AgentProcess(tmp_path, spec_path("t4-x1"), env={"GPU_MANAGER_STALL_AT": "start-nvml:3"}).start()
        agent.wait_for_log("start-nvml", timeout=30)
        agent.signal(signal.SIGTERM)
        sent = time.monotonic()
        code = agent.wait(timeout=20)
        took = time.monotonic() - sent
        assert took < 2.5, f"the agent took {took:.1f} s to leave after SIGTERM:\n{agent.log_text()[-3000:]}"
        assert code == 0
        time.sleep(3.5)  # past the stall: nothing may come of the start
        assert kubelet.registration_count() == 0
        assert sorted(p.name for p in (tmp_path / "device-plugins").glob("v*.sock")) == []
    finally:
        kubelet.stop()
