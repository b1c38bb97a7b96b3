"""GPU health on the simulated node: a GPU whose NVML calls hang, events of GPUs NVML numbers otherwise."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.gpusim_fixtures import SimNode, gpusim_lib, sim_node
from tests.test_health_monitor import PRELUDE as HEALTH_PRELUDE

__all__ = ["gpusim_lib", "sim_node"]  # fixtures

MakeNode = Callable[[str | Path], SimNode]

PRELUDE = HEALTH_PRELUDE + "import gpumanager.device.health as health\n"

HUNG_GPU = (
    PRELUDE
    + r"""
health.NVML_CALL_TIMEOUT = 1.0
nvml.init()
node = discovery.discover(Path(sys.argv[1]))
mon = HealthMonitor(node.gpus, ignored_xids=(13,), quiet_period=0.5, probe_period=0.1)
mon.start()
watching(mon, 0, 1, 2, 3)
st.set_hung(1, True)  # GPU 1 stuck in reset: every NVML call on it blocks
time.sleep(0.3)
st.queue_xid(2, 79)
other_seen = wait_for(lambda: not mon.state(2).healthy, timeout=5.0)
hung_out = wait_for(lambda: not mon.state(1).healthy, timeout=5.0)
reason = mon.state(1).reason
st.set_hung(1, False)
back = wait_for(lambda: mon.state(1).healthy, timeout=10.0)
mon.stop()
print(json.dumps({"other_seen": other_seen, "hung_out": hung_out, "hung_reason": reason, "back": back}))
"""
)


def test_a_gpu_whose_nvml_calls_hang_does_not_stop_health_checks_of_the_others(
    sim_node: MakeNode, tmp_path: Path
) -> None:
    out = sim_node("v100-pcie-x4").python_json(HUNG_GPU, str(tmp_path), timeout=60)
    assert out["other_seen"] is True  # an XID of another GPU is acted on while GPU 1 hangs
    assert out["hung_out"] is True  # the hung GPU is taken out of service
    assert "does not answer" in out["hung_reason"]
    assert out["back"] is True  # and comes back once its calls answer and the quiet period passed


HUNG_GPU_METRICS = (
    PRELUDE
    + r"""
from types import SimpleNamespace
import gpumanager.metrics.bounded as bounded
from gpumanager.metrics.bounded import NVMLReads
from gpumanager.metrics.collector import AgentCollector
bounded.DEADLINE = 0.5
nvml.init()
node = discovery.discover(Path(sys.argv[1]))
agent = SimpleNamespace(gpus=node.gpus, layout=None, health=None, plugins=None, allocator=None)
collector = AgentCollector(agent, NVMLReads())
def used():
    for metric in collector.collect():
        if metric.name == "gpu_manager_gpu_memory_used_bytes":
            return sorted(int(s.labels["gpu"]) for s in metric.samples)
    return None
before = used()
st.set_hung(1, True)
first = used()
second = used()
st.set_hung(1, False)
wait_for(lambda: used() == [0, 1, 2, 3], timeout=30.0)  # once the read that hung has returned
after = used()
print(json.dumps({"before": before, "first": first, "second": second, "after": after}))
"""
)


def test_a_gpu_whose_nvml_calls_hang_leaves_out_only_its_own_metrics(sim_node: MakeNode, tmp_path: Path) -> None:
    out = sim_node("v100-pcie-x4").python_json(HUNG_GPU_METRICS, str(tmp_path), timeout=60)
    assert out["before"] == [0, 1, 2, 3]
    assert out["second"] == [0, 2, 3]  # the hung GPU is not asked again; the others are read
    assert out["after"] == [0, 1, 2, 3]  # back once its call returned


def test_an_xid_named_only_by_nvml_index_marks_the_gpu_nvml_numbers_so_now(monkeypatch: pytest.MonkeyPatch) -> None:
    import pynvml

    from gpumanager.device import nvml
    from gpumanager.device.health import HealthMonitor
    from gpumanager.device.types import GPUInfo

    gpus = [
        GPUInfo(0, "GPU-00000000-0000-0000-0000-000000000000", "T4", 0, 1 << 34, "00000000:18:00.0"),
        GPUInfo(1, "GPU-11111111-1111-1111-1111-111111111111", "T4", 1, 1 << 34, "00000000:19:00.0"),
    ]
    # The device IDs were laid out when NVML numbered these GPUs the other way round.
    monkeypatch.setattr(nvml, "_nvml_index", {0: 1, 1: 0})

    def no_uuid(handle: object) -> str:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", no_uuid)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetIndex", lambda handle: 0)  # NVML's index 0 now: the agent's GPU 1
    mon = HealthMonitor(gpus, ignored_xids=(13,), quiet_period=60.0)
    data = pynvml.c_nvmlEventData_t()
    data.eventType = pynvml.nvmlEventTypeXidCriticalError
    data.eventData = 79
    mon._handle_event(data)
    assert not mon.state(1).healthy
    assert mon.state(0).healthy


MODES = (
    PRELUDE
    + r"""
nvml.init()
node = discovery.discover(Path(sys.argv[1]))
mon = HealthMonitor(node.gpus, ignored_xids=(13,), quiet_period=0.5, probe_period=0.1)
mon.start()
time.sleep(0.3)
st.set_compute_mode(1, 3)  # EXCLUSIVE_PROCESS: the second share's context is refused
st.set_mig(2, True)
out = {}
out["exclusive_out"] = wait_for(lambda: not mon.state(1).healthy, timeout=5.0)
out["exclusive_reason"] = mon.state(1).reason
out["mig_out"] = wait_for(lambda: not mon.state(2).healthy, timeout=5.0)
out["mig_reason"] = mon.state(2).reason
out["others"] = [mon.state(i).healthy for i in (0, 3)]
st.set_compute_mode(1, 0)
st.set_mig(2, False)
out["exclusive_back"] = wait_for(lambda: mon.state(1).healthy, timeout=10.0)
out["mig_back"] = wait_for(lambda: mon.state(2).healthy, timeout=10.0)
mon.stop()
out["log"] = buf.getvalue()
print(json.dumps(out))
"""
)


def test_gpus_in_an_exclusive_compute_mode_or_mig_mode_are_out_of_service_until_set_back(
    sim_node: MakeNode, tmp_path: Path
) -> None:
    out = sim_node("h100-nvlink-x8").python_json(MODES, str(tmp_path), timeout=60)
    assert out["mig_out"] is True
    assert out["mig_reason"] == "MIG mode"
    assert out["exclusive_out"] is True
    assert out["exclusive_reason"] == "compute mode EXCLUSIVE_PROCESS"
    assert "nvidia-smi -i GPU-" in out["log"] and "-c DEFAULT" in out["log"]
    assert out["others"] == [True, True]
    assert out["exclusive_back"] is True
    assert out["mig_back"] is True


MODE_ANSWERS = r"""
import json, os, pynvml as n
from simnode.gpusim_state import GpuSimState
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
out = {"compute": int(n.nvmlDeviceGetComputeMode(h))}
try:
    out["mig"] = list(n.nvmlDeviceGetMigMode(h))
except n.NVMLError as e:
    out["mig"] = e.value
with GpuSimState(os.environ["GPUSIM_STATE"]) as st:
    st.set_compute_mode(0, 2)
    st.set_mig(0, True)
out["compute_after"] = int(n.nvmlDeviceGetComputeMode(h))
try:
    out["mig_after"] = list(n.nvmlDeviceGetMigMode(h))
except n.NVMLError as e:
    out["mig_after"] = e.value
print(json.dumps(out))
"""


def test_the_simulated_nvml_answers_compute_and_mig_modes_as_the_model_does(sim_node: MakeNode) -> None:
    import pynvml

    h100 = json.loads(sim_node("h100-nvlink-x8").python(MODE_ANSWERS).stdout)
    assert h100 == {"compute": 0, "mig": [0, 0], "compute_after": 2, "mig_after": [1, 1]}
    t4 = json.loads(sim_node("t4-x1").python(MODE_ANSWERS).stdout)  # a T4 has no MIG
    assert t4 == {
        "compute": 0,
        "mig": pynvml.NVML_ERROR_NOT_SUPPORTED,
        "compute_after": 2,
        "mig_after": pynvml.NVML_ERROR_NOT_SUPPORTED,
    }


HUNG_AT_START = (
    PRELUDE
    + r"""
import threading
nvml.DESCRIBE_TIMEOUT = 3.0
st.set_hung(1, True)  # stuck in reset when the agent starts
nvml.init()
found = {}
def run():
    found["node"] = discovery.discover(Path(sys.argv[1]))
t = threading.Thread(target=run, daemon=True)
t.start()
t.join(15.0)
node = found.get("node")
out = {"done": node is not None}
if node is not None:
    out["lost"] = node.lost
    out["uuids"] = [g.uuid for g in node.gpus]
    out["log"] = buf.getvalue()
st.set_hung(1, False)
print(json.dumps(out))
"""
)


def test_a_gpu_whose_nvml_calls_hang_at_start_does_not_stop_discovery(sim_node: MakeNode, tmp_path: Path) -> None:
    out = sim_node("v100-pcie-x4").python_json(HUNG_AT_START, str(tmp_path), timeout=60)
    assert out["done"] is True  # the other GPUs are served
    assert out["lost"] == [1]  # the hung one is listed Unhealthy, its device IDs kept
    assert len(out["uuids"]) == 4
    assert "GPU 1" in out["log"] and "does not answer" in out["log"]


ACROSS_RESTART = (
    PRELUDE
    + r"""
saved = Path(sys.argv[1]) / health.SAVED_FILE
nvml.init()
node = discovery.discover(Path(sys.argv[1]))
first = HealthMonitor(node.gpus, ignored_xids=(13,), quiet_period=1.5, probe_period=0.1, saved=saved)
first.start()
watching(first, 1)
st.queue_xid(1, 79)
out = {"out": wait_for(lambda: not first.state(1).healthy)}
first.stop()
# The agent restarts at once: the XID is not sent again.
second = HealthMonitor(node.gpus, ignored_xids=(13,), quiet_period=1.5, probe_period=0.1, saved=saved)
second.start()
out["after_restart"] = [second.state(i).healthy for i in range(4)]
out["reason"] = second.state(1).reason
out["back"] = wait_for(lambda: second.state(1).healthy, timeout=10.0)
second.stop()
third = HealthMonitor(node.gpus, ignored_xids=(13,), quiet_period=1.5, probe_period=0.1, saved=saved)
third.start()
out["after_recovery"] = [third.state(i).healthy for i in range(4)]
third.stop()
print(json.dumps(out))
"""
)


def test_a_gpu_out_for_an_xid_stays_out_across_a_restart_until_its_quiet_period_ends(
    sim_node: MakeNode, tmp_path: Path
) -> None:
    out = sim_node("v100-pcie-x4").python_json(ACROSS_RESTART, str(tmp_path), timeout=60)
    assert out["out"] is True
    assert out["after_restart"] == [True, False, True, True]
    assert out["reason"] == "XID 79"
    assert out["back"] is True
    assert out["after_recovery"] == [True, True, True, True]  # a GPU back in service is not taken out again


EARLY_TIMEOUTS = (
    PRELUDE
    + r"""
nvml.init()
node = discovery.discover(Path(sys.argv[1]))
mon = HealthMonitor(node.gpus, ignored_xids=(13,), quiet_period=0.5, probe_period=0.1)
calls = [0]
def wait(event_set, ms):  # a driver whose wait answers TIMEOUT at once instead of waiting
    calls[0] += 1
    raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
pynvml.nvmlEventSetWait_v2 = wait
mon.start()
time.sleep(0.2)
before = calls[0]
time.sleep(1.0)
during = calls[0] - before
mon.stop()
print(json.dumps({"waits": during, "alive_problem": mon.event_problem()}))
"""
)


def test_an_event_wait_that_times_out_at_once_does_not_spin(sim_node: MakeNode, tmp_path: Path) -> None:
    out = sim_node("t4-x1").python_json(EARLY_TIMEOUTS, str(tmp_path), timeout=60)
    # Each wait asks for 100 ms: about ten a second, not a core spinning on NVML.
    assert 0 < out["waits"] < 100, out


def test_nvml_refused_for_a_driver_upgraded_under_it_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    import pynvml

    from gpumanager.device import nvml

    def mismatch() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)

    monkeypatch.setattr(pynvml, "nvmlInit", mismatch)
    with pytest.raises(nvml.NVMLUnavailableError) as caught:
        nvml.init()
    message = str(caught.value)
    assert "kernel module" in message and "reboot" in message, message


HUNG_BEFORE_MONITOR = (
    PRELUDE
    + r"""
import threading
nvml.DESCRIBE_TIMEOUT = 3.0
health.NVML_CALL_TIMEOUT = 60.0  # a start that asks the hung GPU again would wait this long
st.set_hung(1, True)
st.set_hung(2, True)
nvml.init()
node = discovery.discover(Path(sys.argv[1]))
mon = HealthMonitor(node.gpus, ignored_xids=(13,), quiet_period=0.5, probe_period=0.1, lost=node.lost)
t = threading.Thread(target=mon.start, daemon=True)
t.start()
t.join(20.0)
out = {"lost": node.lost, "started": not t.is_alive(), "healthy": [mon.state(i).healthy for i in range(4)]}
st.set_hung(1, False)
st.set_hung(2, False)
t.join(10.0)
mon.stop()
print(json.dumps(out))
"""
)


def test_the_monitor_starts_without_asking_again_gpus_that_hung_in_discovery(
    sim_node: MakeNode, tmp_path: Path
) -> None:
    out = sim_node("v100-pcie-x4").python_json(HUNG_BEFORE_MONITOR, str(tmp_path), timeout=90)
    assert out["lost"] == [1, 2]
    assert out["started"] is True  # the kubelet's lists are made without waiting for the hung GPUs
    assert out["healthy"] == [True, False, False, True]


WHOLE_GPUS_ONLY = (
    PRELUDE
    + r"""
nvml.init()
node = discovery.discover(Path(sys.argv[1]))
mon = HealthMonitor(node.gpus, ignored_xids=(13,), quiet_period=0.5, probe_period=0.1, shares=False)
mon.start()
st.set_compute_mode(1, 3)  # EXCLUSIVE_PROCESS: a whole GPU for one process, as the operator chose
st.set_compute_mode(2, 2)  # PROHIBITED: no CUDA at all
out = {"prohibited_out": wait_for(lambda: not mon.state(2).healthy, timeout=5.0)}
time.sleep(0.5)
out["exclusive_healthy"] = mon.state(1).healthy
out["prohibited_reason"] = mon.state(2).reason
mon.stop()
print(json.dumps(out))
"""
)


def test_without_shares_an_exclusive_process_gpu_is_served_and_a_prohibited_one_is_not(
    sim_node: MakeNode, tmp_path: Path
) -> None:
    out = sim_node("v100-pcie-x4").python_json(WHOLE_GPUS_ONLY, str(tmp_path), timeout=60)
    assert out == {"prohibited_out": True, "exclusive_healthy": True, "prohibited_reason": "compute mode PROHIBITED"}


def test_nvml_start_waits_for_a_driver_whose_kernel_module_is_not_loaded_yet(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import threading

    import pynvml

    from gpumanager.device import nvml

    monkeypatch.setattr(nvml, "RETRY_FIRST_DELAY", 0.01)
    calls = [0]

    def driver_loads_at_the_third_try() -> None:
        calls[0] += 1
        if calls[0] < 3:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", driver_loads_at_the_third_try)
    with caplog.at_level("WARNING", logger="gpumanager.device.nvml"):
        nvml.init(wait_for_driver=30.0, stopping=threading.Event())
    assert calls[0] == 3
    assert sum("kernel module is not loaded" in r.getMessage() for r in caplog.records) == 1  # said once

    def never() -> None:
        calls[0] += 1
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", never)
    stopping = threading.Event()
    stopping.set()  # a stop signal ends the wait
    with pytest.raises(nvml.NVMLUnavailableError):
        nvml.init(wait_for_driver=3600.0, stopping=stopping)

    def mismatch() -> None:
        calls[0] += 1
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)

    monkeypatch.setattr(pynvml, "nvmlInit", mismatch)
    calls[0] = 0
    with pytest.raises(nvml.NVMLUnavailableError):
        nvml.init(wait_for_driver=3600.0, stopping=threading.Event())
    assert calls[0] == 1  # not something waiting clears
