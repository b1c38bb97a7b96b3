"""A container naming its sibling's vcuda.config: each container of a pod mounts the pod's directory at
/etc/vcuda (its vcuda.sock), and that directory held every container's directory with its config.  A
tenant process of container A set VCUDA_CONFIG_PATH=/etc/vcuda/B/vcuda.config and ran under B's (bigger)
limit: directories named by container name cannot be told apart by the interceptor.  A container must see
its own config alone.

The container's view of /etc/vcuda is made from its Allocate answer's mounts, applied as the runtime does
(nested mounts after their parent), and stands in for /etc/vcuda in the test-hook build of the interceptor
(VCUDA_TEST_CONFIG_ROOT)."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

from gpumanager import names
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.allocation.response import ContainerResponse, ResponseSettings, build_response
from gpumanager.device.types import GPUInfo
from gpumanager.recovery import answered_elsewhere
from gpumanager.vmanager import files
from simnode.cluster import SimCluster, gpu_pod
from simnode.gpusim_state import repo_root, sim_env
from simnode.mounts import host_path, materialize
from simnode.simhost import install_sim_driver, volume_conf
from tests.test_interceptor_review2 import build_program
from tests.test_interceptor_review4 import hooks_built
from tests.test_vmanager_register import GIB, Node, alloc, node, pod_object
from tests.vcuda_fixtures import BUILD, DRIVER_VERSION, last_json, vcuda_built

__all__ = ["hooks_built", "node", "vcuda_built"]  # fixtures

A_BLOCKS, B_BLOCKS = 4, 16  # 1 GiB and 4 GiB


def _mirror(where: Path, interceptor: Path) -> Path:
    where.mkdir(parents=True)
    for name in ("libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1", "libnvidia-ml.so"):
        (where / name).symlink_to(interceptor)
    for lib in ("libcuda.so", "libnvidia-ml.so"):
        (where / f"{lib}.{DRIVER_VERSION}").symlink_to(BUILD / "sim" / f"{lib}.{DRIVER_VERSION}")
    return where


def test_a_container_cannot_take_its_siblings_config(tmp_path: Path, hooks_built: Path) -> None:
    root = tmp_path / "host"
    install_sim_driver(root)
    flags = [
        f"--volume-config={volume_conf(tmp_path / 'vdriver', tmp_path / 'volume.conf')}",
        f"--driver-root={root}",
        f"--vcuda-library={repo_root() / 'vcuda/build/libcuda-control.so'}",
    ]
    grab = build_program("review10_grab", tmp_path, False)
    mirror = _mirror(tmp_path / "hooks-lib64", hooks_built / "libcuda-control.so")
    with SimCluster(tmp_path / "node", "t4-x1", agent_flags=flags) as c:
        run = c.run_pod(gpu_pod("two", [("a", 30, A_BLOCKS), ("b", 30, B_BLOCKS)]))
        answer_a, answer_b = run.core["a"].response, run.core["b"].response
        # Each container's own config, where its answer's mounts put it, holds its own limit.
        for answer, blocks in ((answer_a, A_BLOCKS), (answer_b, B_BLOCKS)):
            own = host_path(answer.mounts, answer.envs[names.VCUDA_CONFIG_ENV])
            assert files.unpack(own.read_bytes()).gpu_memory == blocks * names.MEMORY_BLOCK_BYTES, own
        view = materialize(answer_a.mounts, names.VCUDA_MOUNTPOINT, tmp_path / "view-of-a")
        assert c.agent is not None
        env = sim_env(c.spec, c.agent.state)
        env.update(
            LD_LIBRARY_PATH=str(mirror),
            VCUDA_TEST_CONFIG_ROOT=str(view),
            VCUDA_TEST_BUDGET_DIR=str(tmp_path / "shm"),
            LOGGER_LEVEL="4",
        )
        mine = env | {
            "VCUDA_CONFIG_PATH": str(view / Path(answer_a.envs[names.VCUDA_CONFIG_ENV]).relative_to("/etc/vcuda"))
        }
        siblings = env | {"VCUDA_CONFIG_PATH": str(view / "b" / names.VCUDA_CONFIG_FILE)}
        results = {}
        for what, e in (("own", mine), ("sibling", siblings)):
            done = subprocess.run([str(grab), "3072"], env=e, capture_output=True, text=True, timeout=120, check=False)
            assert done.returncode == 0, done.stdout + done.stderr[-4000:]
            out = last_json(done.stdout)
            assert isinstance(out, dict), done.stdout
            results[what] = (out, done.stderr)
    limit_mib = A_BLOCKS * names.MEMORY_BLOCK_BYTES >> 20
    for what, (out, err) in results.items():
        assert out["init"] == 0, f"{what}: {err[-4000:]}"
        assert 0 < out["got_mib"] <= limit_mib, f"{what}: {out}: A's limit is {limit_mib} MiB; {err[-4000:]}"


# -- the virtual manager's side: where each answer's files go ---------------------------------------


def _answer(n: Node, a: ContainerAllocation) -> ContainerResponse:
    """This version's Allocate answer for ``a``."""
    gpus = [GPUInfo(0, "GPU-0", "T4", 0, 16 << 30, "0000:00:04.0")]
    return build_response(a, gpus, ResponseSettings("/vd/nvidia", "/vd/origin", str(n.vm)))


def test_an_answer_mounts_the_containers_own_directory_alone(node: Node) -> None:
    """Each container's files in its own directory, mounted at /etc/vcuda/<name>; the pod's directory (its
    vcuda.sock, upstream's container-ID directories) holds empty mount points, also after registrations by
    name and by ID and the refresh of pids.config; the pod's directories go with it."""
    uid, cid = str(uuid.uuid4()), "a" * 64
    node.pods[uid] = pod_object(uid, ["a", "b"], ids={"a": cid})
    node.cgroup(uid, cid)
    answers = {}
    for name, mem in (("a", GIB), ("b", 4 * GIB)):
        node.allocs[(uid, name)] = alloc(uid, name, 30, mem)
        answers[name] = _answer(node, node.allocs[(uid, name)])
        node.v.prepare(node.allocs[(uid, name)])
    own_a = node.vm / names.VCUDA_CONFIGS_DIR / uid / "a"
    assert [(m.container_path, m.host_path) for m in answers["a"].mounts[1:]] == [
        ("/etc/vcuda", str(node.vm / uid)),
        ("/etc/vcuda/a", str(own_a)),
    ]
    assert files.unpack((own_a / names.VCUDA_CONFIG_FILE).read_bytes()).gpu_memory == GIB
    assert node.register(uid, pod_uid=uid, container_name="a") == own_a
    assert (own_a / names.PIDS_CONFIG_FILE).is_file()
    assert node.register(uid, pod_uid=uid, container_id=cid) == node.vm / uid / cid
    node.v.refresh_pids(node.allocs.values())
    assert sorted(p.name for p in (node.vm / uid).iterdir()) == sorted(["a", "b", cid, names.VCUDA_SOCKET])
    assert list((node.vm / uid / "a").iterdir()) == [] and list((node.vm / uid / "b").iterdir()) == []
    # A's view: its own directory over the pod's; B's mount point is empty there.
    view = materialize(answers["a"].mounts, "/etc/vcuda", node.vm.parent / "view")
    assert sorted(p.name for p in (view / "a").iterdir()) == [names.PIDS_CONFIG_FILE, names.VCUDA_CONFIG_FILE]
    assert list((view / "b").iterdir()) == []
    assert node.v.gc([]) == [uid]
    assert not (node.vm / uid).exists() and not (node.vm / names.VCUDA_CONFIGS_DIR / uid).exists()


def test_an_earlier_versions_answer_keeps_its_files_in_the_pods_directory(node: Node) -> None:
    """Upgrade: a container answered by an earlier version (the pod's directory mounted alone, its answer
    kept by the kubelet) has no directory of its own: PreStartContainer, a registration by name and the
    refresh write where that answer points, <pod dir>/<name>, as before."""
    uid, cid = str(uuid.uuid4()), "c" * 64
    node.pods[uid] = pod_object(uid, ["main"], ids={"main": cid})
    node.cgroup(uid, cid)
    node.allocs[(uid, "main")] = alloc(uid, "main", 30, GIB)
    # What the earlier version left: the container's vcuda.config in the pod's directory (its PreStart), or
    # the spare of it (made ahead of the start).
    (node.vm / uid / "main").mkdir(parents=True)
    (node.vm / uid / "main" / names.VCUDA_CONFIG_FILE).write_bytes(bytes(files.CONFIG_SIZE))
    path = node.v.prepare(node.allocs[(uid, "main")])
    assert path == node.vm / uid / "main" / names.VCUDA_CONFIG_FILE
    node.v.refresh_pids(node.allocs.values())
    assert (node.vm / uid / "main" / names.PIDS_CONFIG_FILE).is_file()
    assert node.register(uid, pod_uid=uid, container_name="main") == node.vm / uid / "main"
    assert not (node.vm / names.VCUDA_CONFIGS_DIR / uid).exists()


def test_ahead_of_start_a_new_pod_gets_its_own_directories(node: Node) -> None:
    """Made ahead: each container's own directory (with its spare) and an empty mount point; for a pod an
    earlier version answered and made ahead, the directories that answer uses."""
    new, old = str(uuid.uuid4()), str(uuid.uuid4())
    node.v.prepare_ahead(new, ["a", "b"])
    for name in ("a", "b"):
        assert list((node.vm / new / name).iterdir()) == []
        assert files.spare_path(node.vm / names.VCUDA_CONFIGS_DIR / new / name / names.VCUDA_CONFIG_FILE).exists()
    node.allocs[(old, "main")] = alloc(old, "main", 30, GIB)
    (node.vm / old / "main").mkdir(parents=True)
    files.make_spare(node.vm / old / "main" / names.VCUDA_CONFIG_FILE)  # made ahead by the earlier version
    node.v.prepare_ahead(old, ["main"])
    node.v.prepare(node.allocs[(old, "main")])
    assert (node.vm / old / "main" / names.VCUDA_CONFIG_FILE).is_file()
    assert not (node.vm / names.VCUDA_CONFIGS_DIR / old).exists()


def test_a_swapped_answers_directory_is_found_among_the_own_directories(tmp_path: Path) -> None:
    """With both checkpoints lost, a container's config lying in another's own directory says which
    directory it mounts; in an earlier version's layout too."""
    vm = tmp_path / "vm"
    p, q, r, s = (str(uuid.uuid4()) for _ in range(4))
    for directory, named in (
        (vm / names.VCUDA_CONFIGS_DIR / p / "main", (q, "main")),
        (vm / r / "main", (s, "main")),
    ):
        directory.mkdir(parents=True)
        config = files.VcudaConfig(pod_uid=named[0], container_name=named[1], gpu_memory=GIB, utilization=30)
        files.write_config(directory / names.VCUDA_CONFIG_FILE, config)
    assert answered_elsewhere(vm) == {(q, "main"): (p, "main"), (s, "main"): (r, "main")}
