"""Battery: what the API server and the kubelet do to the agent under pod churn.

The API server hangs, answers 500, answers 410 Gone on the watch, drops connections mid-list;
the kubelet restarts while Allocates are in flight. The agent never exits, never over-commits,
refuses only what it cannot serve (naming the pod or the device IDs and why), and ends with its
allocations equal to the live containers' and /readyz 200.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from kubernetes.client import CoreV1Api

from gpumanager import names
from gpumanager.kube.reflector import Reflector
from simnode.apiserver import ApiServerSimulator
from simnode.cluster import PodRun, SimCluster, gpu_pod
from simnode.kubelet import KubeletSimError, PluginRPCError
from tests.battery_fixtures import assert_no_overcommit, memory_of, readyz, spec_islands, wait_agent_matches


def _try(cluster: SimCluster, name: str, shape: list[tuple[str, int, int]], live: list[PodRun]) -> str:
    """Admit and start a pod; on a refusal the pod goes (as the kubelet fails its admission)."""
    try:
        live.append(cluster.run_pod(gpu_pod(name, shape)))
        return ""
    except (PluginRPCError, KubeletSimError) as exc:
        run = next(r for r in cluster.runs.values() if r.name == name)
        cluster.kubelet.remove_pod(run.uid)
        try:
            cluster.api.delete_pod(run.namespace, run.name)
        except Exception:  # the API server may be the fault under test
            pass
        return exc.details if isinstance(exc, PluginRPCError) else ""  # else: the kubelet had too few IDs


def _finish(cluster: SimCluster, live: list[PodRun]) -> None:
    assert cluster.agent is not None and cluster.agent.proc is not None
    assert cluster.agent.proc.poll() is None, cluster.agent.log_text()[-3000:]
    assert_no_overcommit(live, memory_of(cluster))
    wait_agent_matches(cluster, live, timeout=60)
    deadline = time.monotonic() + 60
    while True:
        status, body = readyz(cluster)
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert status == 200, body


@pytest.fixture
def cluster(tmp_path: Path) -> SimCluster:
    c = SimCluster(tmp_path / "node", spec_islands(tmp_path / "spec.json"), fill="random")
    c.start()
    yield c  # type: ignore[misc]
    c.stop()


def test_api_server_hangs_while_a_new_pod_is_allocated(cluster: SimCluster) -> None:
    live = [cluster.run_pod(gpu_pod("known", [("a", 30, 4), ("b", 30, 4)]))]
    cluster.api.set_down(True, "hang")
    cluster.api.close_watches(abrupt=True)  # the agent's new list and watch hang too
    try:
        # A pod the agent has not seen: refused quickly, saying the API server did not answer.
        pod = cluster.api.create_pod(gpu_pod("unseen", [("main", 70, 4)]))
        cluster.runs[pod["metadata"]["uid"]] = PodRun(pod)
        run = cluster.runs[pod["metadata"]["uid"]]
        with pytest.raises(PluginRPCError) as info:
            cluster.admit(run.manifest, create=False)
        assert "API server" in info.value.details and names.VCORE_ID_PREFIX in info.value.details, info.value
        cluster.kubelet.remove_pod(run.uid)
        # Everything else answers meanwhile: PreStart of the known pod again, metrics, readiness.
        assert cluster.kubelet.pre_start(names.VCORE_RESOURCE, pod_uid=live[0].uid, container_name="a")
        assert readyz(cluster)[0] in (200, 503)
    finally:
        cluster.api.set_down(False)
    cluster.api.delete_pod("default", "unseen")
    live.append(cluster.run_pod(gpu_pod("after-hang", [("main", 70, 4)])))
    _finish(cluster, live)


@pytest.mark.parametrize("fault", ["500-on-list", "410-on-watch", "dropped-mid-list", "refused"])
def test_api_server_faults_under_churn(cluster: SimCluster, fault: str) -> None:
    rng = random.Random(fault)
    live: list[PodRun] = []
    for step in range(24):
        if step == 6:
            if fault == "500-on-list":
                cluster.api.fail_next("GET", r"^/api/v1/pods$", 500, count=20)
                cluster.api.close_watches()
            elif fault == "410-on-watch":
                cluster.api.compact()
                cluster.api.close_watches()
            elif fault == "dropped-mid-list":
                cluster.api.delay(r"^/api/v1/pods$", 0.5, count=3)
                cluster.api.close_watches(abrupt=True)
                threading.Timer(0.2, cluster.api.set_down, args=(True, "refuse")).start()
                threading.Timer(1.5, cluster.api.set_down, args=(False,)).start()
            else:
                cluster.api.set_down(True, "refuse")
                threading.Timer(3.0, cluster.api.set_down, args=(False,)).start()
        if live and rng.random() < 0.35:
            victim = live.pop(rng.randrange(len(live)))
            try:
                cluster.delete(victim)
            except Exception:  # API server down: the pod ends later
                cluster.kubelet.remove_pod(victim.uid)
                time.sleep(3.5)
                cluster.api.delete_pod(victim.namespace, victim.name)
        else:
            shape = [("main", rng.choice((20, 50, 100)), rng.randint(1, 8))]
            try:
                reason = _try(cluster, f"p{step}", shape, live)
            except Exception:  # the pod could not even be created: the API server is down
                time.sleep(0.5)
                continue
            if reason:
                assert "pod" in reason or names.VCORE_ID_PREFIX in reason, reason
        assert_no_overcommit(live, memory_of(cluster), f"step {step}")
    cluster.api.clear_faults()
    _finish(cluster, live)


def test_kubelet_restarts_while_allocates_are_in_flight(cluster: SimCluster) -> None:
    live: list[PodRun] = []
    errors: list[str] = []
    lock = threading.Lock()

    def admit(i: int) -> None:
        mine: list[PodRun] = []
        reason = _try(cluster, f"c{i}", [("main", 25, 2)], mine)
        with lock:
            live.extend(mine)
            if reason:
                errors.append(reason)

    threads = [threading.Thread(target=admit, args=(i,)) for i in range(12)]
    for i, t in enumerate(threads):
        t.start()
        if i in (3, 8):
            cluster.kubelet.restart()
    for t in threads:
        t.join(120)
    for resource in (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE):
        cluster.kubelet.wait_for_registration(resource, timeout=30, with_devices=True)
        cluster.kubelet.wait_for_devices(resource, lambda d: bool(d) and all(x.healthy for x in d.values()), timeout=30)
    for i in range(3):
        live.append(cluster.run_pod(gpu_pod(f"after-{i}", [("main", 25, 2)])))
    _finish(cluster, live)


def test_pods_end_while_the_agent_is_down_and_it_starts_without_an_api_server(cluster: SimCluster) -> None:
    assert cluster.agent is not None
    live = [cluster.run_pod(gpu_pod(f"p{i}", [("main", 50, 8)])) for i in range(6)]
    cluster.agent.signal(signal.SIGKILL)
    cluster.agent.wait()
    for run in live[:3]:
        cluster.delete(run)
    del live[:3]
    cluster.api.set_down(True, "refuse")
    try:
        cluster.start_agent()
        status, body = readyz(cluster)
        assert status == 503 and "pod_cache" in body["missing"], body
        # What the agent cannot see it keeps: the ended pods' GPUs are not handed out yet.
        cluster.kubelet.pre_start(names.VCORE_RESOURCE, pod_uid=live[0].uid, container_name="main")
    finally:
        cluster.api.set_down(False)
    live.append(cluster.run_pod(gpu_pod("after", [("main", 100, 0)])))
    _finish(cluster, live)


def test_device_plugin_directory_removed_and_recreated(cluster: SimCluster) -> None:
    """The kubelet is reinstalled: its whole device-plugin directory goes, then comes back."""
    assert cluster.agent is not None
    live = [cluster.run_pod(gpu_pod("before", [("main", 50, 8)]))]
    before = cluster.kubelet.registration_count(names.VCORE_RESOURCE)
    cluster.kubelet.stop()
    for _ in range(3):  # the agent may put its sockets back meanwhile
        shutil.rmtree(cluster.kubelet.plugin_dir, ignore_errors=True)
    time.sleep(2)
    cluster.kubelet.start()
    for resource in (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE):
        cluster.kubelet.wait_for_registration(
            resource, after=before if resource == names.VCORE_RESOURCE else None, timeout=60, with_devices=True
        )
    cluster.kubelet.wait_for_devices(names.VCORE_RESOURCE, 700, timeout=30)
    live.append(cluster.run_pod(gpu_pod("after", [("main", 50, 8)])))
    _finish(cluster, live)


@pytest.mark.parametrize("state", ["hang", "refuse", "503"])
def test_sigterm_while_the_api_server_is_down_stops_cleanly(cluster: SimCluster, state: str) -> None:
    assert cluster.agent is not None
    cluster.run_pod(gpu_pod("running", [("main", 50, 8)]))
    cluster.api.set_down(True, state)  # type: ignore[arg-type]
    try:
        cluster.api.close_watches(abrupt=True)
        pod = cluster.api.create_pod(gpu_pod("unseen", [("main", 70, 4)]))
        cluster.runs[pod["metadata"]["uid"]] = PodRun(pod)
        run = cluster.runs[pod["metadata"]["uid"]]

        def admit() -> None:  # an Allocate waiting on the API server when the signal comes
            with contextlib.suppress(KubeletSimError):
                cluster.admit(run.manifest, create=False)

        stuck = threading.Thread(target=admit, daemon=True)
        stuck.start()
        time.sleep(0.5)
        cluster.agent.signal(signal.SIGTERM)
        assert cluster.agent.wait(timeout=10) == 0  # the kubelet waits 30 s, then kills
    finally:
        cluster.api.set_down(False)
    leftover = [p.name for p in cluster.kubelet.plugin_dir.glob("v*.sock")]
    assert leftover == [], leftover


def test_watches_ended_at_once_are_retried_with_backoff(cluster: SimCluster) -> None:
    """An API server (or a proxy in front of it) that ends every watch at once: no hot loop of watches."""
    stop = threading.Event()

    def end_watches() -> None:
        while not stop.is_set():
            cluster.api.close_watches()
            time.sleep(0.005)

    closer = threading.Thread(target=end_watches, daemon=True)
    closer.start()
    try:
        cluster.api.clear_requests()
        time.sleep(3.0)
        watches = [r for r in cluster.api.requests if "watch" in str(r.query)]
    finally:
        stop.set()
        closer.join()
    # client-go takes a watch that ends within a second with no event for an error and backs off
    # (0.8 s, doubling): a handful of watches in 3 s, not hundreds.
    assert len(watches) <= 10, len(watches)
    live = [cluster.run_pod(gpu_pod("after", [("main", 50, 8)]))]
    _finish(cluster, live)


def test_extender_reflector_backs_off_from_watches_ended_at_once() -> None:
    """The scheduler extender's list+watch: the same API server ending every watch at once."""
    with ApiServerSimulator() as api:
        core = CoreV1Api(api.client())
        reflector = Reflector("pods", core.list_pod_for_all_namespaces, watch_timeout=60)
        reflector.start()
        stop = threading.Event()

        def end_watches() -> None:
            while not stop.is_set():
                api.close_watches()
                time.sleep(0.005)

        closer = threading.Thread(target=end_watches, daemon=True)
        try:
            assert reflector.wait_synced(10)
            closer.start()
            api.clear_requests()
            time.sleep(3.0)
            watches = [r for r in api.requests if "watch" in str(r.query)]
        finally:
            stop.set()
            reflector.stop()
        assert len(watches) <= 10, len(watches)
