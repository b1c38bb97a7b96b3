"""Battery: pods a real cluster sends that the agent must answer clearly.

Malformed gpu-admission annotations are refused naming the pod, the annotation and the value
(never an internal error), and leave every other pod alone; init containers that ask for
vcuda-core are admitted (the kubelet allocates them first and may hand their device IDs on to
an app container); pods of several GPU containers get one answer per container.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumanager import names
from gpumanager.vmanager import files
from simnode.cluster import SimCluster, admission_annotations, gpu_pod
from simnode.kubelet import PluginRPCError
from simnode.mounts import host_path
from tests.battery_fixtures import (
    answered,
    assert_no_overcommit,
    memory_of,
    readyz,
    spec_islands,
    spec_odd_mixed,
    spec_one_gpu,
    wait_agent_matches,
)

IDX0 = f"{names.PREDICATE_GPU_IDX_PREFIX}0"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> SimCluster:
    tmp = tmp_path_factory.mktemp("pods")
    c = SimCluster(tmp / "node", spec_odd_mixed(tmp / "spec.json"), fill="random")
    c.start()
    yield c  # type: ignore[misc]
    c.stop()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (IDX0, "\u00b2"),  # a digit to str.isdigit(), not to int()
        (IDX0, "\u0661"),  # ARABIC-INDIC DIGIT ONE
        (IDX0, "-1"),
        (IDX0, "7"),  # no such GPU
        (IDX0, "0,0"),
        (IDX0, ""),
        (IDX0, "0;1"),
        (IDX0, "9" * 40),
    ],
)
def test_malformed_annotation_is_refused_naming_it(cluster: SimCluster, key: str, value: str) -> None:
    name = f"bad-{abs(hash((key, value))) % 10**8}"
    annotations = admission_annotations([[0]], 1)
    annotations[key] = value
    # Cores of its own: a bad pod of an earlier case whose deletion the agent has not seen yet is older
    # and would be matched first.
    cores = 11 + len(cluster.runs)
    try:
        run = cluster.run_pod(gpu_pod(name, [("main", cores, 4)], annotations=annotations))
    except PluginRPCError as exc:
        assert exc.code is not None and exc.code.name != "INTERNAL", exc
        assert f"default/{name}" in exc.details and "predicate-gpu-idx" in exc.details, exc.details
        assert value in exc.details or repr(value) in exc.details, exc.details
    else:
        pytest.fail(f"{key}={value!r} was accepted: {answered(run)}")
    finally:
        cluster.delete(next(r for r in cluster.runs.values() if r.name == name))
    # The agent is unharmed: a good pod still gets its GPU.
    good = cluster.run_pod(gpu_pod(f"good-{name}", [("main", 30, 4)]))
    cluster.delete(good)
    status, body = readyz(cluster)
    assert status == 200, body


def _with_init(
    name: str, init: tuple[int, int], app: list[tuple[str, int, int]], *, sidecar: bool = False
) -> dict[str, object]:
    manifest = gpu_pod(name, app)
    limits = {names.VCORE_RESOURCE: str(init[0])}
    if init[1]:
        limits[names.VMEMORY_RESOURCE] = str(init[1])
    container: dict[str, object] = {
        "name": "warmup",
        "image": "cuda",
        "resources": {"limits": limits, "requests": dict(limits)},
    }
    if sidecar:
        container["restartPolicy"] = "Always"
    manifest["spec"]["initContainers"] = [container]
    return manifest


@pytest.mark.parametrize(
    ("init", "app", "sidecar"),
    [
        ((100, 0), [("app", 100, 0)], False),  # the app container reuses the init container's device IDs
        ((100, 0), [("app", 50, 8)], False),  # ... half of them
        ((30, 4), [("app", 30, 4), ("side", 30, 4)], False),
        ((200, 0), [("plain", 0, 0)], False),  # only the init container asks for GPUs
        ((50, 8), [("app", 50, 8)], True),  # a sidecar runs beside the app container: nothing reused
    ],
)
def test_pod_with_a_gpu_init_container_runs_and_leaves_nothing(
    tmp_path: Path, init: tuple[int, int], app: list[tuple[str, int, int]], sidecar: bool
) -> None:
    """The kubelet allocates init containers first and hands their device IDs on to later containers."""
    spec = spec_islands(tmp_path / "spec.json")
    with SimCluster(tmp_path / "node", spec, fill="random") as cluster:
        run = cluster.run_pod(_with_init("with-init", init, app, sidecar=sidecar))
        got = answered(run)
        assert "warmup" in got and got["warmup"][1] == init[0], got
        other = cluster.run_pod(gpu_pod("other", [("main", 100, 0)]))
        assert_no_overcommit([run, other], memory_of(cluster))
        wait_agent_matches(cluster, [run, other])
        cluster.delete(run)
        wait_agent_matches(cluster, [other])


@pytest.mark.parametrize("memory", [(4, 40), (8, 8)])
def test_a_container_handed_its_init_containers_ids_runs_under_its_own_limits(
    tmp_path: Path, memory: tuple[int, int]
) -> None:
    """Init container and app container ask for as many cores: the kubelet gives the app container the
    init container's very IDs. Each gets its own answer, and each finds its own vcuda.config."""
    spec = spec_islands(tmp_path / "spec.json")
    with SimCluster(tmp_path / "node", spec, fill="random") as cluster:
        run = cluster.admit(_with_init("reuse", (50, memory[0]), [("app", 50, memory[1])]))
        assert set(run.core["app"].device_ids) == set(run.core["warmup"].device_ids)  # the very same IDs
        cluster.start_containers(run)
        for name, blocks in (("warmup", memory[0]), ("app", memory[1])):
            response = run.core[name].response
            config_path = Path(response.envs["VCUDA_CONFIG_PATH"])
            assert config_path == Path("/etc/vcuda") / name / "vcuda.config"
            config = files.unpack(host_path(response.mounts, str(config_path)).read_bytes())
            assert (config.container_name, config.gpu_memory) == (name, blocks * names.MEMORY_BLOCK_BYTES)
        cluster.delete(run)
        wait_agent_matches(cluster, [])


def test_multi_container_pod_gets_one_answer_each(tmp_path: Path) -> None:
    spec = spec_islands(tmp_path / "spec.json")
    with SimCluster(tmp_path / "node", spec, fill="random") as cluster:
        shape = [("a", 50, 8), ("b", 50, 8), ("plain", 0, 0), ("c", 200, 0), ("d", 30, 2)]
        run = cluster.run_pod(gpu_pod("many", shape))
        got = answered(run)
        assert sorted(got) == ["a", "b", "c", "d"]
        assert got["c"][1] == 200 and len(got["c"][0]) == 2
        assert_no_overcommit([run], memory_of(cluster))
        wait_agent_matches(cluster, [run])


@pytest.mark.parametrize("started", [True, False])
def test_device_ids_handed_on_before_the_agent_sees_the_deletion(tmp_path: Path, started: bool) -> None:
    """The kubelet frees a pod's device IDs and gives the very same set to the next pod before the pod's
    deletion reaches the agent (its containers had started, or its admission failed after Allocate)."""
    spec = spec_one_gpu(tmp_path / "spec.json")  # one GPU: the kubelet has no other IDs to give
    with SimCluster(tmp_path / "node", spec, fill="sorted") as cluster:
        first = cluster.admit(gpu_pod("first", [("main", 100, 0)]))
        if started:
            cluster.start_containers(first)
        cluster.kubelet.remove_pod(first.uid)  # the API server still has it, Pending or Running
        second = cluster.admit(gpu_pod("second", [("main", 100, 0)]))
        assert second.core["main"].device_ids == first.core["main"].device_ids  # the very same IDs
        cluster.start_containers(second)
        envs = dict(second.core["main"].response.envs)
        config = host_path(second.core["main"].response.mounts, envs["VCUDA_CONFIG_PATH"])
        assert config.is_file(), config  # the file its answer points at is there
        assert config.read_bytes()[:48].rstrip(b"\0").decode() == second.uid
        cluster.api.delete_pod(first.namespace, first.name)
        assert_no_overcommit([second], memory_of(cluster))
        wait_agent_matches(cluster, [second])
