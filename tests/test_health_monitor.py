"""The GPU health monitor on the simulated node, in subprocesses: XID events, lost GPUs, NVML failures."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.gpusim_fixtures import SimNode, gpusim_lib, sim_node

__all__ = ["gpusim_lib", "sim_node"]  # fixtures

MakeNode = Callable[[str | Path], SimNode]

PRELUDE = r"""
import io, json, logging, os, sys, time
from pathlib import Path
import pynvml
from gpumanager.device import discovery, nvml
from gpumanager.device.health import HealthMonitor
from simnode.gpusim_state import GpuSimState

buf = io.StringIO()
logging.basicConfig(level=logging.INFO, handlers=[logging.StreamHandler(buf)])
st = GpuSimState(os.environ["GPUSIM_STATE"])

def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True

# Whether the monitor's event set holds these GPUs: an XID queued before is not seen (as with NVML), and
# the set is made by the monitor's thread, whose start a loaded machine delays.
def watched(mon, *indexes):
    return mon._event_set is not None and set(indexes) <= mon._registered

def watching(mon, *indexes):
    assert wait_for(lambda: watched(mon, *indexes), timeout=30.0), f"GPUs {indexes} never registered for XIDs"
"""

LOST_AT_START = (
    PRELUDE
    + r"""
st.set_lost(0, True)
nvml.init()
node = discovery.discover(Path(sys.argv[1]))
mon = HealthMonitor(node.gpus, ignored_xids=(13,), quiet_period=0.5, probe_period=0.1, lost=node.lost)
mon.start()
time.sleep(0.3)
st.set_lost(0, False)
back = wait_for(lambda: mon.state(0).healthy)
watching(mon, 0)  # the event set is made on the loop's next pass
st.queue_xid(0, 79)
seen = wait_for(lambda: not mon.state(0).healthy)
mon.stop()
print(json.dumps({"lost": node.lost, "back": back, "xid_seen": seen, "reason": mon.state(0).reason}))
"""
)


def test_a_gpu_lost_at_start_is_watched_for_xids_once_it_answers(sim_node: MakeNode, tmp_path: Path) -> None:
    out = sim_node("t4-x1").python_json(LOST_AT_START, str(tmp_path))
    assert out == {"lost": [0], "back": True, "xid_seen": True, "reason": "XID 79"}


EVENT_WAIT_FAILS = (
    PRELUDE
    + r"""
import gpumanager.device.health as health
health.EVENT_SET_RETRY_FIRST = 0.2
nvml.init()
node = discovery.discover(Path(sys.argv[1]))
reports = []
mon = HealthMonitor(node.gpus, ignored_xids=(13,), quiet_period=5.0, probe_period=0.1,
                    report=lambda name, problem: reports.append([name, problem]))
orig_wait, orig_create = pynvml.nvmlEventSetWait_v2, pynvml.nvmlEventSetCreate
failing = {"on": False}
created = [0]
def wait(es, ms):
    if failing["on"]:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
    return orig_wait(es, ms)
def create():
    created[0] += 1
    return orig_create()
pynvml.nvmlEventSetWait_v2 = wait
pynvml.nvmlEventSetCreate = create
mon.start()
watching(mon, 0, 1, 2, 3)
failing["on"] = True
time.sleep(3.0)
failing["on"] = False
recovered = wait_for(lambda: reports and reports[-1][1] is None)
watching(mon, 1)
st.queue_xid(1, 79)
seen = wait_for(lambda: not mon.state(1).healthy)
mon.stop()
warnings = [l for l in buf.getvalue().splitlines() if "nvmlEventSetWait" in l]
print(json.dumps({"warnings": len(warnings), "created": created[0], "reports": reports,
                  "recovered": recovered, "xid_seen": seen}))
"""
)


def test_a_failing_event_wait_is_reported_and_the_event_set_made_again(sim_node: MakeNode, tmp_path: Path) -> None:
    out = sim_node("v100-pcie-x4").python_json(EVENT_WAIT_FAILS, str(tmp_path))
    assert out["warnings"] <= 3, out
    assert out["created"] >= 2, out
    problems = [p for name, p in out["reports"] if p]
    assert problems and all(name == "xid-events" for name, _p in out["reports"])
    assert "nvmlEventSetWait" in problems[0]
    assert out["recovered"] and out["xid_seen"], out


REGISTER_FAILS_AT_REMAKE = (
    PRELUDE
    + r"""
import gpumanager.device.health as health
health.EVENT_SET_RETRY_FIRST = 0.2
mode = sys.argv[2]
nvml.init()
node = discovery.discover(Path(sys.argv[1]))
reports = []
mon = HealthMonitor(node.gpus, ignored_xids=(13,), quiet_period=0.3, probe_period=0.1,
                    report=lambda name, problem: reports.append([name, problem]))
orig_wait, orig_register = pynvml.nvmlEventSetWait_v2, pynvml.nvmlDeviceRegisterEvents
failing = {"wait": False, "register": False}
def wait(es, ms):
    if failing["wait"]:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
    return orig_wait(es, ms)
def register(handle, types, es):
    if failing["register"] and pynvml.nvmlDeviceGetIndex(handle) == 1:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
    return orig_register(handle, types, es)
pynvml.nvmlEventSetWait_v2 = wait
pynvml.nvmlDeviceRegisterEvents = register
mon.start()
watching(mon, 0, 1, 2, 3)
failing["wait"] = True
wait_for(lambda: mon._event_set is None)
# GPU 1 cannot be registered when the set is made again: NVML fails for it, or it is lost meanwhile.
if mode == "lost":
    st.set_lost(1, True)
else:
    failing["register"] = True
failing["wait"] = False
wait_for(lambda: mon._event_set is not None)
time.sleep(0.5)
problem = mon.event_problem()
if mode == "lost":
    st.set_lost(1, False)
else:
    failing["register"] = False
cleared = wait_for(lambda: not mon.event_problem())
wait_for(lambda: mon.state(1).healthy)
watching(mon, 1)
st.queue_xid(1, 79)
seen = wait_for(lambda: not mon.state(1).healthy, timeout=3.0)
mon.stop()
warnings = [l for l in buf.getvalue().splitlines() if l.startswith("WARNING") and "GPU 1" in l and "XID events" in l]
print(json.dumps({"problem": problem, "cleared": cleared, "xid_seen": seen, "reason": mon.state(1).reason,
                  "reports": reports, "warnings": warnings}))
"""
)


@pytest.mark.parametrize("mode", ["register-fails", "lost"])
def test_a_gpu_not_registered_when_the_event_set_is_made_again_is_registered_later(
    mode: str, sim_node: MakeNode, tmp_path: Path
) -> None:
    out = sim_node("v100-pcie-x4").python_json(REGISTER_FAILS_AT_REMAKE, str(tmp_path), mode)
    assert "GPU 1" in out["problem"], out
    assert ["xid-events", out["problem"]] in out["reports"], out
    assert out["reports"][-1] == ["xid-events", None], out
    assert len(out["warnings"]) == 1, out["warnings"]
    assert out["cleared"] and out["xid_seen"] and out["reason"] == "XID 79", out


XID_STORM = (
    PRELUDE
    + r"""
nvml.init()
node = discovery.discover(Path(sys.argv[1]))
mon = HealthMonitor(node.gpus, ignored_xids=(13, 31), quiet_period=5.0, probe_period=0.1)
mon.start()
watching(mon, 0, 1)
for _ in range(200):
    st.queue_xid(0, 13)
    st.queue_xid(1, 31)
wait_for(lambda: mon.ignored_xid_events >= 400)
mon.stop()
lines = [l for l in buf.getvalue().splitlines() if ": XID " in l]
print(json.dumps({"ignored": mon.ignored_xid_events, "lines": lines, "healthy": mon.state(0).healthy}))
"""
)


def test_ignored_xids_are_logged_once_per_gpu_and_xid(sim_node: MakeNode, tmp_path: Path) -> None:
    out = sim_node("v100-pcie-x4").python_json(XID_STORM, str(tmp_path))
    assert out["ignored"] == 400 and out["healthy"]
    assert len(out["lines"]) == 2, out["lines"]
