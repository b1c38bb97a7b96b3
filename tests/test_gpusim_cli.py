"""The gpusim CLI, the Python side of the state file, and the shipped node specs."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from simnode import gpusim_state as gs
from tests.gpusim_fixtures import SPEC_NAMES, SimNode, gpusim_lib, sim_node

__all__ = ["gpusim_lib", "sim_node"]  # fixtures

MakeNode = Callable[[str | Path], SimNode]
MIB = 1 << 20


# ---- shipped specs ----------------------------------------------------------------------------


def test_shipped_specs_describe_the_intended_nodes() -> None:
    specs = {name: gs.load_spec(gs.spec_dir() / f"{name}.json") for name in SPEC_NAMES}
    expected = {
        "t4-x1": (1, "Tesla T4", 15360, 40),
        "v100-pcie-x4": (4, "Tesla V100-PCIE-32GB", 32768, 80),
        "h100-nvlink-x8": (8, "NVIDIA H100 80GB HBM3", 81559, 132),
        "h200-x16": (16, "NVIDIA H200", 143771, 132),
    }
    all_uuids: list[str] = []
    for name, spec in specs.items():
        count, model, mib, sms = expected[name]
        assert len(spec.gpus) == count
        assert {(g.name, g.memory_mib, g.sm_count) for g in spec.gpus} == {(model, mib, sms)}
        assert [g.minor for g in spec.gpus] == list(range(count))
        assert len({g.pci_bus_id for g in spec.gpus}) == count
        assert not any(g.multi_gpu_board for g in spec.gpus)
        all_uuids += [g.uuid for g in spec.gpus]

    v100 = specs["v100-pcie-x4"]
    assert v100.topology == ((0, 10, 30, 30), (10, 0, 30, 30), (30, 30, 0, 10), (30, 30, 10, 0))
    assert {g.numa_node for g in v100.gpus} == {0} and v100.nvlink == ()

    for name, per_socket in (("h100-nvlink-x8", 4), ("h200-x16", 8)):
        spec = specs[name]
        n = len(spec.gpus)
        assert [g.numa_node for g in spec.gpus] == [i // per_socket for i in range(n)]
        for i in range(n):
            for j in range(n):
                want = 0 if i == j else 20 if i // 2 == j // 2 else 40 if i // per_socket == j // per_socket else 50
                assert spec.topology[i][j] == want, (name, i, j)
        group = 8
        linked = {(a, b) for a in range(n) for b in range(n) if a != b and a // group == b // group}
        assert {(link.gpu_a, link.gpu_b) for link in spec.nvlink} | {
            (link.gpu_b, link.gpu_a) for link in spec.nvlink
        } == linked
        assert {link.links for link in spec.nvlink} == {18}

    assert len(set(all_uuids)) == len(all_uuids)  # distinct across every shipped spec
    assert all(re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", u) for u in all_uuids)


# ---- the state file from Python --------------------------------------------------------------


def test_new_state_file_has_the_documented_layout(tmp_path: Path) -> None:
    path = tmp_path / "state"
    with gs.GpuSimState(path) as state:
        snap = state.snapshot(2)
    raw = path.read_bytes()
    assert len(raw) == gs.FILE_SIZE == 233472 + 64 * 188416
    magic, version, header_size, file_size = struct.unpack_from("<8sIIQ", raw, 0)
    assert (magic, version, header_size, file_size) == (b"GPUSIMST", 1, 4096, gs.FILE_SIZE)
    assert struct.unpack_from("<Q", raw, 32)[0] == 1  # event_next_seq
    assert struct.unpack_from("<I", raw, 48)[0] == 4  # section_count
    sections = [struct.unpack_from("<IIIIQ", raw, 256 + 32 * i) for i in range(4)]
    assert sections == [
        (1, 2048, 64, 0, 4096),
        (2, 48, 1024, 0, 135168),
        (3, 48, 1024, 0, 184320),
        (4, 188416, 64, 0, 233472),
    ]
    assert snap.event_next_seq == 1 and snap.events == () and snap.processes == ()
    assert [g.lost for g in snap.gpus] == [False, False]


def test_state_created_by_the_driver_is_shared_with_python(sim_node: MakeNode) -> None:
    node = sim_node("t4-x1")
    done = node.python("import pynvml; pynvml.nvmlInit(); pynvml.nvmlShutdown()")
    assert done.returncode == 0, done.stderr
    assert node.state_path.stat().st_size == gs.FILE_SIZE
    with gs.GpuSimState(node.state_path) as state:
        assert state.queue_xid(0, 31) == 1
        assert state.snapshot(1).events[0].data == 31


def test_unusable_state_files_are_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.write_bytes(b"x" * 5000)
    with pytest.raises(gs.StateError, match="not a gpusim state file"):
        gs.GpuSimState(bad)
    other = tmp_path / "other-version"
    with gs.GpuSimState(other):
        pass
    data = bytearray(other.read_bytes())
    struct.pack_into("<I", data, 8, 99)
    other.write_bytes(bytes(data))
    with pytest.raises(gs.StateError, match="layout version 99"):
        gs.GpuSimState(other)
    short = tmp_path / "short"
    with gs.GpuSimState(short):
        pass
    os.truncate(short, gs.FILE_SIZE - 48)
    with pytest.raises(gs.StateError, match="corrupt state file"):
        gs.GpuSimState(short)


def test_event_ring_keeps_the_newest_events(tmp_path: Path) -> None:
    with gs.GpuSimState(tmp_path / "state") as state:
        seqs = [state.queue_xid(i % 3, 1000 + i) for i in range(gs.EVENT_RING + 6)]
        snap = state.snapshot(3)
    assert seqs == list(range(1, gs.EVENT_RING + 7))
    assert snap.event_next_seq == gs.EVENT_RING + 7
    assert len(snap.events) == gs.EVENT_RING
    assert snap.events[0].seq == 7 and snap.events[0].data == 1006
    assert snap.events[-1].seq == gs.EVENT_RING + 6 and snap.events[-1].gpu == (gs.EVENT_RING + 5) % 3
    assert all(e.event_type == gs.EVENT_TYPE_XID for e in snap.events)


def test_process_table_upserts_and_reports_full(tmp_path: Path) -> None:
    with gs.GpuSimState(tmp_path / "state") as state:
        state.set_process(0, 100, 5 * MIB)
        state.set_process(0, 100, 7 * MIB, sm_util=50)
        state.set_process(1, 100, 1 * MIB)
        snap = state.snapshot(2)
        assert sorted((p.gpu, p.pid, p.used_bytes, p.sm_util) for p in snap.processes) == [
            (0, 100, 7 * MIB, 50),
            (1, 100, 1 * MIB, 0),
        ]
        assert snap.used_bytes(0) == 7 * MIB
        assert state.remove_process(100) == 2
        assert state.remove_process(100) == 0
        for pid in range(1, gs.MAX_PROCS + 1):
            state.set_process(pid % 4, pid, MIB)
        with pytest.raises(gs.StateError, match="process table full"):
            state.set_process(0, 999999, MIB)
        with pytest.raises(gs.StateError, match="invalid pid"):
            state.set_process(0, 0, MIB)
        with pytest.raises(gs.StateError, match=r"0\.\.100 percent"):
            state.set_utilization(0, 101)
        with pytest.raises(gs.StateError, match="out of range"):
            state.queue_xid(gs.MAX_GPUS, 13)


WRITER = r"""
import sys
from simnode.gpusim_state import GpuSimState
with GpuSimState(sys.argv[1]) as state:
    for i in range(int(sys.argv[3])):
        state.queue_xid(int(sys.argv[2]), 10000 * int(sys.argv[2]) + i)
"""


def test_concurrent_writers_never_lose_an_event(tmp_path: Path) -> None:
    path = tmp_path / "state"
    per_writer = 60
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(gpu), str(per_writer)]) for gpu in range(3)]

    def threaded_writer(gpu: int) -> None:
        with gs.GpuSimState(path) as state:
            for i in range(per_writer):
                state.queue_xid(gpu, 10000 * gpu + i)

    with gs.GpuSimState(path) as shared:
        threads = [threading.Thread(target=threaded_writer, args=(gpu,)) for gpu in (3, 4)]
        threads += [  # two threads sharing one handle
            threading.Thread(target=lambda g=gpu: [shared.queue_xid(g, 10000 * g + i) for i in range(per_writer)])
            for gpu in (5, 6)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for p in procs:
        assert p.wait(timeout=60) == 0
    with gs.GpuSimState(path) as state:
        snap = state.snapshot(7)
    writers = 7
    assert snap.event_next_seq == writers * per_writer + 1
    assert [e.seq for e in snap.events] == list(range(1, writers * per_writer + 1))
    for gpu in range(writers):
        assert [e.data for e in snap.events if e.gpu == gpu] == [10000 * gpu + i for i in range(per_writer)]


# ---- the CLI ----------------------------------------------------------------------------------


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_cli_commands_change_the_live_state(sim_node: MakeNode) -> None:
    node = sim_node("h100-nvlink-x8")
    assert "event #1" in ok(node.gpusim("xid", "--gpu", "3", "--xid", "79"))
    ok(node.gpusim("lost", "--gpu", "6"))
    ok(node.gpusim("proc", "--gpu", "2", "--pid", "77", "--used-mib", "2048", "--sm-percent", "25"))
    ok(node.gpusim("util", "--gpu", "2", "--percent", "64", "--memory-percent", "12"))
    with gs.GpuSimState(node.state_path) as state:
        snap = state.snapshot(8)
    assert [(e.seq, e.gpu, e.event_type, e.data) for e in snap.events] == [(1, 3, gs.EVENT_TYPE_XID, 79)]
    assert [g.index for g in snap.gpus if g.lost] == [6] and snap.gpus[6].lost_since_us > 0
    assert [(p.pid, p.gpu, p.used_bytes, p.sm_util) for p in snap.processes] == [(77, 2, 2048 * MIB, 25)]
    assert (snap.gpus[2].util_gpu, snap.gpus[2].util_memory) == (64, 12)
    assert [(s.gpu_percent, s.memory_percent) for s in snap.gpus[2].samples] == [(64, 12)]

    text = ok(node.gpusim("show"))
    assert "GPU 6" in text and "LOST" in text and "pid 77: 2048 MiB" in text
    doc = json.loads(ok(node.gpusim("show", "--json")))
    assert doc["gpus"][6]["lost"] is True and doc["gpus"][2]["used_bytes"] == 2048 * MIB
    assert doc["gpus"][0]["uuid"] == node.spec.gpus[0].uuid

    ok(node.gpusim("restore", "--gpu", "6"))
    ok(node.gpusim("proc-remove", "--pid", "77"))
    with gs.GpuSimState(node.state_path) as state:
        snap = state.snapshot(8)
    assert not any(g.lost for g in snap.gpus) and snap.processes == ()


def test_cli_takes_paths_from_options(sim_node: MakeNode, tmp_path: Path) -> None:
    node = sim_node("t4-x1")
    state = tmp_path / "elsewhere.state"
    env = node.env(GPUSIM_SPEC=None, GPUSIM_STATE=None)
    ok(node.gpusim("--state", str(state), "--spec", str(node.spec_path), "xid", "--gpu", "0", "--xid", "43", env=env))
    with gs.GpuSimState(state) as st:
        assert [e.data for e in st.snapshot(1).events] == [43]


@pytest.mark.parametrize(
    ("args", "env_changes", "message"),
    [
        (["xid", "--gpu", "4", "--xid", "79"], {}, "--gpu 4 out of range"),
        (["lost", "--gpu", "-1"], {}, "--gpu -1 out of range"),
        (["show"], {"GPUSIM_STATE": None}, "no state: pass --state or set GPUSIM_STATE"),
        (["show"], {"GPUSIM_SPEC": None}, "no spec: pass --spec or set GPUSIM_SPEC"),
        (["show"], {"GPUSIM_SPEC": "/nonexistent/spec.json"}, "/nonexistent/spec.json: cannot read the spec file"),
        (["proc-remove", "--pid", "5"], {}, "pid 5 is not in the process table"),
        (["util", "--gpu", "0", "--percent", "150"], {}, "0..100 percent"),
        (["proc", "--gpu", "0", "--pid", "9", "--used-mib", "-1"], {}, "--used-mib must not be negative"),
    ],
)
def test_cli_errors(sim_node: MakeNode, args: list[str], env_changes: dict[str, str | None], message: str) -> None:
    node = sim_node("v100-pcie-x4")
    done = node.gpusim(*args, env=node.env(**env_changes))
    assert done.returncode == 1
    assert done.stderr.startswith("gpusim: ") and message in done.stderr


def test_cli_usage_errors_exit_2(sim_node: MakeNode) -> None:
    node = sim_node("t4-x1")
    assert node.gpusim("xid", "--gpu", "0").returncode == 2  # --xid missing
    assert node.gpusim("explode").returncode == 2


# ---- helpers ----------------------------------------------------------------------------------


def test_sim_env_puts_the_simulated_driver_first(tmp_path: Path) -> None:
    env = gs.sim_env("spec.json", tmp_path / "state", base={"LD_LIBRARY_PATH": "/opt/lib", "KEEP": "1"})
    assert env["LD_LIBRARY_PATH"].split(os.pathsep) == [str(gs.sim_library_dir()), "/opt/lib"]
    assert env["GPUSIM_SPEC"] == str(Path("spec.json").resolve())
    assert env["GPUSIM_STATE"] == str(tmp_path / "state")
    assert env["KEEP"] == "1"


def test_ensure_sim_built_does_not_rebuild_a_fresh_library(gpusim_lib: Path) -> None:
    before = gpusim_lib.stat().st_mtime_ns
    assert gs.ensure_sim_built() == gpusim_lib
    assert gpusim_lib.stat().st_mtime_ns == before
    assert (gpusim_lib.parent / "libnvidia-ml.so").resolve() == gpusim_lib.resolve()
