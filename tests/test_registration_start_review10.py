"""The start's background work waits for the kubelet's first full ListAndWatch of both resources.

Loading the allocation state and the Kubernetes client is seconds of interpreter work; begun as soon
as Register returned, it competed with the kubelet's dial-back, GetDevicePluginOptions and the first
ListAndWatch answers for the interpreter, and the kubelet got its device lists tens of milliseconds
late. These tests hold the kubelet's ListAndWatch back and look at when the background start begins.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from gpumanager import names
from simnode.agent_process import SPEC_DIR, AgentProcess
from simnode.kubelet import KubeletSimulator, _Endpoint

RESOURCES = (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE)
BACKGROUND_BEGINS = "at start-allocation"


def _held_kubelet(tmp_path: Path, gate: threading.Event) -> KubeletSimulator:
    """A kubelet that registers at once but opens ListAndWatch only once ``gate`` is set."""
    kubelet = KubeletSimulator(tmp_path / "device-plugins", fill="sorted")
    run = kubelet._run_list_and_watch

    def held(ep: _Endpoint) -> None:
        gate.wait(30)
        run(ep)

    kubelet._run_list_and_watch = held  # type: ignore[method-assign]
    kubelet.start()
    return kubelet


def _agent(tmp_path: Path) -> AgentProcess:
    return AgentProcess(tmp_path, SPEC_DIR / "t4-x1.json", env={"GPU_MANAGER_STALL_AT": "start-allocation:0"}).start()


def test_the_background_start_begins_after_both_first_lists_were_sent(tmp_path: Path) -> None:
    gate = threading.Event()
    kubelet = _held_kubelet(tmp_path, gate)
    agent = _agent(tmp_path)
    try:
        for resource in RESOURCES:
            kubelet.wait_for_registration(resource, timeout=60)
        time.sleep(0.5)  # Register has returned to the agent; the kubelet has not asked for the lists
        assert BACKGROUND_BEGINS not in agent.log_text(), agent.log_text()[-3000:]
        gate.set()
        for resource in RESOURCES:
            kubelet.wait_for_registration(resource, timeout=30, with_devices=True)
        agent.wait_for_log(BACKGROUND_BEGINS, timeout=30)
    finally:
        gate.set()
        agent.stop()
        kubelet.stop()


def test_a_kubelet_that_never_asks_for_the_lists_does_not_hold_the_start_up(tmp_path: Path) -> None:
    gate = threading.Event()
    kubelet = _held_kubelet(tmp_path, gate)
    agent = _agent(tmp_path)
    try:
        for resource in RESOURCES:
            kubelet.wait_for_registration(resource, timeout=60)
        agent.wait_for_log(BACKGROUND_BEGINS, timeout=30)
        agent.wait_for_log("devices in ", timeout=30)  # the start completes
    finally:
        gate.set()
        agent.stop()
        kubelet.stop()
