"""``gpu-manager selftest`` against the real driver's habits that the simulated one is kinder about.

NVML on a real GPU samples each process's utilisation once per sampling period (between 1/6 s and
1 s depending on the product, NVIDIA's nvmlUtilization_t) and a process's sample is seen some time
after the moment it describes (newest samples 0.7 s and more behind the time of the query, as
reported against drivers on real GPUs).  The fake NVML here does both; the simulated one samples
every 10 ms and shows a sample at once.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpumanager.selftest import checks, programs
from simnode.gpusim_state import repo_root, sim_env, spec_dir
from simnode.simhost import install_sim_driver
from tests.test_selftest_sampler import (
    FAKE_SPIN_HEAD,
    NOT_FOUND,
    T0,
    Busy,
    FakeNVML,
    FakeNVMLError,
    S,
    fake_setup,
    record_started,
)
from tests.vcuda_fixtures import vcuda_built

__all__ = ["vcuda_built"]  # fixtures

#: A launch loop without CUDA (a window of 0.1 s ending at its report), holding as SPIN does after it.
FAKE_SPIN = (
    FAKE_SPIN_HEAD
    + "def hold("
    + programs.PRELUDE.split("def hold(", 1)[1]
    + programs.SPIN.split("report(rate=", 1)[1].split("\n", 1)[1]
)


class SlowNVML(FakeNVML):
    """NVML of a real GPU: samples every ``period`` us, each seen ``delay`` us after the moment it describes."""

    def __init__(self, busy: list[Busy], pid: int, *, period: int, delay: int) -> None:
        super().__init__(busy, exits={}, offsets={pid: 0})
        self.period, self.delay = period, delay

    def nvmlDeviceGetProcessUtilization(self, handle: str, last_seen: int) -> list[SimpleNamespace]:
        now = self.now
        self.now = now - self.delay  # what NVML has seen by now: its samples up to delay ago
        try:
            checkpoint = self.now - (self.now - T0) % self.period
            first = max(last_seen, checkpoint - S)
            samples = []
            for pid in self.offsets:
                busy = self.busy_us(pid, first, checkpoint)
                if checkpoint > last_seen and checkpoint > first and busy > 0:
                    util = round(100 * busy / (checkpoint - first))
                    samples.append(SimpleNamespace(pid=pid, timeStamp=checkpoint, smUtil=util))
            if not samples:
                raise FakeNVMLError(NOT_FOUND)
            return samples
        finally:
            self.now = now


@pytest.mark.parametrize(("period", "delay"), [(S // 6, 800_000), (S, 700_000)])
def test_a_real_gpus_slow_and_late_samples_still_cover_the_end_of_the_window(period: int, delay: int) -> None:
    """A process kept 30 % busy through its window (and a little after, its queued kernels) is read as 30 %:
    the last poll waits for the samples of the window's end, instead of counting their time as idle."""
    pid = 31
    nvml = SlowNVML([Busy(pid, 0.0, 6.05, 0.3)], pid, period=period, delay=delay)
    sampler = checks.UtilSampler(0, nvml=nvml, clock=lambda: nvml.now / S)
    sampler.begin()
    window = (T0 + 2 * S, T0 + 6 * S)
    stop = 6.0 + checks.SAMPLE_LAG  # as _spin: the last poll SAMPLE_LAG after the window's end
    at = 0.25
    while at < stop:
        nvml.now = T0 + int(at * S)
        sampler.poll()
        at += 0.25
    nvml.now = T0 + int(stop * S)
    sampler.stop()
    got = sampler.share(pid, window)
    assert got is not None
    assert got == pytest.approx(30.0, abs=1.5)


def _entry(name: str) -> str:
    body = programs.PTX.split(f".entry {name}(", 1)[1]
    return body.split("\n}", 1)[0]


def test_the_spin_kernel_lasts_a_millisecond_of_time_not_of_sm_clock_cycles() -> None:
    """A real GPU's SM clock moves with load, power and temperature (an H100 between its base and boost clock,
    lower still while a limited container leaves it idle); a kernel spinning a count of %clock64 cycles sized
    by CU_DEVICE_ATTRIBUTE_CLOCK_RATE (the maximum) lasts longer whenever the clock is lower, so a limited
    run's kernels/s against the unlimited run's read a lower share than the time it had.  The spin kernel
    waits on the GPU's global nanosecond timer for the nanoseconds it is given: 1 ms whatever the clock."""
    spin = _entry("spin_1000us")
    assert "%globaltimer" in spin and "%clock" not in spin
    assert "CLOCK_RATE" not in programs.SPIN
    params = programs.SPIN.split("params = ", 1)[1].split("\n", 1)[0]
    assert eval(params, {"ctypes": ctypes}) == ((1_000_000,), (ctypes.c_uint64,))


def _selftest_on(tmp_path: Path, spec: dict[str, object], *flags: str) -> subprocess.CompletedProcess[str]:
    root = tmp_path / "host"
    install_sim_driver(root)
    spec_file = tmp_path / "node.json"
    spec_file.write_text(json.dumps(spec))
    return subprocess.run(
        [sys.executable, "-m", "gpumanager.cli", "selftest", f"--driver-root={root}", *flags],
        env=sim_env(spec_file, tmp_path / "node.state"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=repo_root(),
    )


def test_cuda_bindings_newer_than_the_drivers_cuda_is_named_before_any_check_runs(
    vcuda_built: Path, tmp_path: Path
) -> None:
    """cuda-bindings N.x needs a driver of CUDA N.0 or newer (NVIDIA's minor-version compatibility: 12.x from
    driver 525.60.13, 13.x from 580).  With an older driver every program failed on its own and every row
    said so; the self-test now says which package to install, and runs nothing (exit 2)."""
    major = int(importlib.metadata.version("cuda-bindings").split(".")[0])
    spec = json.loads((spec_dir() / "t4-x1.json").read_text())
    spec["cuda_driver_version"] = (major - 1) * 1000 + 80
    spec["driver_version"] = "520.61.05"
    done = _selftest_on(tmp_path, spec, f"--vcuda-library={vcuda_built}", "--only=cost")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"cuda-bindings {importlib.metadata.version('cuda-bindings')}" in done.stderr
    assert f"CUDA {major - 1}.8" in done.stderr and "520.61.05" in done.stderr
    assert "Traceback" not in done.stderr and "cost" not in done.stdout


class BusyNVML:
    """NVML of a GPU that another process (``FOREIGN``) keeps half busy: at each poll, a sample of it and of
    every launch loop started (``pids``), stamped now."""

    NVMLError = FakeNVMLError
    NVML_ERROR_NOT_FOUND = NOT_FOUND
    FOREIGN = 4_000_000

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return "gpu0"

    def nvmlDeviceGetProcessUtilization(self, handle: str, last_seen: int) -> list[SimpleNamespace]:
        now = int(time.time() * 1e6)
        return [SimpleNamespace(pid=pid, timeStamp=now, smUtil=30) for pid in self.pids] + [
            SimpleNamespace(pid=self.FOREIGN, timeStamp=now, smUtil=50)
        ]


def test_other_work_on_the_gpu_during_a_share_measurement_is_named_not_read_as_the_limiters_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A GPU of a working node runs other pods' kernels: the launch loops then get what the GPU's time slicing
    leaves them, and a limit read against that says OFF (or passes by chance) without saying why.  The
    measurement now fails naming the other processes and what they took."""
    monkeypatch.setattr(programs, "SPIN", FAKE_SPIN)
    started = record_started(monkeypatch)
    monkeypatch.setattr(checks, "SAMPLE_LAG", 0.3)
    setup = fake_setup(tmp_path)
    sampler = checks.UtilSampler(0, nvml=BusyNVML(started))
    with pytest.raises(checks.ChildError) as raised:
        checks._spin(setup, [setup.plain()], sampler)
    assert f"PID {BusyNVML.FOREIGN}" in str(raised.value) and "50 %" in str(raised.value)
    assert "idle GPU" in str(raised.value)


def test_a_gpu_without_other_work_measures_as_before(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    class Alone(BusyNVML):
        def nvmlDeviceGetProcessUtilization(self, handle: str, last_seen: int) -> list[SimpleNamespace]:
            return [s for s in super().nvmlDeviceGetProcessUtilization(handle, last_seen) if s.pid != self.FOREIGN]

    monkeypatch.setattr(programs, "SPIN", FAKE_SPIN)
    started = record_started(monkeypatch)
    monkeypatch.setattr(checks, "SAMPLE_LAG", 0.3)
    setup = fake_setup(tmp_path)
    ((rate, util),) = checks._spin(setup, [setup.plain()], checks.UtilSampler(0, nvml=Alone(started)))
    assert rate == 300.0 and util == pytest.approx(30.0)


LEGACY = "cuMemAlloc (CUDA 2.0 ABI)"


@pytest.fixture(scope="module")
def legacy_node(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """One simulated T4 for this module's NVML (the parent's NVML reads one node's state for good)."""
    base = tmp_path_factory.mktemp("legacy")
    root = base / "host"
    install_sim_driver(root)
    env = sim_env(spec_dir() / "t4-x1.json", base / "node.state")
    saved = {key: os.environ.get(key) for key in ("GPUSIM_SPEC", "GPUSIM_STATE")}
    os.environ.update({key: env[key] for key in saved})
    from gpumanager.device import nvml
    from gpumanager.selftest.mirror import find_driver

    try:
        nvml.init(str(find_driver(root).libnvml))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return root, env


def _legacy_setup(
    tmp_path: Path, interceptor: Path, node: tuple[Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> checks.Setup:
    """The self-test's setup on the simulated T4, the legacy path alone."""
    from gpumanager.selftest.mirror import find_driver, lay_out

    root, env = node
    direct, mirror = lay_out(tmp_path, find_driver(root), interceptor.resolve())
    monkeypatch.setattr(checks, "ALLOCATION_PATHS", (LEGACY,))
    return checks.Setup(uuid="GPU-46fcd802-f9c7-4094-b452-4517b84b2606", gpu_index=0, gpu_total=15360 << 20,
                        work=tmp_path, mirror=mirror, direct=direct, cap=512 << 20, settle=1, measure=1, tolerance=3,
                        calls=10, base_env=env)  # fmt: skip


def test_a_driver_that_refuses_the_cuda_2_0_abi_in_a_64_bit_process_is_reported_not_failed(
    vcuda_built: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    legacy_node: tuple[Path, dict[str, str]],
) -> None:
    """The CUDA 2.0 ABI's cuMemAlloc hands out 32-bit device addresses; a real driver may refuse it in a
    64-bit process (or not export it).  The interceptor cannot make the driver allocate: the row said FAIL
    (``stopped by CUDA_ERROR_NOT_SUPPORTED``) for what the driver alone does; it now checks the driver
    without the interceptor and reports an informational row."""
    refusing = programs.ALLOCATE.replace(
        "def legacy():\n", "def legacy():\n    return (R.CUDA_ERROR_NOT_SUPPORTED, 0)\n", 1
    )
    assert refusing != programs.ALLOCATE
    monkeypatch.setattr(programs, "ALLOCATE", refusing)
    (row,) = checks.allocation_paths(_legacy_setup(tmp_path, vcuda_built, legacy_node, monkeypatch))
    assert row.ok and row.informational, row
    assert "CUDA_ERROR_NOT_SUPPORTED" in row.result and "without the interceptor" in row.result


def test_a_driver_whose_32_bit_addresses_run_out_below_the_cap_is_reported_as_proving_nothing(
    vcuda_built: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    legacy_node: tuple[Path, dict[str, str]],
) -> None:
    """The driver alone stops the 32-bit allocations (out of memory: the low 4 GiB of addresses are used up)
    before the cap: "held" would pass whether or not the interceptor counts them."""
    few = programs.ALLOCATE.replace(
        "def legacy():\n",
        "def legacy():\n    global n_legacy\n    n_legacy = globals().get('n_legacy', 0) + 1\n"
        "    if n_legacy > 2:\n        return (R.CUDA_ERROR_OUT_OF_MEMORY, 0)\n",
        1,
    )
    monkeypatch.setattr(programs, "ALLOCATE", few)
    (row,) = checks.allocation_paths(_legacy_setup(tmp_path, vcuda_built, legacy_node, monkeypatch))
    assert row.ok and row.informational, row
    assert "without the interceptor" in row.result and "below the cap" in row.result


def test_the_cuda_2_0_abi_is_judged_as_before_where_the_driver_allocates_through_it(
    vcuda_built: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    legacy_node: tuple[Path, dict[str, str]],
) -> None:
    (row,) = checks.allocation_paths(_legacy_setup(tmp_path, vcuda_built, legacy_node, monkeypatch))
    assert row.ok and not row.informational and row.result.startswith("held:"), row


def test_the_programs_are_shown_to_run_through_the_interceptor_and_the_real_driver_behind_it(
    vcuda_built: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    legacy_node: tuple[Path, dict[str, str]],
) -> None:
    setup = _legacy_setup(tmp_path, vcuda_built, legacy_node, monkeypatch)
    row = next(r for r in checks.memory_views(setup) if r.name == "interceptor in the programs")
    assert row.ok and str(vcuda_built.resolve()) in row.result, row


def test_a_container_whose_programs_load_the_driver_directly_is_named_not_only_seen_as_wrong_totals(
    vcuda_built: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    legacy_node: tuple[Path, dict[str, str]],
) -> None:
    """A silent pass-through (the programs find the driver's libcuda before the mirror's) showed only as wrong
    numbers; the row now says which libcuda the programs have."""
    setup = _legacy_setup(tmp_path, vcuda_built, legacy_node, monkeypatch)
    container = setup.container

    def direct(*, memory: int = 0, cores: int = 0) -> dict[str, str]:
        env = container(memory=memory, cores=cores)
        env["LD_LIBRARY_PATH"] = str(setup.direct)
        return env

    monkeypatch.setattr(setup, "container", direct)
    row = next(r for r in checks.memory_views(setup) if r.name == "interceptor in the programs")
    assert not row.ok and "not loaded" in row.result and str(vcuda_built.resolve()) in row.result, row


#: A launch loop without CUDA whose "kernel launches" are lines in the file ARGS names (their CLOCK_REALTIME us).
LOGGING_SPIN = (
    r"""
import json, os, sys, time
ARGS = json.loads(sys.argv[1])
class d:
    @staticmethod
    def cuLaunchKernel(*args):
        time.sleep(0.002)
        with open(os.environ["LAUNCH_LOG"], "a") as log:
            log.write(f"{int(time.time() * 1e6)}\n")
        return (0,)
fn = stream = params = None
print("running", flush=True)
now = int(time.time() * 1e6)
print(json.dumps({"rate": 300.0, "pid": os.getpid(), "from_us": now - 100000, "to_us": now}), flush=True)
"""
    + "def hold("
    + programs.PRELUDE.split("def hold(", 1)[1]
    + programs.SPIN.split("report(rate=", 1)[1].split("\n", 1)[1]
)


def test_the_launch_loops_keep_their_pace_after_their_window_until_nvml_was_last_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A real GPU's sample may cover up to a second across the end of a window (a sampling period of 1 s):
    where the loop went idle at the window's end, that sample's mean took in the idle time after it and a
    90 % limit read 85 %.  The loops now keep launching, at their limited pace, until NVML was read."""
    log = tmp_path / "launches"
    monkeypatch.setattr(programs, "SPIN", LOGGING_SPIN)
    monkeypatch.setattr(checks, "SAMPLE_LAG", 0.5)
    setup = fake_setup(tmp_path, LAUNCH_LOG=str(log))
    stops: list[float] = []

    class Sampler:
        def start(self) -> None:
            pass

        def stop(self) -> None:
            stops.append(time.time())

        def share(self, pid: int, window: tuple[int, int]) -> float | None:
            return 30.0

        def others(self, pids: set[int], window: tuple[int, int]) -> dict[int, float]:
            return {}

    checks._spin(setup, [setup.plain()], Sampler())  # type: ignore[arg-type]
    launched = [int(line) for line in log.read_text().split()]
    (stopped,) = stops
    assert launched and max(launched) >= (stopped - 0.1) * 1e6  # still launching when NVML was last read


@pytest.mark.parametrize(
    ("program", "reason"),
    [
        ("report(error='CUDA_ERROR_NO_DEVICE')", "CUDA_ERROR_NO_DEVICE"),
        ("raise ImportError('libcuda.so.1: cannot open shared object file')", "cannot open shared object file"),
    ],
)
def test_cuda_that_cannot_reach_the_gpu_is_said_once_before_any_check_runs(
    vcuda_built: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    legacy_node: tuple[Path, dict[str, str]],
    program: str,
    reason: str,
) -> None:
    """NVML can read the GPU while CUDA cannot use it (no /dev/nvidia-uvm in the pod, no permission on the
    device files, a driver/library mismatch): every row then failed with the same error, 20 times over.
    A first program without the interceptor now says why, and nothing runs (exit 2)."""
    from gpumanager.selftest import command

    root, env = legacy_node
    for key in ("GPUSIM_SPEC", "GPUSIM_STATE"):
        monkeypatch.setenv(key, env[key])
    monkeypatch.setattr(
        programs, "PROBE", "import json, sys\ndef report(**f):\n    print(json.dumps(f), flush=True)\n" + program
    )
    code = command.main([f"--driver-root={root}", f"--vcuda-library={vcuda_built}", "--only=cost"])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert reason in err and "without the interceptor" in err and "cost" not in out
