"""The device plugin as the kubelet drives it: GetPreferredAllocation with awkward requests, placement of
whole GPUs and shares, GPU health in ListAndWatch, streams and kubelet restarts, on the simulated node."""

from __future__ import annotations

import json
import os
import random
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gpumanager import names
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from simnode.cluster import SimCluster, gpu_pod
from simnode.gpusim_state import GpuSimState
from simnode.kubelet import KubeletSimError

CORE = names.VCORE_RESOURCE
MEM = names.VMEMORY_RESOURCE
CORE_ID = names.VCORE_ID_PREFIX
GiB = 1 << 30


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="dp-r11-") as d:
        yield Path(d)


def _stub(cluster: SimCluster, sock: str) -> tuple[grpc.Channel, pb_grpc.DevicePluginStub]:
    channel = grpc.insecure_channel(f"unix://{cluster.kubelet.plugin_dir / sock}")
    return channel, pb_grpc.DevicePluginStub(channel)


def _prefer(stub: pb_grpc.DevicePluginStub, available: list[str], must: list[str], size: int) -> list[str]:
    answer = stub.GetPreferredAllocation(
        pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
                )
            ]
        ),
        timeout=10,
    )
    return list(answer.container_responses[0].deviceIDs)


def _core_ids(gpu: int) -> list[str]:
    return [f"{CORE_ID}{gpu * 100 + n}" for n in range(100)]


def _gpus_of(run_record: object) -> list[int]:
    value = run_record.response.annotations[names.VDEVICE_ANNOTATION]  # type: ignore[attr-defined]
    return sorted(int(p.rsplit("nvidia", 1)[1]) for p in value.split(","))


def _check_answer(answer: list[str], available: list[str], must: list[str], size: int) -> None:
    assert len(answer) == len(set(answer)), f"duplicate IDs in {answer}"
    assert len(answer) <= max(size, 0)
    for device_id in must[:size]:
        assert device_id in answer
    for device_id in answer:
        assert device_id in available or device_id in must, device_id


def test_preferred_allocation_awkward_requests(workdir: Path) -> None:
    with SimCluster(workdir, "h100-nvlink-x8") as cluster:
        channel, stub = _stub(cluster, "vcore.sock")
        try:
            everything = [i for g in range(8) for i in _core_ids(g)]
            cases: list[tuple[list[str], list[str], int]] = [
                # must_include on two different GPUs, a whole GPU and a half asked
                (everything, [f"{CORE_ID}5", f"{CORE_ID}520"], 150),
                # fewer IDs offered than asked
                (_core_ids(3)[:50], [], 300),
                # nothing asked
                (everything, [], 0),
                (everything, [f"{CORE_ID}7"], 0),
                # more asked than the node has
                (everything, [], 100_000),
                # unknown IDs, offered and must-include
                ([f"{CORE_ID}99999", "bogus", "", *_core_ids(1)], [f"{CORE_ID}99999"], 100),
                (["tencent.com/vcuda-memory-268435456-3", *_core_ids(2)], [], 100),
                # duplicates offered
                ([*_core_ids(4)[:30], *_core_ids(4)[:30], f"{CORE_ID}0x"], [], 40),
                ([*_core_ids(4)[:30], *_core_ids(4)[:30]], [], 40),
                # must-include more than asked
                (everything, _core_ids(6)[:20], 10),
                # negative-looking and padded numbers
                ([f"{CORE_ID}-1", f"{CORE_ID}007", *_core_ids(0)[:10]], [], 5),
            ]
            for available, must, size in cases:
                answer = _prefer(stub, available, must, size)
                _check_answer(answer, available, must, size)
            # A whole GPU asked when every ID is offered: all of one GPU's.
            answer = _prefer(stub, everything, [], 200)
            gpus = {int(i[len(CORE_ID) :]) // 100 for i in answer}
            assert len(answer) == 200 and len(gpus) == 2
        finally:
            channel.close()
        channel, stub = _stub(cluster, "vmemory.sock")
        try:
            mem_ids = sorted(cluster.kubelet.devices(MEM))
            for available, must, size in [
                (mem_ids, [], 0),
                (mem_ids[:5], [], 50),
                ([*mem_ids[:5], *mem_ids[:5]], [], 8),
                ([*mem_ids[:5], "x", f"{names.VMEMORY_ID_PREFIX}999999"], [mem_ids[-1]], 4),
            ]:
                answer = _prefer(stub, available, must, size)
                _check_answer(answer, available, must, size)
        finally:
            channel.close()


@pytest.mark.parametrize("spec,domains", [("h100-nvlink-x8", 1), ("h200-x16", 2)])
def test_whole_gpus_land_on_close_sets(workdir: Path, spec: str, domains: int) -> None:
    with SimCluster(workdir, spec) as cluster:
        n = 8 * domains
        placed: list[list[int]] = []
        for i, count in enumerate([2, 2, 4] * domains):
            run = cluster.admit(gpu_pod(f"w{i}", [("main", 100 * count, 0)]))
            placed.append(_gpus_of(run.core["main"]))
        used = [g for p in placed for g in p]
        assert len(used) == len(set(used)) == n, placed
        for gpus in placed:
            numa = {g // 4 for g in gpus}  # four GPUs per NUMA node (PIX pairs inside)
            assert len(numa) == 1, (placed, gpus)
            if len(gpus) == 2:
                assert gpus[0] % 2 == 0 and gpus[1] == gpus[0] + 1, (placed, gpus)
        if domains == 2:
            for run in list(cluster.runs.values()):
                cluster.delete(run, wait=True)
            for i in range(2):
                run = cluster.admit(gpu_pod(f"e{i}", [("main", 800, 0)]))
                assert _gpus_of(run.core["main"]) in (list(range(8)), list(range(8, 16)))


def test_shares_never_overfill_a_gpu(workdir: Path) -> None:
    rng = random.Random(11)
    with SimCluster(workdir, "v100-pcie-x4", status_lag=0.05) as cluster:
        spec = json.loads(cluster.spec.read_text())
        gpu_memory = {g: int(gpu["memory_mib"]) << 20 for g, gpu in enumerate(spec["gpus"])}
        live: dict[str, tuple[list[int], int, int]] = {}
        runs = {}
        for step in range(150):
            if live and rng.random() < 0.4:
                uid = rng.choice(sorted(live))
                cluster.delete(runs.pop(uid), wait=True)
                del live[uid]
                continue
            cores = rng.choice([10, 25, 30, 50, 70, 100, 200])
            blocks = 0 if cores >= 100 else rng.choice([1, 4, 8, 16, 24, 40])
            try:
                run = cluster.admit(gpu_pod(f"s{step}", [("main", cores, blocks)]))
            except Exception:
                continue
            record = run.core["main"]
            live[run.uid] = (_gpus_of(record), cores, blocks * names.MEMORY_BLOCK_BYTES)
            runs[run.uid] = run
            used_cores = {g: 0 for g in range(4)}
            used_mem = {g: 0 for g in range(4)}
            for gpus, c, m in live.values():
                for g in gpus:
                    used_cores[g] += min(c, 100)
                    used_mem[g] += m if c < 100 else gpu_memory[g]
            assert all(v <= 100 for v in used_cores.values()), (step, used_cores, live)
            assert all(used_mem[g] <= gpu_memory[g] for g in range(4)), (step, used_mem, live)


def _only_unhealthy(cluster: SimCluster, gpu: int | None, count: int) -> None:
    layout_core = {f"{CORE_ID}{n}" for n in range(gpu * 100, gpu * 100 + 100)} if gpu is not None else set()

    def core_ok(devs: dict) -> bool:  # type: ignore[type-arg]
        return len(devs) == count * 100 and {i for i, d in devs.items() if not d.healthy} == layout_core

    cluster.kubelet.wait_for_devices(CORE, core_ok, timeout=15)
    mem = cluster.kubelet.devices(MEM)
    per_gpu = len(mem) // count

    def mem_ok(devs: dict) -> bool:  # type: ignore[type-arg]
        bad = {int(i.rsplit("-", 1)[1]) // per_gpu for i, d in devs.items() if not d.healthy}
        nbad = sum(1 for d in devs.values() if not d.healthy)
        return (bad == ({gpu} if gpu is not None else set())) and nbad == (per_gpu if gpu is not None else 0)

    cluster.kubelet.wait_for_devices(MEM, mem_ok, timeout=15)


def test_every_critical_xid_marks_one_gpu_and_recovery_brings_it_back(workdir: Path) -> None:
    flags = ["--health-quiet-period=1s", "--health-probe-period=100ms"]
    with SimCluster(workdir, "v100-pcie-x4", agent_flags=flags) as cluster:
        assert cluster.agent is not None
        with GpuSimState(cluster.agent.state) as state:
            for xid in (48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140):
                state.queue_xid(2, xid)
                _only_unhealthy(cluster, 2, 4)
                _only_unhealthy(cluster, None, 4)
            # ignored ones never do
            for xid in names.DEFAULT_IGNORED_XIDS:
                state.queue_xid(1, xid)
            time.sleep(1.0)
            assert all(d.healthy for d in cluster.kubelet.devices(CORE).values())
            # a GPU falling off the bus mid-run, and coming back
            state.set_lost(3)
            _only_unhealthy(cluster, 3, 4)
            state.set_lost(3, False)
            _only_unhealthy(cluster, None, 4)


def _threads_and_fds(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def test_kubelet_restarts_fifty_times_without_leaks(workdir: Path) -> None:
    with SimCluster(workdir, "t4-x1") as cluster:
        assert cluster.agent is not None
        pid = cluster.agent.pid
        counts = []
        for cycle in range(50):
            since = time.monotonic()
            cluster.kubelet.restart()
            for resource in (CORE, MEM):
                cluster.kubelet.wait_for_registration(resource, since=since, timeout=15, with_devices=True)
            if cycle in (9, 49):
                time.sleep(0.5)
                counts.append(_threads_and_fds(pid))
        assert cluster.kubelet.registration_count(CORE) >= 51
        (t10, f10), (t50, f50) = counts
        assert t50 <= t10 + 2 and f50 <= f10 + 4, counts
        run = cluster.admit(gpu_pod("after", [("main", 50, 4)]))
        assert run.core["main"].response.annotations[names.VCORE_RESOURCE] == "50"


def test_two_listandwatch_streams_and_a_cancelled_one(workdir: Path) -> None:
    flags = ["--health-quiet-period=1s", "--health-probe-period=100ms"]
    with SimCluster(workdir, "v100-pcie-x4", agent_flags=flags) as cluster:
        assert cluster.agent is not None
        channel, stub = _stub(cluster, "vcore.sock")
        try:
            a = stub.ListAndWatch(pb.Empty())
            b = stub.ListAndWatch(pb.Empty())
            assert len(next(a).devices) == 400
            assert len(next(b).devices) == 400
            a.cancel()
            with GpuSimState(cluster.agent.state) as state:
                state.queue_xid(0, 79)
                msg = next(b)
                assert sum(1 for d in msg.devices if d.health == names.UNHEALTHY) == 100
                c = stub.ListAndWatch(pb.Empty())
                first = next(c)
                assert sum(1 for d in first.devices if d.health == names.UNHEALTHY) == 100
                msg = next(b)  # recovery
                assert all(d.health == names.HEALTHY for d in msg.devices)
                c.cancel()
            b.cancel()
        finally:
            channel.close()
        # the kubelet's own stream still works
        run = cluster.admit(gpu_pod("after", [("main", 100, 0)]))
        assert run.core["main"].response.annotations[names.VCORE_RESOURCE] == "100"


def test_h200_lists_fit_the_default_message_limit(workdir: Path) -> None:
    with SimCluster(workdir, "h200-x16") as cluster:
        channel, stub = _stub(cluster, "vmemory.sock")
        try:
            stream = stub.ListAndWatch(pb.Empty())
            msg = next(stream)
            assert len(msg.devices) == len(cluster.kubelet.devices(MEM)) >= 16 * 500
            assert msg.ByteSize() < 4 * 1024 * 1024
            stream.cancel()
        finally:
            channel.close()


class _RefusingKubelet(pb_grpc.RegistrationServicer):  # type: ignore[misc]
    """A kubelet that refuses the first ``refusals`` Register calls as the real one refuses a taken name."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.calls: list[str] = []

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.calls.append(request.resource_name)
        if len(self.calls) <= self.refusals:
            context.abort(
                grpc.StatusCode.UNKNOWN,
                f'the ResourceName "{request.resource_name}" is already taken by another active device plugin',
            )
        return pb.Empty()


def test_a_kubelet_that_refuses_registration_is_named_and_retried(workdir: Path) -> None:
    from concurrent import futures

    cluster = SimCluster(workdir, "t4-x1")
    cluster.start(agent=False)
    try:
        cluster.kubelet.stop()
        refusing = _RefusingKubelet(refusals=6)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_RegistrationServicer_to_server(refusing, server)
        server.add_insecure_port(f"unix://{cluster.kubelet.socket_path}")
        server.start()
        try:
            agent = cluster.start_agent(wait=False)
            deadline = time.monotonic() + 30
            while len(refusing.calls) < 8 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(refusing.calls) >= 8, refusing.calls  # retried after the refusals, in process
            assert agent.proc is not None and agent.proc.poll() is None
            log = agent.wait_for_log("registered with the kubelet after", timeout=30)
            refused = [line for line in log.splitlines() if "refused registration" in line]
            assert refused, log[-3000:]
            assert "already taken" in refused[0] and "tencent.com/vcuda-" in refused[0], refused[0]
            # one line for the repeated refusal, not one per try
            assert len([ln for ln in refused if "not registered with the kubelet" in ln]) <= 2, refused
            assert "Traceback" not in log
        finally:
            server.stop(None)
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    "spec,cores,memory_blocks",
    [("h100-nvlink-x8", 100, 0), ("h100-nvlink-x8", 200, 0), ("h100-nvlink-x8", 30, 8), ("l40s-domains-x4", 50, 8)],
)
def test_allocate_keeps_the_numa_node_the_topology_manager_chose(
    workdir: Path, spec: str, cores: int, memory_blocks: int
) -> None:
    """With the kubelet's Topology Manager, the IDs offered and given are those of the NUMA node it chose (and
    the CPUs it pins are there): the GPUs the agent answers with must be on that node when it has room."""
    with SimCluster(workdir, spec) as cluster:
        gpus_spec = json.loads(cluster.spec.read_text())["gpus"]
        index_of = {int(gpu["minor"]): g for g, gpu in enumerate(gpus_spec)}
        for numa in (1, 0):
            gpus = {g for g, gpu in enumerate(gpus_spec) if gpu["numa_node"] == numa}
            pod = cluster.create(gpu_pod(f"numa{numa}", [("main", cores, memory_blocks)]))
            uid, name = pod["metadata"]["uid"], pod["metadata"]["name"]
            record = cluster.kubelet.allocate(
                CORE, cores, pod_uid=uid, container_name="main", numa_hint={numa}, pod_name=name, namespace="default"
            )
            id_gpus = {int(i[len(CORE_ID) :]) // 100 for i in record.device_ids}
            assert id_gpus <= gpus, record.device_ids  # the kubelet kept to the node
            placed = {index_of[m] for m in _gpus_of(record)}
            assert placed <= gpus, (numa, placed)


def test_plugin_directory_removed_with_the_kubelet_and_made_again(workdir: Path) -> None:
    import shutil

    with SimCluster(workdir, "t4-x1", agent_flags=["--kubelet-watch-period=30s"]) as cluster:
        for _ in range(3):
            cluster.kubelet.stop()
            # The agent may make its socket (and the directory) again while the tree is being removed, as it
            # would under an operator's rm -rf, so the removal is retried until the directory is gone.
            gone = False
            for _attempt in range(50):
                shutil.rmtree(cluster.kubelet.plugin_dir, ignore_errors=True)
                gone = not cluster.kubelet.plugin_dir.exists()
                if gone:
                    break
                time.sleep(0.02)
            assert gone
            time.sleep(0.3)
            since = cluster.kubelet.start()
            for resource in (CORE, MEM):
                record = cluster.kubelet.wait_for_registration(resource, since=since, timeout=5, with_devices=True)
                assert record is not None
        run = cluster.admit(gpu_pod("after", [("main", 50, 4)]))
        assert run.core["main"].response.annotations[CORE] == "50"


def test_a_gpu_lost_before_the_start_is_listed_unhealthy_and_comes_back(workdir: Path) -> None:
    flags = ["--health-quiet-period=1s", "--health-probe-period=100ms"]
    cluster = SimCluster(workdir, "v100-pcie-x4", agent_flags=flags)
    cluster.start(agent=False)
    try:
        state_path = workdir / "gpusim.state"
        with GpuSimState(state_path) as state:
            state.set_lost(1)
            cluster.start_agent()
            assert cluster.agent is not None and cluster.agent.state == state_path
            _only_unhealthy(cluster, 1, 4)
            state.set_lost(1, False)
            _only_unhealthy(cluster, None, 4)
            run = cluster.admit(gpu_pod("after", [("main", 400, 0)]))
            assert _gpus_of(run.core["main"]) == [0, 1, 2, 3]
    finally:
        cluster.stop()


def test_directory_watch_follows_a_directory_made_again_while_the_old_one_is_held_open(workdir: Path) -> None:
    """The agent holds its device-plugin directory open (its lock): removed, that directory lives on
    without an entry (no DELETE_SELF comes), and a watch left on it never sees the new one's files."""
    import shutil
    import threading

    from gpumanager.deviceplugin.dirwatch import DirectoryWatch

    directory = workdir / "device-plugins"
    directory.mkdir()
    held = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    watch = DirectoryWatch(directory)
    try:
        (directory / "vcore.sock").write_text("")
        assert watch.wait(2)
        shutil.rmtree(directory)
        assert watch.wait(2)  # the entry's removal is seen
        directory.mkdir()
        watch.wait(0.05)
        timer = threading.Timer(0.2, (directory / "kubelet.sock").write_text, ("",))
        timer.start()
        started = time.monotonic()
        assert watch.wait(10)
        assert time.monotonic() - started < 5
        timer.join()
    finally:
        watch.close()
        os.close(held)


def test_topology_manager_hints_never_overfill_a_gpu(workdir: Path) -> None:
    """Random admissions (whole GPUs and shares, each with a random NUMA hint or none) and deletions: no GPU
    ever holds more than 100 cores or its memory in the answers given."""
    rng = random.Random(7)
    with SimCluster(workdir, "h100-nvlink-x8", status_lag=0.05) as cluster:
        spec = json.loads(cluster.spec.read_text())
        memory = {g: int(gpu["memory_mib"]) << 20 for g, gpu in enumerate(spec["gpus"])}
        live: dict[str, tuple[list[int], int, int]] = {}
        for step in range(120):
            if live and rng.random() < 0.35:
                uid = rng.choice(sorted(live))
                cluster.delete(cluster.runs[uid], wait=True)
                del live[uid]
                continue
            cores = rng.choice([10, 20, 50, 70, 100, 200, 400])
            blocks = 0 if cores >= 100 else rng.choice([1, 8, 40, 100])
            hint = rng.choice([{0}, {1}, None])
            pod = cluster.create(gpu_pod(f"h{step}", [("main", cores, blocks)]))
            uid, name = pod["metadata"]["uid"], pod["metadata"]["name"]
            try:
                record = cluster.kubelet.allocate(
                    CORE,
                    cores,
                    pod_uid=uid,
                    container_name="main",
                    numa_hint=hint,
                    pod_name=name,
                    namespace="default",
                    write=not blocks,
                )
                if blocks:
                    cluster.kubelet.allocate(
                        MEM,
                        blocks,
                        pod_uid=uid,
                        container_name="main",
                        numa_hint=hint,
                        pod_name=name,
                        namespace="default",
                    )
            except Exception:
                cluster.kubelet.remove_pod(uid)
                continue
            gpus = _gpus_of(record)
            live[uid] = (gpus, cores, blocks * names.MEMORY_BLOCK_BYTES)
            used_cores = dict.fromkeys(range(8), 0)
            used_mem = dict.fromkeys(range(8), 0)
            for held, c, m in live.values():
                for g in held:
                    used_cores[g] += min(c, 100)
                    used_mem[g] += m if c < 100 else memory[g]
            assert all(v <= 100 for v in used_cores.values()), (step, used_cores)
            assert all(used_mem[g] <= memory[g] for g in range(8)), (step, used_mem)


def test_preferred_allocation_steers_away_from_an_unhealthy_gpu(workdir: Path) -> None:
    flags = ["--health-quiet-period=60s", "--health-probe-period=100ms"]
    with SimCluster(workdir, "v100-pcie-x4", agent_flags=flags) as cluster:
        assert cluster.agent is not None
        with GpuSimState(cluster.agent.state) as state:
            state.queue_xid(2, 79)
            _only_unhealthy(cluster, 2, 4)
        channel, stub = _stub(cluster, "vcore.sock")
        try:
            # the kubelet's list may be older than the health change
            offered = [*_core_ids(2), *_core_ids(3)]
            for size in (100, 30, 99):
                answer = _prefer(stub, offered, [], size)
                assert answer and {int(i[len(CORE_ID) :]) // 100 for i in answer} == {3}, (size, answer[:3])
            answer = _prefer(stub, [*_core_ids(2), *_core_ids(0), *_core_ids(1)], [], 200)
            assert {int(i[len(CORE_ID) :]) // 100 for i in answer} == {0, 1}
        finally:
            channel.close()


def test_preferred_allocation_of_a_negative_size_is_empty() -> None:
    """allocation_size is an int32: a negative one is answered with nothing, not with the must-include IDs
    less as many as it says (a slice from the end)."""
    from gpumanager.deviceplugin.devices import DeviceLayout
    from gpumanager.deviceplugin.preferred import Preference
    from gpumanager.topology.synthetic import levels_from_groups, make_gpus, tree_from_levels

    tree = tree_from_levels(levels_from_groups(4, {20: [[0, 1], [2, 3]]}))
    preference = Preference(tree.clone, DeviceLayout(make_gpus(4)))
    everything = [f"{CORE_ID}{n}" for n in range(400)]
    for size in (-5, -1, 0):
        assert preference.choose(CORE, everything, everything[:10], size) == []
        assert preference.choose(CORE, everything, [], size) == []


def test_an_xid_storm_sends_one_change_and_an_agent_restart_keeps_the_gpu_out(workdir: Path) -> None:
    flags = ["--health-quiet-period=4s", "--health-probe-period=100ms"]
    with SimCluster(workdir, "v100-pcie-x4", agent_flags=flags) as cluster:
        assert cluster.agent is not None
        before = len(cluster.kubelet.updates(CORE))
        with GpuSimState(cluster.agent.state) as state:
            for _ in range(2000):
                state.queue_xid(1, 48)
            _only_unhealthy(cluster, 1, 4)
            time.sleep(0.5)
            # one list with GPU 1 out (the stream may also have been in the middle of nothing else)
            assert len(cluster.kubelet.updates(CORE)) - before <= 2
            cluster.agent.stop()
            cluster.start_agent()
            first = cluster.kubelet.updates(CORE)[-1].devices
            # still out after the restart, within its quiet period
            bad = {i for i, d in cluster.kubelet.devices(CORE).items() if not d.healthy}
            assert bad == set(_core_ids(1)) or any(not d.healthy for d in first.values())
            _only_unhealthy(cluster, None, 4)


def test_our_sockets_removed_under_a_live_kubelet_many_times(workdir: Path) -> None:
    """Not a kubelet restart: someone removes our sockets while the kubelet runs on. Each time the agent serves
    again and registers again, and the kubelet keeps the resources usable (a stream of the old endpoint
    ending after the new registration would mark every device unhealthy and stop the new endpoint)."""
    with SimCluster(workdir, "v100-pcie-x4") as cluster:
        for cycle in range(12):
            since = time.monotonic()
            victims = ["vcore.sock", "vmemory.sock"] if cycle % 3 else ["vcore.sock"]
            for name in victims:
                (cluster.kubelet.plugin_dir / name).unlink()
            for resource in (CORE, MEM) if cycle % 3 else (CORE,):
                cluster.kubelet.wait_for_registration(resource, since=since, timeout=10, with_devices=True)
            time.sleep(0.3)
            cluster.kubelet.wait_for_devices(CORE, 400, timeout=10)
            cluster.kubelet.wait_for_devices(MEM, len(cluster.kubelet.devices(MEM)), timeout=10)
            run = cluster.admit(gpu_pod(f"c{cycle}", [("main", 10, 1)]))
            assert run.core["main"].response.annotations[CORE] == "10"
            cluster.delete(run, wait=True)


def test_two_container_pods_with_numa_hints_never_overfill_a_gpu(workdir: Path) -> None:
    rng = random.Random(3)
    with SimCluster(workdir, "l40s-domains-x4", status_lag=0.05) as cluster:
        spec = json.loads(cluster.spec.read_text())
        memory = {g: int(gpu["memory_mib"]) << 20 for g, gpu in enumerate(spec["gpus"])}
        index_of = {int(gpu["minor"]): g for g, gpu in enumerate(spec["gpus"])}
        hint: dict[str, set[int] | None] = {"now": None}
        allocate = cluster.kubelet.allocate

        def with_hint(*args, **kwargs):  # type: ignore[no-untyped-def]
            return allocate(*args, numa_hint=hint["now"], **kwargs)

        cluster.kubelet.allocate = with_hint  # type: ignore[method-assign]
        live: dict[str, list[tuple[list[int], int, int]]] = {}
        for step in range(100):
            if live and rng.random() < 0.35:
                uid = rng.choice(sorted(live))
                cluster.delete(cluster.runs[uid], wait=True)
                del live[uid]
                continue
            hint["now"] = rng.choice([{0}, {1}, None])
            containers = []
            for c in range(rng.choice([1, 2])):
                cores = rng.choice([10, 30, 60, 100, 200])
                containers.append((f"c{c}", cores, 0 if cores >= 100 else rng.choice([1, 16, 60])))
            try:
                run = cluster.admit(gpu_pod(f"m{step}", containers))
            except Exception:
                continue
            held = []
            for cname, cores, blocks in containers:
                gpus = [index_of[m] for m in _gpus_of(run.core[cname])]
                held.append((gpus, cores, blocks * names.MEMORY_BLOCK_BYTES))
            live[run.uid] = held
            used_cores = dict.fromkeys(memory, 0)
            used_mem = dict.fromkeys(memory, 0)
            for pod in live.values():
                for gpus, c, m in pod:
                    for g in gpus:
                        used_cores[g] += min(c, 100)
                        used_mem[g] += m if c < 100 else memory[g]
            assert all(v <= 100 for v in used_cores.values()), (step, used_cores, live)
            assert all(used_mem[g] <= memory[g] for g in memory), (step, used_mem)


def test_allocate_and_prestart_name_an_unknown_id(workdir: Path) -> None:
    with SimCluster(workdir, "t4-x1") as cluster:
        for sock, prefix in (("vcore.sock", CORE_ID), ("vmemory.sock", names.VMEMORY_ID_PREFIX)):
            channel, stub = _stub(cluster, sock)
            try:
                for bad in (f"{prefix}999999", "x" * 100_000, f"{prefix}1\n2", ""):
                    ids = [f"{prefix}0", bad]
                    for call, request in (
                        (
                            stub.Allocate,
                            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]),
                        ),
                        (stub.PreStartContainer, pb.PreStartContainerRequest(devices_ids=ids)),
                    ):
                        if call == stub.PreStartContainer and sock == "vmemory.sock" and bad.endswith("999999"):
                            call(request, timeout=10)  # accepted by design: a GPU that shrank since
                            continue
                        with pytest.raises(grpc.RpcError) as caught:
                            call(request, timeout=10)
                        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
                        details = caught.value.details() or ""
                        assert len(details) < 2000, len(details)
                        assert bad[:20].replace("\n", "\\n") in details or repr(bad[:20])[1:-1] in details, details
            finally:
                channel.close()
        assert "Traceback" not in (cluster.agent.log_text() if cluster.agent else "")


def test_a_gpu_lost_and_back_under_a_running_pod_keeps_its_room_taken(workdir: Path) -> None:
    from simnode.cluster import admission_annotations

    flags = ["--health-quiet-period=1s", "--health-probe-period=100ms"]
    with SimCluster(workdir, "v100-pcie-x4", agent_flags=flags, status_lag=0.05) as cluster:
        assert cluster.agent is not None
        annotations = admission_annotations([[1]], time.time_ns())
        held = cluster.admit(gpu_pod("held", [("main", 100, 0)], annotations=annotations))
        cluster.start_containers(held)
        assert _gpus_of(held.core["main"]) == [1]
        with GpuSimState(cluster.agent.state) as state:
            state.set_lost(1)
            _only_unhealthy(cluster, 1, 4)
            state.set_lost(1, False)
            _only_unhealthy(cluster, None, 4)
        run = cluster.admit(gpu_pod("rest", [("main", 300, 0)]))
        assert _gpus_of(run.core["main"]) == [0, 2, 3]
        with pytest.raises(KubeletSimError):
            cluster.admit(gpu_pod("more", [("main", 10, 1)]))


class _HangingKubelet(pb_grpc.RegistrationServicer):  # type: ignore[misc]
    """A kubelet that takes every Register and never answers it (busy, or stuck in its shutdown)."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.calls += 1
        self.release.wait(60)
        context.abort(grpc.StatusCode.UNAVAILABLE, "shutting down")


def test_a_hung_kubelet_replaced_by_a_new_one_is_registered_with_at_once(workdir: Path) -> None:
    from concurrent import futures

    cluster = SimCluster(workdir, "t4-x1")
    cluster.start(agent=False)
    try:
        cluster.kubelet.stop()
        hanging = _HangingKubelet()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_RegistrationServicer_to_server(hanging, server)
        server.add_insecure_port(f"unix://{cluster.kubelet.socket_path}")
        server.start()
        agent = cluster.start_agent(wait=False)
        deadline = time.monotonic() + 20
        while hanging.calls < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hanging.calls >= 1
        time.sleep(0.5)
        # the hung kubelet dies (its connections closed) and a new one starts
        hanging.release.set()
        server.stop(None)
        since = cluster.kubelet.start()
        for resource in (CORE, MEM):
            cluster.kubelet.wait_for_registration(resource, since=since, timeout=5, with_devices=True)
        assert agent.proc is not None and agent.proc.poll() is None
    finally:
        cluster.stop()
