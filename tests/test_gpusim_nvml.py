"""The simulated libnvidia-ml.so.1 driven through the real pynvml, in subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from simnode.gpusim_state import GpuSimState, SpecError, load_spec, repo_root, sim_library_dir
from tests.gpusim_fixtures import SPEC_NAMES, SimNode, gpusim_lib, sim_node
from tests.make_lock import run_make

__all__ = ["gpusim_lib", "sim_node"]  # fixtures

MakeNode = Callable[[str | Path], SimNode]

# Dumps everything the simulator reports about the node as JSON; errors appear as {"error": code}.
PROBE = r"""
import ctypes, json, pynvml as n

def call(f, *a):
    try:
        return f(*a)
    except n.NVMLError as e:
        return {"error": e.value}

n.nvmlInit()
count = n.nvmlDeviceGetCount()
hs = [n.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
out = {
    "driver": n.nvmlSystemGetDriverVersion(), "nvml": n.nvmlSystemGetNVMLVersion(),
    "cuda": n.nvmlSystemGetCudaDriverVersion(), "cuda_v2": n.nvmlSystemGetCudaDriverVersion_v2(),
    "count": count, "gpus": [],
}
for i, h in enumerate(hs):
    m1 = n.nvmlDeviceGetMemoryInfo(h)
    m2 = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
    pci = n.nvmlDeviceGetPciInfo(h)
    ext = n.nvmlPciInfoExt_v1_t()
    ext.version = n.nvmlPciInfoExt_v1
    n.nvmlDeviceGetPciInfoExt(h, ctypes.byref(ext))
    links = []
    for k in range(18):
        state = call(n.nvmlDeviceGetNvLinkState, h, k)
        remote = call(n.nvmlDeviceGetNvLinkRemotePciInfo, h, k)
        links.append({
            "state": state,
            "remote": remote if isinstance(remote, dict) else remote.busId,
            "type": call(n.nvmlDeviceGetNvLinkRemoteDeviceType, h, k),
        })
    serial = n.nvmlDeviceGetSerial(h)
    out["gpus"].append({
        "index": n.nvmlDeviceGetIndex(h), "name": n.nvmlDeviceGetName(h), "uuid": n.nvmlDeviceGetUUID(h),
        "minor": n.nvmlDeviceGetMinorNumber(h), "serial": serial,
        "mem": [m1.total, m1.free, m1.used], "mem_v2": [m2.total, m2.reserved, m2.free, m2.used],
        "bus_id": pci.busId, "bus_id_legacy": pci.busIdLegacy, "pci": [pci.domain, pci.bus, pci.device],
        "pci_device_id": pci.pciDeviceId,
        "ext": [getattr(ext.busId, "decode", lambda: ext.busId)(), ext.baseClass, ext.subClass],
        "numa": n.nvmlDeviceGetNumaNodeId(h),
        "cpus": list(n.nvmlDeviceGetCpuAffinity(h, 2)),
        "cpus_socket": list(n.nvmlDeviceGetCpuAffinityWithinScope(h, 2, n.NVML_AFFINITY_SCOPE_SOCKET)),
        "mem_nodes": list(n.nvmlDeviceGetMemoryAffinity(h, 1, n.NVML_AFFINITY_SCOPE_NODE)),
        "levels": [n.nvmlDeviceGetTopologyCommonAncestor(h, o) for o in hs],
        "p2p_nvlink": [n.nvmlDeviceGetP2PStatus(h, o, n.NVML_P2P_CAPS_INDEX_NVLINK) for o in hs],
        "multi_board": n.nvmlDeviceGetMultiGpuBoard(h),
        "cc": list(n.nvmlDeviceGetCudaComputeCapability(h)),
        "links": links,
        "by_uuid": n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByUUID(n.nvmlDeviceGetUUID(h))),
        "by_bus": n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByPciBusId(pci.busId)),
        "by_legacy_bus": n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByPciBusId(pci.busIdLegacy.lower())),
        "by_serial": n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleBySerial(serial)),
        "procs": [[p.pid, p.usedGpuMemory] for p in n.nvmlDeviceGetComputeRunningProcesses(h)],
        "util": [n.nvmlDeviceGetUtilizationRates(h).gpu, n.nvmlDeviceGetUtilizationRates(h).memory],
    })
out["bad_uuid"] = call(n.nvmlDeviceGetHandleByUUID, "GPU-00000000-0000-0000-0000-000000000000")
out["bad_bus"] = call(n.nvmlDeviceGetHandleByPciBusId, "0000:FE:1F.0")
out["bad_index"] = call(n.nvmlDeviceGetHandleByIndex, count)
n.nvmlShutdown()
print(json.dumps(out))
"""


def run_json(node: SimNode, code: str, *args: str) -> Any:
    done = node.python(code, *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_node_matches_spec(sim_node: MakeNode, name: str) -> None:
    node = sim_node(name)
    spec = node.spec
    out = run_json(node, PROBE)
    assert out["driver"] == spec.driver_version == "550.54.15"
    assert out["nvml"] == "12." + spec.driver_version
    assert out["cuda"] == out["cuda_v2"] == spec.cuda_driver_version
    assert out["count"] == len(spec.gpus)
    not_found = {"error": pynvml.NVML_ERROR_NOT_FOUND}
    assert out["bad_uuid"] == out["bad_bus"] == not_found
    assert out["bad_index"] == {"error": pynvml.NVML_ERROR_INVALID_ARGUMENT}
    switch_domains: dict[str, set[int]] = {}
    for gpu, got in zip(spec.gpus, out["gpus"], strict=True):
        i = gpu.index
        assert got["index"] == got["by_uuid"] == got["by_bus"] == got["by_legacy_bus"] == got["by_serial"] == i
        assert (got["name"], got["uuid"], got["minor"], got["serial"]) == (gpu.name, gpu.uuid, gpu.minor, gpu.serial)
        total = gpu.memory_mib << 20
        assert got["mem"] == [total, total, 0]
        assert got["mem_v2"] == [total, 0, total, 0]
        assert got["bus_id"] == gpu.pci_bus_id
        assert got["bus_id_legacy"] == gpu.pci_bus_id[4:]
        assert got["pci"] == [0, int(gpu.pci_bus_id[9:11], 16), 0]
        assert got["pci_device_id"] & 0xFFFF == 0x10DE
        assert got["ext"] == [gpu.pci_bus_id, 0x03, 0x02]
        assert got["numa"] == gpu.numa_node
        cpu_mask = sum(1 << c for c in range(32 * gpu.numa_node, 32 * gpu.numa_node + 32))
        assert got["cpus"] == got["cpus_socket"] == [cpu_mask & (2**64 - 1), cpu_mask >> 64]
        assert got["mem_nodes"] == [1 << gpu.numa_node]
        assert got["levels"] == list(spec.topology[i])
        assert got["multi_board"] == int(gpu.multi_gpu_board)
        assert got["util"] == [0, 0] and got["procs"] == []
        expected_p2p = [
            pynvml.NVML_P2P_STATUS_OK if spec.nvlink_links(i, j) else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
            for j in range(len(spec.gpus))
        ]
        assert got["p2p_nvlink"] == expected_p2p
        widest = max((spec.nvlink_links(i, j) for j in range(len(spec.gpus))), default=0)
        if widest == 0:
            unsupported = {"error": pynvml.NVML_ERROR_NOT_SUPPORTED}
            assert all(link == {"state": unsupported, "remote": unsupported, "type": unsupported}
                       for link in got["links"])  # fmt: skip
        else:
            # The shipped NVLink specs are all-to-all fabrics: every link goes to the group's NVSwitch.
            for link in got["links"][:widest]:
                assert link["state"] == pynvml.NVML_FEATURE_ENABLED
                assert link["type"] == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
            assert len({link["remote"] for link in got["links"][:widest]}) == 1
            switch_domains.setdefault(got["links"][0]["remote"], set()).add(i)
    expected_models = {"t4-x1": (7, 5), "v100-pcie-x4": (7, 0), "h100-nvlink-x8": (9, 0), "h200-x16": (9, 0)}
    assert {tuple(g["cc"]) for g in out["gpus"]} == {expected_models[name]}
    if name == "h100-nvlink-x8":
        assert list(switch_domains.values()) == [set(range(8))]
    if name == "h200-x16":
        assert sorted(switch_domains.values(), key=min) == [set(range(8)), set(range(8, 16))]


LINK_PROBE = r"""
import json, pynvml as n
n.nvmlInit()
hs = [n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount())]
bus = {n.nvmlDeviceGetPciInfo(h).busId: i for i, h in enumerate(hs)}
out = []
for h in hs:
    peers = []
    for k in range(18):
        if n.nvmlDeviceGetNvLinkState(h, k) != n.NVML_FEATURE_ENABLED:
            peers.append(None)
            continue
        remote = n.nvmlDeviceGetNvLinkRemotePciInfo(h, k).busId
        peers.append(bus.get(remote, remote))
    out.append(peers)
print(json.dumps(out))
"""


def write_spec(path: Path, gpus: int, nvlink: list[list[int]]) -> Path:
    doc = {
        "driver_version": "535.183.01",
        "cuda_driver_version": 12020,
        "gpus": [
            {
                "uuid": f"GPU-{i:08x}-1111-2222-3333-444455556666",
                "name": "NVIDIA A100-SXM4-80GB",
                "minor": i,
                "memory_mib": 81920,
                "pci_bus_id": f"00000000:{0x10 + i:02X}:00.0",
                "numa_node": 0,
                "sm_count": 108,
                "multi_gpu_board": False,
            }
            for i in range(gpus)
        ],
        "topology": [[0 if i == j else 40 for j in range(gpus)] for i in range(gpus)],
        "nvlink": nvlink,
    }
    path.write_text(json.dumps(doc))
    return path


def test_point_to_point_links_are_given_to_peers_in_list_order(sim_node: MakeNode, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "p2p.json", 4, [[0, 1, 2], [0, 2, 1], [1, 2, 4], [2, 3, 6]])
    out = run_json(sim_node(spec), LINK_PROBE)

    def padded(peers: list[int]) -> list[int | None]:
        return [*peers, *[None] * (18 - len(peers))]

    assert out[0] == padded([1, 1, 2])
    assert out[1] == padded([0, 0, 2, 2, 2, 2])
    assert out[2] == padded([0, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3])
    assert out[3] == padded([2] * 6)


def test_switch_group_and_direct_pair_on_one_node(sim_node: MakeNode, tmp_path: Path) -> None:
    # GPUs 0-3 all-to-all with 12 links each need more than 18 links: an NVSwitch group.
    # GPUs 4 and 5 share 4 point-to-point links.
    pairs = [[a, b, 12] for a in range(4) for b in range(a + 1, 4)] + [[4, 5, 4]]
    out = run_json(sim_node(write_spec(tmp_path / "mixed.json", 6, pairs)), LINK_PROBE)
    for i in range(4):
        assert out[i] == ["0000FFFF:00:00.0"] * 12 + [None] * 6
    assert out[4] == [5] * 4 + [None] * 14
    assert out[5] == [4] * 4 + [None] * 14


PROCS_PROBE = r"""
import ctypes, json, pynvml as n

class ProcV1(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]

n.nvmlInit()
out = []
for i in range(n.nvmlDeviceGetCount()):
    h = n.nvmlDeviceGetHandleByIndex(i)
    count = ctypes.c_uint(0)
    rc = n.nvmlLib.nvmlDeviceGetComputeRunningProcesses(h, ctypes.byref(count), None)
    buf = (ProcV1 * 8)()
    count8 = ctypes.c_uint(8)
    rc_full = n.nvmlLib.nvmlDeviceGetComputeRunningProcesses(h, ctypes.byref(count8), buf)
    m1 = n.nvmlDeviceGetMemoryInfo(h)
    m2 = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
    try:
        putil = sorted([s.pid, s.smUtil, s.memUtil] for s in n.nvmlDeviceGetProcessUtilization(h, 0))
    except n.NVMLError as e:
        putil = {"error": e.value}
    out.append({
        "v3": sorted([p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId]
                     for p in n.nvmlDeviceGetComputeRunningProcesses(h)),
        "v2": sorted([p.pid, p.usedGpuMemory] for p in n.nvmlDeviceGetComputeRunningProcesses_v2(h)),
        "v1_size_query": [rc, count.value],
        "v1": [rc_full, sorted([buf[k].pid, buf[k].usedGpuMemory] for k in range(count8.value))],
        "mem": [m1.used, m1.free, m2.used, m2.free],
        "putil": putil,
    })
print(json.dumps(out))
"""


def test_processes_and_memory_follow_the_process_table(sim_node: MakeNode) -> None:
    node = sim_node("v100-pcie-x4")
    mib = 1 << 20
    for args in (
        ["proc", "--gpu", "1", "--pid", "4242", "--used-mib", "1024", "--sm-percent", "40", "--mem-percent", "7"],
        ["proc", "--gpu", "1", "--pid", "5151", "--used-mib", "512"],
        ["proc", "--gpu", "3", "--pid", "4242", "--used-mib", "100"],
    ):
        assert node.gpusim(*args).returncode == 0
    out = run_json(node, PROCS_PROBE)
    total = 32768 * mib
    none = 0xFFFFFFFF
    assert out[1]["v3"] == [[4242, 1024 * mib, none, none], [5151, 512 * mib, none, none]]
    assert out[1]["v2"] == [[4242, 1024 * mib], [5151, 512 * mib]]
    assert out[1]["v1_size_query"] == [pynvml.NVML_ERROR_INSUFFICIENT_SIZE, 2]
    assert out[1]["v1"] == [pynvml.NVML_SUCCESS, [[4242, 1024 * mib], [5151, 512 * mib]]]
    assert out[1]["mem"] == [1536 * mib, total - 1536 * mib] * 2
    assert out[1]["putil"] == [[4242, 40, 7]]
    assert out[3]["v3"] == [[4242, 100 * mib, none, none]]
    assert out[0]["v3"] == [] and out[0]["mem"] == [0, total, 0, total]
    assert out[0]["v1_size_query"] == [pynvml.NVML_SUCCESS, 0]
    assert out[0]["putil"] == {"error": pynvml.NVML_ERROR_NOT_FOUND}

    assert node.gpusim("proc-remove", "--pid", "4242", "--gpu", "1").returncode == 0
    out = run_json(node, PROCS_PROBE)
    assert out[1]["v2"] == [[5151, 512 * mib]]
    assert out[1]["mem"][0] == 512 * mib
    assert out[3]["v2"] == [[4242, 100 * mib]]  # only GPU 1's entry went


UTIL_PROBE = r"""
import json, sys, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(int(sys.argv[1]))
u = n.nvmlDeviceGetUtilizationRates(h)
def samples(kind, since):
    try:
        vtype, ss = n.nvmlDeviceGetSamples(h, kind, since)
        return [vtype, [[s.timeStamp, s.sampleValue.uiVal] for s in ss]]
    except n.NVMLError as e:
        return {"error": e.value}
gpu = samples(n.NVML_GPU_UTILIZATION_SAMPLES, 0)
later = samples(n.NVML_GPU_UTILIZATION_SAMPLES, gpu[1][0][0]) if isinstance(gpu, list) else None
print(json.dumps({"rates": [u.gpu, u.memory], "gpu": gpu, "later": later,
                  "mem": samples(n.NVML_MEMORY_UTILIZATION_SAMPLES, 0),
                  "power": samples(n.NVML_TOTAL_POWER_SAMPLES, 0)}))
"""


def test_utilisation_rates_and_samples(sim_node: MakeNode) -> None:
    node = sim_node("t4-x1")
    before = run_json(node, UTIL_PROBE, "0")
    assert before["rates"] == [0, 0] and before["gpu"] == {"error": pynvml.NVML_ERROR_NOT_FOUND}
    assert node.gpusim("util", "--gpu", "0", "--percent", "35", "--memory-percent", "5").returncode == 0
    assert node.gpusim("util", "--gpu", "0", "--percent", "73", "--memory-percent", "20").returncode == 0
    out = run_json(node, UTIL_PROBE, "0")
    assert out["rates"] == [73, 20]
    vtype, samples = out["gpu"]
    assert vtype == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    assert [v for _ts, v in samples] == [35, 73]
    assert samples[0][0] <= samples[1][0]
    assert [v for _ts, v in out["later"][1]] == [73]  # only samples after the first one's timestamp
    assert [v for _ts, v in out["mem"][1]] == [5, 20]
    assert out["power"] == {"error": pynvml.NVML_ERROR_NOT_SUPPORTED}


STUB_PROBE = r"""
import ctypes, json, sys, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
results = {}
for name, call in [
    ("fan", lambda: n.nvmlDeviceGetFanSpeed(h)),
    ("temperature", lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
    ("power", lambda: n.nvmlDeviceGetPowerUsage(h)),
    ("ecc", lambda: n.nvmlDeviceGetEccMode(h)),
    ("clock", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
]:
    try:
        call()
        results[name] = "ok"
    except n.NVMLError as e:
        results[name] = e.value
lib = ctypes.CDLL("libnvidia-ml.so.1")
names = [line.strip().rstrip(";") for line in open(sys.argv[1]) if line.startswith("    nvml")]
results["missing"] = [name for name in names if not hasattr(lib, name)]
results["exported"] = len(names)
print(json.dumps(results))
"""


def test_unimplemented_functions_return_not_supported(sim_node: MakeNode) -> None:
    node = sim_node("h100-nvlink-x8")
    out = run_json(node, STUB_PROBE, str(sim_library_dir() / "libnvidia-ml.map"))
    for name in ("fan", "temperature", "power", "ecc", "clock"):
        assert out[name] == pynvml.NVML_ERROR_NOT_SUPPORTED, name
    assert out["missing"] == []
    assert out["exported"] > 300


CALLS_WITHOUT_INIT = r"""
import ctypes, json
lib = ctypes.CDLL("libnvidia-ml.so.1")
count = ctypes.c_uint(0)
before = [lib.nvmlDeviceGetCount_v2(ctypes.byref(count)), lib.nvmlShutdown()]
during = [lib.nvmlInit_v2(), lib.nvmlInitWithFlags(0), lib.nvmlShutdown()]
during.append(lib.nvmlDeviceGetCount_v2(ctypes.byref(count)))
n = count.value
after = [lib.nvmlShutdown(), lib.nvmlDeviceGetCount_v2(ctypes.byref(count)), lib.nvmlShutdown()]
lib.nvmlErrorString.restype = ctypes.c_char_p
print(json.dumps({"before": before, "during": during, "count": n, "after": after,
                  "text": lib.nvmlErrorString(15).decode()}))
"""


def test_init_is_reference_counted(sim_node: MakeNode) -> None:
    out = run_json(sim_node("v100-pcie-x4"), CALLS_WITHOUT_INIT)
    uninit = pynvml.NVML_ERROR_UNINITIALIZED
    assert out["before"] == [uninit, uninit]
    assert out["during"] == [0, 0, 0, 0] and out["count"] == 4
    assert out["after"] == [0, uninit, uninit]
    assert out["text"] == "GPU is lost"


# ---- events -----------------------------------------------------------------------------------

WAITER = r"""
import json, sys, pynvml as n
n.nvmlInit()
s = n.nvmlEventSetCreate()
for i in range(n.nvmlDeviceGetCount()):
    n.nvmlDeviceRegisterEvents(n.nvmlDeviceGetHandleByIndex(i), n.nvmlEventTypeXidCriticalError, s)
print("READY", flush=True)
try:
    d = n.nvmlEventSetWait_v2(s, int(sys.argv[1]))
    print(json.dumps({"gpu": n.nvmlDeviceGetIndex(d.device), "type": d.eventType, "xid": d.eventData,
                      "gi": d.gpuInstanceId, "ci": d.computeInstanceId}))
except n.NVMLError as e:
    print(json.dumps({"error": e.value}))
"""


def start_waiter(node: SimNode, timeout_ms: int) -> subprocess.Popen[str]:
    proc = node.popen_python(WAITER, str(timeout_ms))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        _out, err = proc.communicate()
        pytest.fail(f"waiter did not start: {line!r} {err}")
    return proc


def waiter_result(proc: subprocess.Popen[str]) -> Any:
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_xid_from_the_cli_reaches_every_waiting_process(sim_node: MakeNode) -> None:
    node = sim_node("h100-nvlink-x8")
    waiters = [start_waiter(node, 20000) for _ in range(2)]
    done = node.gpusim("xid", "--gpu", "5", "--xid", "79")
    assert done.returncode == 0, done.stderr
    for proc in waiters:
        assert waiter_result(proc) == {
            "gpu": 5,
            "type": pynvml.nvmlEventTypeXidCriticalError,
            "xid": 79,
            "gi": 0xFFFFFFFF,
            "ci": 0xFFFFFFFF,
        }


def test_wait_times_out_and_ignores_events_queued_before_registration(sim_node: MakeNode) -> None:
    node = sim_node("t4-x1")
    assert node.gpusim("xid", "--gpu", "0", "--xid", "48").returncode == 0
    proc = start_waiter(node, 200)
    assert waiter_result(proc) == {"error": pynvml.NVML_ERROR_TIMEOUT}


BLOCKING_WAITER = r"""
import json, resource, sys, pynvml as n
from simnode.gpusim_state import GpuSimState
n.nvmlInit()
s = n.nvmlEventSetCreate()
n.nvmlDeviceRegisterEvents(n.nvmlDeviceGetHandleByIndex(0), n.nvmlEventTypeXidCriticalError, s)
out = {}
for name in ("quiet", "woken"):
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
    if name == "woken":
        print("READY", flush=True)
    try:
        d = n.nvmlEventSetWait_v2(s, int(sys.argv[1]))
        result = d.eventData
    except n.NVMLError as e:
        result = {"error": e.value}
    out[name] = {"result": result, "switches": resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before}
print(json.dumps(out))
"""


def test_event_wait_blocks_until_a_writer_wakes_it(sim_node: MakeNode) -> None:
    # The driver's nvmlEventSetWait sleeps in the kernel until an event comes; the simulated one
    # blocks on the state file's change counter. A poller would wake hundreds of times a second
    # (voluntary context switches of the waiting thread); a blocked waiter once or twice.
    node = sim_node("t4-x1")
    proc = node.popen_python(BLOCKING_WAITER, "1000")
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "READY"
    time.sleep(0.3)
    with GpuSimState(node.state_path) as state:
        state.queue_xid(0, 79)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    assert got["quiet"]["result"] == {"error": pynvml.NVML_ERROR_TIMEOUT}
    assert got["woken"]["result"] == 79
    assert got["quiet"]["switches"] <= 5, got
    assert got["woken"]["switches"] <= 5, got


LOST_PROBE = r"""
import json, subprocess, sys, pynvml as n
def call(f, *a):
    try:
        r = f(*a)
        return r if isinstance(r, (int, str)) else "ok"
    except n.NVMLError as e:
        return {"error": e.value}
n.nvmlInit()
try:
    h1 = n.nvmlDeviceGetHandleByIndex(1)
except n.NVMLError:  # lost already
    h1 = None
h0 = n.nvmlDeviceGetHandleByIndex(0)
subprocess.run([sys.executable, "-m", "simnode.gpusim", *sys.argv[2:]], check=True)  # after the handles are taken
h1 = h1 or n.nvmlDeviceGetHandleByIndex(1)
print(json.dumps({
    "handle": call(n.nvmlDeviceGetHandleByIndex, 1),
    "name": call(n.nvmlDeviceGetName, h1), "mem": call(n.nvmlDeviceGetMemoryInfo, h1),
    "uuid_lookup": call(n.nvmlDeviceGetHandleByUUID, sys.argv[1]),
    "other": call(n.nvmlDeviceGetName, h0), "count": call(n.nvmlDeviceGetCount),
}))
"""


def test_lost_gpu_and_restore(sim_node: MakeNode) -> None:
    node = sim_node("v100-pcie-x4")
    uuid = node.spec.gpus[1].uuid
    waiter = start_waiter(node, 20000)
    lost = {"error": pynvml.NVML_ERROR_GPU_IS_LOST}
    # A lost GPU has no handle (nvidia-smi: "Unable to determine the device handle ... GPU is lost"),
    # and a handle taken before the loss answers GPU_IS_LOST.
    assert run_json(node, LOST_PROBE, uuid, "lost", "--gpu", "1") == {
        "handle": lost,
        "name": lost,
        "mem": lost,
        "uuid_lookup": lost,
        "other": "Tesla V100-PCIE-32GB",
        "count": 4,
    }
    assert waiter_result(waiter) == {"error": pynvml.NVML_ERROR_GPU_IS_LOST}
    out = run_json(node, LOST_PROBE, uuid, "restore", "--gpu", "1")
    assert out["handle"] == "ok" and out["name"] == "Tesla V100-PCIE-32GB" and out["mem"] == "ok"
    assert out["uuid_lookup"] == "ok"
    waiter = start_waiter(node, 100)
    assert waiter_result(waiter) == {"error": pynvml.NVML_ERROR_TIMEOUT}


# ---- bad configuration ------------------------------------------------------------------------

INIT = r"""
import pynvml as n
try:
    n.nvmlInit()
    print("OK")
except n.NVMLError as e:
    print(e.value)
"""

Mutation = Callable[[dict[str, Any]], None]


def _set(path: tuple[Any, ...], value: Any) -> Mutation:
    def apply(doc: dict[str, Any]) -> None:
        target: Any = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return apply


def _delete(path: tuple[Any, ...]) -> Mutation:
    def apply(doc: dict[str, Any]) -> None:
        target: Any = doc
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return apply


def _copy_field(src: tuple[Any, ...], dst: tuple[Any, ...]) -> Mutation:
    def apply(doc: dict[str, Any]) -> None:
        value: Any = doc
        for key in src:
            value = value[key]
        _set(dst, value)(doc)

    return apply


BAD_SPECS: list[tuple[str, Mutation, str]] = [
    ("negative-memory", _set(("gpus", 2, "memory_mib"), -5), "gpus[2].memory_mib: expected a positive integer"),
    ("missing-memory", _delete(("gpus", 0, "memory_mib")), "gpus[0].memory_mib: missing"),
    ("float-sm-count", _set(("gpus", 1, "sm_count"), 80.5), "gpus[1].sm_count: expected a positive integer"),
    ("bad-uuid", _set(("gpus", 1, "uuid"), "GPU-1234"), "gpus[1].uuid: expected a UUID"),
    ("duplicate-uuid", _copy_field(("gpus", 0, "uuid"), ("gpus", 3, "uuid")), "gpus[3].uuid: duplicate"),
    ("duplicate-minor", _set(("gpus", 2, "minor"), 0), "gpus[2].minor: duplicate"),
    ("duplicate-bus", _copy_field(("gpus", 0, "pci_bus_id"), ("gpus", 1, "pci_bus_id")), "gpus[1].pci_bus_id"),
    ("bad-bus", _set(("gpus", 0, "pci_bus_id"), "18:00"), "gpus[0].pci_bus_id: expected a PCI bus id"),
    ("board-not-bool", _set(("gpus", 0, "multi_gpu_board"), 1), "gpus[0].multi_gpu_board: expected a boolean"),
    ("no-driver", _delete(("driver_version",)), "driver_version: missing"),
    ("gpus-not-list", _set(("gpus",), {}), "gpus: invalid"),
    ("topology-rows", _delete(("topology", 3)), "topology: expected 4 rows"),
    ("topology-level", _set(("topology", 0, 1), 15), "topology[0][1]: expected one of 0, 10, 20, 30, 40, 50"),
    ("topology-asymmetric", _set(("topology", 0, 1), 20), "topology[1][0]: expected 20"),
    ("nvlink-index", _set(("nvlink",), [[0, 4, 2]]), "nvlink[0][1]: expected a GPU index from 0 to 3"),
    ("nvlink-links", _set(("nvlink",), [[0, 1, 19]]), "nvlink[0][2]: expected an integer from 1 to 18"),
    ("nvlink-self", _set(("nvlink",), [[2, 2, 1]]), "nvlink[0]: GPU 2 cannot link to itself"),
    ("nvlink-duplicate", _set(("nvlink",), [[0, 1, 2], [1, 0, 2]]), "nvlink[1]: duplicate of nvlink[0]"),
]


def assert_one_message(stderr: str, expected: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("gpusim: ") and expected in lines[0], stderr


@pytest.mark.parametrize(("case", "mutate", "field"), BAD_SPECS, ids=[case[0] for case in BAD_SPECS])
def test_invalid_spec_fails_init_naming_the_field(
    sim_node: MakeNode, tmp_path: Path, case: str, mutate: Mutation, field: str
) -> None:
    doc = json.loads((repo_root() / "deploy" / "sim" / "v100-pcie-x4.json").read_text())
    mutate(doc)
    spec = tmp_path / f"{case}.json"
    spec.write_text(json.dumps(doc))
    done = sim_node(spec).python(INIT)
    assert done.stdout.strip() == str(pynvml.NVML_ERROR_UNKNOWN)
    assert_one_message(done.stderr, f"{spec}: {field}")
    with pytest.raises(SpecError) as info:  # the Python validator agrees
        load_spec(spec)
    assert f"{spec}: {field}" in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"driver_version": "1",', "invalid JSON: line 1 column 24"),
        ('{"a": 1, "a": 2}', 'invalid JSON: line 1 column 10: duplicate key "a"'),
        ("[1, 2]", "(document): expected an object"),
    ],
)
def test_malformed_json_fails_init(sim_node: MakeNode, tmp_path: Path, text: str, expected: str) -> None:
    spec = tmp_path / "bad.json"
    spec.write_text(text)
    done = sim_node(spec).python(INIT)
    assert done.stdout.strip() == str(pynvml.NVML_ERROR_UNKNOWN)
    assert_one_message(done.stderr, f"{spec}: {expected}")
    with pytest.raises(SpecError):
        load_spec(spec)


def test_missing_environment_and_unreadable_files(sim_node: MakeNode, tmp_path: Path) -> None:
    node = sim_node("t4-x1")
    done = node.python(INIT, env=node.env(GPUSIM_SPEC=None))
    assert done.stdout.strip() == str(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    assert_one_message(done.stderr, "GPUSIM_SPEC is not set")

    done = node.python(INIT, env=node.env(GPUSIM_SPEC=str(tmp_path / "nope.json")))
    assert done.stdout.strip() == str(pynvml.NVML_ERROR_UNKNOWN)
    assert_one_message(done.stderr, f"{tmp_path / 'nope.json'}: cannot read the spec file")

    done = node.python(INIT, env=node.env(GPUSIM_STATE=None))
    assert done.stdout.strip() == str(pynvml.NVML_ERROR_UNKNOWN)
    assert_one_message(done.stderr, "GPUSIM_STATE is not set")

    garbage = tmp_path / "garbage.state"
    garbage.write_bytes(b"definitely not a state file" * 10)
    done = node.python(INIT, env=node.env(GPUSIM_STATE=str(garbage)))
    assert done.stdout.strip() == str(pynvml.NVML_ERROR_UNKNOWN)
    assert_one_message(done.stderr, f"{garbage}: not a gpusim state file")

    done = node.python(INIT)  # and with everything in place it works
    assert done.stdout.strip() == "OK", done.stderr


def test_make_test_runs_the_c_tests_under_sanitizers(gpusim_lib: Path) -> None:
    done = run_make(
        ["make", "-C", str(repo_root() / "vcuda"), "test", f"PYTHON={sys.executable}"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "test_nvml_sim: all checks passed" in done.stdout
