"""A tenant's attempts to run more kernels than its container's SM share admits (vcuda/tests/review12_sm.c).

Each scenario runs the C program in a container-like set-up: a driver mirror whose ``libcuda.so.1`` and
``libnvidia-ml.so.1`` are the interceptor in front of the simulated driver, a ``vcuda.config`` with a 30 % SM share
and no memory limit, a budget directory of its own.  The program offers kernels of 50 ms of simulated GPU time
through one launch path for at most a second of wall time and reports how many launch calls the interceptor let
through.  The check is functional, not a share over time: at 30 % the gate admits a few hundred ms of GPU time in
that second (a handful of such kernels, however slow the machine), while a path that escapes the gate admits all
100 at once.  Every scenario also runs against the ASan/UBSan builds of the interceptor and of the simulated driver.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpumanager.vmanager import files
from simnode.gpusim_state import GpuSimState

ROOT = Path(__file__).resolve().parents[1]
VCUDA = ROOT / "vcuda"
BUILD = VCUDA / "build"
SPEC = ROOT / "deploy" / "sim" / "t4-x1.json"
SOURCE = VCUDA / "tests" / "review12_sm.c"
DRIVER_VERSION = "550.54.15"
SHARE = 30
# 1 s at 30 % is 300 ms of GPU time: 6 kernels of 50 ms, plus what the gate lets queue (in flight x cost) and the
# burst the credit cap allows (100 ms of the rate).  An ungated path admits all 100 offered.
MOST_ADMITTED = 30
HOOKS = "t_VC_TEST_HOOKS"  # the interceptor built with -DVC_TEST_HOOKS (as tests/test_vcuda_compute.py names it)
SAN_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]


def _include_dirs() -> list[str]:
    out = subprocess.run(
        ["make", "-s", "-C", str(VCUDA), "--eval=print-inc:\n\t@echo $(CUDA_INCLUDE) $(NVML_INCLUDE)", "print-inc"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The scenario program, plain and under ASan/UBSan, after the interceptor and the simulated driver are built."""
    subprocess.run(
        [
            "make",
            "-s",
            "-C",
            str(VCUDA),
            "sim",
            "interceptor",
            "build/asan/libcuda-control.so",
            "build/sim-asan/libcuda.so.1",
            "build/sim-asan/libnvidia-ml.so.1",
        ],
        check=True,
        capture_output=True,
    )
    out = tmp_path_factory.mktemp("review12-sm-bin")
    incs = [f"-I{d}" for d in _include_dirs()]
    built = {}
    for variant, extra in (("plain", []), ("asan", SAN_FLAGS)):
        exe = out / f"review12_sm_{variant}"
        subprocess.run(
            [
                "cc",
                "-std=c11",
                "-D_GNU_SOURCE",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-O1",
                "-g",
                *extra,
                *incs,
                "-o",
                str(exe),
                str(SOURCE),
                "-ldl",
                "-pthread",
            ],
            check=True,
        )
        built[variant] = exe
    built["hooks"] = built["plain"]
    return built


def _mirror(where: Path, variant: str) -> Path:
    """A driver mirror as the agent makes it: the interceptor under the sonames, the driver under its full names."""
    where.mkdir()
    interceptor = BUILD / ("asan" if variant == "asan" else "") / "libcuda-control.so"
    if variant == "hooks":
        interceptor = BUILD / HOOKS / "libcuda-control.so"
    sim = BUILD / ("sim-asan" if variant == "asan" else "sim")
    for soname in ("libcuda.so.1", "libnvidia-ml.so.1"):
        (where / soname).symlink_to(interceptor)
    (where / f"libcuda.so.{DRIVER_VERSION}").symlink_to(sim / "libcuda.so.1")
    (where / f"libnvidia-ml.so.{DRIVER_VERSION}").symlink_to(sim / "libnvidia-ml.so.1")
    return where


def _run(programs: dict[str, Path], tmp_path: Path, variant: str, scenario: str, **extra: str) -> list[int]:
    """Runs one scenario; returns the launches admitted, one figure per report line."""
    mirror = _mirror(tmp_path / "mirror", variant)
    config = tmp_path / "config" / "vcuda.config"
    config.parent.mkdir()
    config.write_bytes(
        files.pack(files.VcudaConfig(pod_uid="pod-review12", container_name="c", gpu_memory=0, utilization=SHARE))
    )
    budget = tmp_path / "budget"
    budget.mkdir()
    env = dict(os.environ)
    env.update(
        LD_LIBRARY_PATH=str(mirror),
        GPUSIM_SPEC=str(SPEC),
        GPUSIM_STATE=str(tmp_path / "node.state"),
        VCUDA_CONFIG_PATH=str(config),
        VCUDA_BUDGET_DIR=str(budget),
        ASAN_OPTIONS="detect_leaks=0",
        **extra,
    )
    env.pop("LD_PRELOAD", None)
    done = subprocess.run([str(programs[variant]), scenario], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{scenario} ({variant}): exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    found = [int(n) for n in re.findall(r"^admitted (\d+) of", done.stdout, re.M)]
    assert found, f"{scenario} ({variant}): no report\n{done.stdout}\n{done.stderr}"
    return found


SCENARIOS = [
    "kernel",
    "kernel-ptsz",
    "ex",
    "ex-ptsz",
    "coop",
    "coop-ptsz",
    "multi",
    "grid-async",
    "legacy",
    "grid",
    "graph-captured",
    "graph-built",
    "graph-ptsz",
    "library",
    "threads",
    "contexts",
    "green",
]


@pytest.mark.parametrize("variant", ["plain", "asan"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_launch_path_is_gated(programs: dict[str, Path], tmp_path: Path, scenario: str, variant: str) -> None:
    for admitted in _run(programs, tmp_path, variant, scenario):
        assert admitted <= MOST_ADMITTED, f"{scenario} ({variant}): {admitted} kernels of 50 ms in 1 s at {SHARE} %"


@pytest.mark.parametrize("variant", ["plain", "asan"])
def test_a_first_launch_stuck_in_its_log_line_lets_no_other_launch_through(
    programs: dict[str, Path], tmp_path: Path, variant: str
) -> None:
    """The first limited launch logs the limit it sets up (LOGGER_LEVEL=4, the tenant's variable).  With stderr a
    full pipe nobody reads, that write blocks for good: the device was marked set up before it was marked limited,
    so every other thread's launches went through ungated for as long as the write blocked."""
    (admitted,) = _run(programs, tmp_path, variant, "stall", LOGGER_LEVEL="4")
    assert admitted <= MOST_ADMITTED, f"stall ({variant}): {admitted} kernels of 50 ms admitted in 1 s at {SHARE} %"


@pytest.mark.parametrize("variant", ["plain", "asan"])
def test_a_kernel_that_ran_while_the_process_was_stopped_is_paid_for(
    programs: dict[str, Path], tmp_path: Path, variant: str
) -> None:
    """A 2.5 s kernel, then the process is stopped for 3.5 s (SIGSTOP, SIGCONT): NVML answers for the last second
    only, so the limiter, measuring nothing meanwhile, charged 1 s of it and then admitted a share's worth of
    kernels at once (10 of 50 ms in the next second).  The time it could not measure is charged now: the container
    owes about 1.5 s and admits at most the launch that was on its way before the first measurement."""
    (admitted,) = _run(programs, tmp_path, variant, "stopped")
    assert admitted <= 2, f"stopped ({variant}): {admitted} kernels of 50 ms admitted in the second after the stop"


@pytest.mark.parametrize("variant", ["plain", "asan"])
def test_cuGetProcAddress_hands_out_only_gated_launch_entry_points(
    programs: dict[str, Path], tmp_path: Path, variant: str
) -> None:
    """Every launch entry point (cuLaunchKernel, Ex, cooperative, multi-device, graph, legacy) asked for through
    cuGetProcAddress and cuGetProcAddress_v2, at every version from 2.0 to 13.0 and every flag, is the
    interceptor's."""
    mirror = _mirror(tmp_path / "mirror", variant)
    env = dict(os.environ, LD_LIBRARY_PATH=str(mirror), GPUSIM_SPEC=str(SPEC), GPUSIM_STATE=str(tmp_path / "s"))
    config = tmp_path / "config" / "vcuda.config"
    config.parent.mkdir()
    config.write_bytes(
        files.pack(files.VcudaConfig(pod_uid="pod-review12", container_name="c", gpu_memory=0, utilization=SHARE))
    )
    (tmp_path / "budget").mkdir()
    env.update(VCUDA_CONFIG_PATH=str(config), VCUDA_BUDGET_DIR=str(tmp_path / "budget"), ASAN_OPTIONS="detect_leaks=0")
    env.pop("LD_PRELOAD", None)
    done = subprocess.run([str(programs[variant]), "getproc"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"getproc ({variant}): exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    m = re.search(r"^found (\d+) escapes (\d+)$", done.stdout, re.M)
    assert m is not None, done.stdout
    assert int(m.group(1)) > 500, done.stdout
    assert int(m.group(2)) == 0, done.stdout


@pytest.mark.parametrize("variant", ["plain", "asan"])
def test_launches_measure_when_the_watcher_is_gone(programs: dict[str, Path], tmp_path: Path, variant: str) -> None:
    """The limiter's watcher thread (the one that measures every 10 ms) cannot be started: the tenant refuses its
    creation (as a full pids cgroup does; it could as well end the thread with a signal handler that calls
    pthread_exit).  Then a 2.5 s kernel every 300 ms: each found the 90 ms of refill it needed and went without a
    look at NVML, so nothing was measured and all 10 went in 3 s of a 30 % share.  A launch now measures itself
    when nothing was measured for 50 ms: the second waits for the first to be paid for."""
    (admitted,) = _run(programs, tmp_path, variant, "no-watcher")
    assert admitted <= 2, f"no-watcher ({variant}): {admitted} kernels of 2.5 s admitted in 3 s at {SHARE} %"


def test_a_launch_waits_for_a_limiter_another_thread_is_setting_up(programs: dict[str, Path], tmp_path: Path) -> None:
    """Two threads' first launches at once.  The device was marked set up before it was marked limited, so a launch
    that came between the two stores went through ungated (for as long as the thread setting it up was preempted
    there; -DVC_TEST_HOOKS widens the window with VCUDA_TEST_INIT_DELAY_US).  The limited mark comes first now: a
    launch that finds the device set up finds it limited."""
    done = subprocess.run(
        [
            "make",
            "-s",
            "-C",
            str(VCUDA),
            f"BUILD=build/{HOOKS}",
            "CFLAGS=-O2 -g -DVC_TEST_HOOKS",
            "interceptor",
            f"PYTHON={sys.executable}",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (admitted,) = _run(programs, tmp_path, "hooks", "init-race", VCUDA_TEST_INIT_DELAY_US="800000")
    assert admitted <= MOST_ADMITTED, f"init-race: {admitted} kernels of 50 ms admitted in 1 s at {SHARE} %"


@pytest.mark.timing
@pytest.mark.xfail(
    strict=False,
    reason="not fixed: the container's sum of provisional charges is a pay-off deadline that runs down with the wall "
    "clock while the process that holds them also refills its credit, so a process that exits leaves rate x (time "
    "they were held) too little of its last charges to the next one (0.28 s of each 1 s process at 0.7 s sample delay)",
)
def test_a_chain_of_processes_that_exit_with_a_kernel_running_keeps_the_share(
    programs: dict[str, Path], tmp_path: Path
) -> None:
    """Five processes one after the other, each launching a 5 s kernel (gated: it waits for the debt of those before
    it) and exiting 1 s later with it still running, NVML's samples 0.7 s late as on a real driver: the chain must
    use at most its 30 % of the time it took, plus the last process's second (nobody pays for it) and a margin."""
    mirror = _mirror(tmp_path / "mirror", "plain")
    config = tmp_path / "config" / "vcuda.config"
    config.parent.mkdir()
    config.write_bytes(
        files.pack(files.VcudaConfig(pod_uid="pod-review12", container_name="c", gpu_memory=0, utilization=SHARE))
    )
    (tmp_path / "budget").mkdir()
    state = tmp_path / "node.state"
    env = dict(os.environ, LD_LIBRARY_PATH=str(mirror), GPUSIM_SPEC=str(SPEC), GPUSIM_STATE=str(state))
    env.update(VCUDA_CONFIG_PATH=str(config), VCUDA_BUDGET_DIR=str(tmp_path / "budget"))
    env["GPUSIM_PROCESS_SAMPLE_DELAY_US"] = "700000"
    env.pop("LD_PRELOAD", None)
    done = subprocess.run([str(programs["plain"]), "exit-tail"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    m = re.search(r"^elapsed (\d+)$", done.stdout, re.M)
    assert m is not None, done.stdout
    elapsed = int(m.group(1)) / 1000
    with GpuSimState(str(state)) as st:
        timeline = st.timeline(0)
    assert timeline is not None
    busy = timeline.busy_ns / 1e9
    assert busy <= SHARE / 100 * elapsed + 1.5, f"the chain used {busy:.2f} s of the GPU in {elapsed:.2f} s"
