"""A tenant escaping its limits through the environment: it controls every variable its processes start with.

The container's config lies in the agent's read-only mount at /etc/vcuda.  Here a build with the test-only
hooks (-DVC_TEST_HOOKS) stands that mount in with a temporary directory (VCUDA_TEST_CONFIG_ROOT) and the
budget directory with another (VCUDA_TEST_BUDGET_DIR): what the harness sets, as the kubelet mounts, and a
shipped library never reads.  Each attack runs vcuda/tests/review10_grab.c (once more under
AddressSanitizer/UBSan) with the variables a tenant would set, and judges what the program could allocate.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.test_interceptor_review2 import asan_built, build_program
from tests.test_interceptor_review4 import hooks_built, hooks_mirror
from tests.vcuda_fixtures import BUILD, MIB, Container, config_bytes, container, last_json, vcuda_built

__all__ = ["asan_built", "container", "hooks_built", "vcuda_built"]  # fixtures

MakeContainer = Callable[..., Container]
LIMIT_MIB = 1024
TENANT_MIB = 4096
CUDA_ERROR_NOT_PERMITTED = 800


class Tenant:
    """One container of a pod whose config is in the (stand-in) mount, and the grabbing program."""

    def __init__(self, c: Container, hooks: Path, tmp_path: Path, sanitize: bool) -> None:
        self.c, self.sanitize = c, sanitize
        self.mirror = hooks_mirror(c, hooks, sanitize)
        self.exe = build_program("review10_grab", tmp_path, sanitize)

    @property
    def mount(self) -> Path:
        return self.c.root / "etc-vcuda"

    def own_config(self, where: Path, mib: int = TENANT_MIB) -> Path:
        """A config the tenant wrote itself into a writable directory: a bigger limit, no SM share."""
        where.mkdir(parents=True, exist_ok=True)
        path = where / "vcuda.config"
        path.write_bytes(config_bytes(mib * MIB, cores=0))
        return path

    def env(self, **tenant: str | None) -> dict[str, str]:
        """What the agent and the harness give the process (the agent's VCUDA_CONFIG_PATH), then what the tenant
        sets (None: unset)."""
        env = self.c.env(LD_LIBRARY_PATH=str(self.mirror), VCUDA_CONFIG_ROOT=None, VCUDA_BUDGET_DIR=None,
                         LOGGER_LEVEL="4")  # fmt: skip
        env["VCUDA_TEST_CONFIG_ROOT"] = str(self.mount)
        env["VCUDA_TEST_BUDGET_DIR"] = str(self.c.budget_dir)
        if self.sanitize:
            env["ASAN_OPTIONS"] = "detect_leaks=0"
        for key, value in tenant.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def grab(self, want_mib: int = 3072, **tenant: str | None) -> tuple[dict[str, int], str]:
        done = subprocess.run([str(self.exe), str(want_mib)], env=self.env(**tenant), capture_output=True, text=True,
                              timeout=120, check=False)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr[-4000:]
        out = last_json(done.stdout)
        assert isinstance(out, dict), done.stdout
        return {str(k): int(v) for k, v in out.items()}, done.stderr

    def hold(self, want_mib: int, **tenant: str | None) -> tuple[subprocess.Popen[str], dict[str, int]]:
        """A process that keeps what it could allocate until it is told to exit."""
        proc = subprocess.Popen([str(self.exe), str(want_mib), "hold"], env=self.env(**tenant), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        assert proc.stdout is not None
        line = proc.stdout.readline()
        out = json.loads(line) if line.startswith("{") else {}
        if not out:
            proc.kill()
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"no answer: {line!r} {err[-4000:]}")
        return proc, {str(k): int(v) for k, v in out.items()}


@pytest.fixture(params=[False, True], ids=["plain", "asan"])
def tenant(
    request: pytest.FixtureRequest, container: MakeContainer, asan_built: Path, hooks_built: Path, tmp_path: Path
) -> Tenant:
    del asan_built
    return Tenant(container(LIMIT_MIB, cores=0), hooks_built, tmp_path, bool(request.param))


def capped(out: dict[str, int], err: str) -> None:
    """The program ran under the container's own limit: some memory, never more than the limit."""
    assert out["init"] == 0, err[-4000:]
    assert 0 < out["got_mib"] <= LIMIT_MIB, f"{out}: {err[-4000:]}"


def test_the_agents_layouts_keep_working(tenant: Tenant) -> None:
    """The agent's answer (VCUDA_CONFIG_PATH under the mount), the pod-level file of the DRA driver and
    upstream's per-container directory found without the variable: each applies the container's limit."""
    capped(*tenant.grab())
    capped(*tenant.grab(VCUDA_CONFIG_PATH=None))
    top = tenant.mount / "vcuda.config"
    top.write_bytes(tenant.c.config_path.read_bytes())
    capped(*tenant.grab(VCUDA_CONFIG_PATH=str(top)))


@pytest.mark.parametrize("how", ["path", "dotdot", "root", "root-and-path"])
def test_a_config_the_tenant_wrote_itself_is_refused(tenant: Tenant, how: str) -> None:
    """A config with a 4 GiB limit written into a writable directory, named by VCUDA_CONFIG_PATH (as such, or
    through the mount with ..) or VCUDA_CONFIG_ROOT: the interceptor took it, and the container its 4 GiB.
    Only a config under the mount may apply; the refusal names the variable and its value."""
    own = tenant.own_config(tenant.c.root / "tenant")
    variables: dict[str, str | None] = {
        "path": {"VCUDA_CONFIG_PATH": str(own)},
        "dotdot": {"VCUDA_CONFIG_PATH": f"{tenant.mount}/../tenant/vcuda.config"},
        "root": {"VCUDA_CONFIG_PATH": None, "VCUDA_CONFIG_ROOT": str(own.parent)},
        "root-and-path": {"VCUDA_CONFIG_PATH": str(own), "VCUDA_CONFIG_ROOT": str(own.parent)},
    }[how]
    out, err = tenant.grab(**variables)
    capped(out, err)
    for name, value in variables.items():
        if value is not None:
            assert f"{name}={value}" in err, err[-4000:]


@pytest.mark.parametrize("path", ["unset", "missing"])
def test_a_pod_of_two_containers_is_not_unlimited_without_the_agents_path(tenant: Tenant, path: str) -> None:
    """The mount holds the pod's directory: this container's and a sibling's config.  Without the agent's
    VCUDA_CONFIG_PATH (unset, or naming a file that does not exist) the interceptor found no config of its
    own among two and ran without limits.  A container whose mount holds configs must never run unlimited:
    CUDA is refused."""
    tenant.own_config(tenant.mount / "side")
    value = None if path == "unset" else str(tenant.c.root / "nowhere" / "vcuda.config")
    out, err = tenant.grab(VCUDA_CONFIG_PATH=value)
    assert out == {"init": CUDA_ERROR_NOT_PERMITTED, "got_mib": 0}, err[-4000:]
    assert "no usable vcuda config" in err or "none of them" in err, err[-4000:]


def test_private_budget_directories_do_not_split_the_ledger(tenant: Tenant) -> None:
    """Each process pointed VCUDA_BUDGET_DIR at a directory of its own: each had a ledger of its own and the
    container the limit once per process.  The ledger's directory is not the tenant's to choose: the second
    process gets what the first left."""
    first, a = tenant.hold(384, VCUDA_BUDGET_DIR=str(tenant.c.root / "mine-1"))
    try:
        b, err = tenant.grab(768, VCUDA_BUDGET_DIR=str(tenant.c.root / "mine-2"))
    finally:
        assert first.stdin is not None
        first.communicate("done\n", timeout=60)
    assert a["got_mib"] == 384, a
    # Each process's context is charged too: the second cannot have its 768 MiB next to the first's 384.
    assert b["init"] == 0 and b["got_mib"] < 768 and a["got_mib"] + b["got_mib"] <= LIMIT_MIB, f"{a} {b}: {err[-4000:]}"
    assert f"VCUDA_BUDGET_DIR={tenant.c.root / 'mine-2'}" in err, err[-4000:]


def test_the_tenants_algorithm_reserve_and_libraries_are_not_taken(tenant: Tenant) -> None:
    """VCUDA_CORE_ALGORITHM=upstream chose upstream's weaker SM limiter (graph launches and cuLaunchKernelEx not
    paced), VCUDA_CONTEXT_RESERVE=1 let a context be created with next to nothing reserved for it (its
    footprint charged only once the driver made it: processes starting together could pass the cap until
    then), VCUDA_LIBNVML named the NVML the container's usage is measured with.  In a container whose config
    is in the mount none is taken from the environment: each refusal is logged with the variable and its
    value, and the limits hold."""
    tenant.c.config_path.write_bytes(config_bytes(LIMIT_MIB * MIB, cores=30))
    tenant_nvml = str(tenant.c.root / "tenant" / "libnvidia-ml.so.1")
    out, err = tenant.grab(VCUDA_CORE_ALGORITHM="upstream", VCUDA_CONTEXT_RESERVE="1", VCUDA_LIBNVML=tenant_nvml)
    capped(out, err)
    for line in ("VCUDA_CORE_ALGORITHM=upstream", "VCUDA_CONTEXT_RESERVE=1", f"VCUDA_LIBNVML={tenant_nvml}"):
        assert line in err, err[-4000:]
    assert "algorithm budget" in err and "real libnvidia-ml: " + str(tenant.mirror) in err, err[-4000:]


def test_without_a_config_in_the_mount_the_variables_still_apply(tenant: Tenant) -> None:
    """A process whose mount holds no config (the agent's own checks, tests, a node without the agent's
    mount) is given no limit to escape: VCUDA_CONFIG_PATH naming a config elsewhere still applies it."""
    tenant.c.config_path.unlink()
    own = tenant.own_config(tenant.c.root / "elsewhere", mib=512)
    out, err = tenant.grab(VCUDA_CONFIG_PATH=str(own))
    assert out["init"] == 0 and 0 < out["got_mib"] <= 512, f"{out}: {err[-4000:]}"


def test_the_shipped_library_reads_no_test_variable(vcuda_built: Path, asan_built: Path) -> None:
    """The test-only hooks (delays that stall accounting, the stand-ins for the mount and the budget directory)
    exist only in a -DVC_TEST_HOOKS build: the library the agent ships (and its sanitizer build) holds none of
    their variable names."""
    for lib in (vcuda_built, asan_built, BUILD / "libcuda-control.so"):
        assert b"VCUDA_TEST_" not in lib.read_bytes(), lib


def own_cgroup_name() -> str | None:
    """A run of 32 hex digits or more in this process's cgroup paths, to stand for its container id."""
    ids = re.findall(r"[0-9a-f]{32,}", Path("/proc/self/cgroup").read_text())
    return ids[-1] if ids else None


def test_a_siblings_config_is_refused_where_the_cgroup_names_this_containers(tenant: Tenant) -> None:
    """Upstream's layout: the mount holds the pod's containers' directories, named by container id.  A tenant
    naming another container's config (a bigger limit) in VCUDA_CONFIG_PATH had its limit.  Where a directory
    is named by this container's id (in /proc/self/cgroup), only that one's config applies."""
    own = own_cgroup_name()
    if own is None:
        pytest.skip("no run of 32 hex digits in /proc/self/cgroup to stand for a container id")
    tenant.c.config_path.parent.rename(tenant.mount / own)
    sibling = tenant.own_config(tenant.mount / "5ab1e0000000000000000000000000000000000000000000000000000000cafe")
    out, err = tenant.grab(VCUDA_CONFIG_PATH=str(sibling))
    capped(out, err)
    assert f"VCUDA_CONFIG_PATH={sibling}: ignored: another container's config" in err, err[-4000:]
    capped(*tenant.grab(VCUDA_CONFIG_PATH=None))
