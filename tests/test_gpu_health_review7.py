"""GPU health on the simulated node: a GPU that hangs while the monitor registers it for XID events."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.gpusim_fixtures import SimNode, gpusim_lib, sim_node
from tests.test_health_monitor import PRELUDE as HEALTH_PRELUDE

__all__ = ["gpusim_lib", "sim_node"]  # fixtures

MakeNode = Callable[[str | Path], SimNode]

HUNG_AT_REGISTRATION = (
    HEALTH_PRELUDE
    + r"""
import threading
import gpumanager.device.health as health
health.NVML_CALL_TIMEOUT = 1.0
nvml.init()
node = discovery.discover(Path(sys.argv[1]))
mon = HealthMonitor(node.gpus, ignored_xids=(13,), quiet_period=0.5, probe_period=0.1)
register = pynvml.nvmlDeviceRegisterEvents
hung_once = []
def hang_then_register(handle, types, event_set):
    if pynvml.nvmlDeviceGetIndex(handle) == 1 and not hung_once:
        hung_once.append(True)
        st.set_hung(1, True)  # stuck in reset after the probe that found it answering, as it is registered
    return register(handle, types, event_set)
pynvml.nvmlDeviceRegisterEvents = hang_then_register
threading.Thread(target=mon.start, daemon=True).start()
out = {"others_watched": wait_for(lambda: watched(mon, 0, 2, 3), timeout=20.0)}
st.queue_xid(2, 79)
out["other_seen"] = wait_for(lambda: not mon.state(2).healthy, timeout=10.0)
out["hung_out"] = wait_for(lambda: not mon.state(1).healthy, timeout=10.0)
out["hung_reason"] = mon.state(1).reason
st.set_hung(1, False)
out["back"] = wait_for(lambda: mon.state(1).healthy, timeout=20.0)
out["watched_back"] = wait_for(lambda: watched(mon, 1), timeout=20.0)
st.queue_xid(1, 79)
out["xid_seen"] = wait_for(lambda: not mon.state(1).healthy, timeout=10.0)
out["reason"] = mon.state(1).reason
mon.stop()
print(json.dumps(out))
"""
)


def test_a_gpu_that_hangs_before_its_xid_events_are_registered_does_not_stop_health_checks(
    sim_node: MakeNode, tmp_path: Path
) -> None:
    out = sim_node("v100-pcie-x4").python_json(HUNG_AT_REGISTRATION, str(tmp_path), timeout=120)
    assert out["others_watched"] is True, out  # the other GPUs' XID events are watched meanwhile
    assert out["other_seen"] is True, out
    assert out["hung_out"] is True and "does not answer" in out["hung_reason"], out
    assert out["back"] is True and out["watched_back"] is True, out  # registered once it answers again
    assert out["xid_seen"] is True and out["reason"] == "XID 79", out


XID_RIGHT_AFTER_START = (
    HEALTH_PRELUDE
    + r"""
import types
nvml.init()
node = discovery.discover(Path(sys.argv[1]))
mon = HealthMonitor(node.gpus, ignored_xids=(13,), quiet_period=0.5, probe_period=0.1)
run = mon._run
def late_run(self):
    time.sleep(1.0)  # the health thread scheduled late, as on a loaded node
    run()
mon._run = types.MethodType(late_run, mon)
mon.start()  # the GPUs are offered to the kubelet from now on
st.queue_xid(3, 79)
out = {"seen": wait_for(lambda: not mon.state(3).healthy, timeout=20.0), "reason": mon.state(3).reason}
mon.stop()
print(json.dumps(out))
"""
)


def test_an_xid_raised_once_the_monitor_started_is_acted_on_however_late_its_thread_runs(
    sim_node: MakeNode, tmp_path: Path
) -> None:
    out = sim_node("v100-pcie-x4").python_json(XID_RIGHT_AFTER_START, str(tmp_path), timeout=60)
    assert out == {"seen": True, "reason": "XID 79"}
