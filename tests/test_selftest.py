"""``gpu-manager selftest`` on the simulated node: the table, its verdicts and its exit codes.

The simulated driver is installed in a host root the way NVIDIA's installer lays it out (with its
ld.so.cache), so the command finds it as it finds the real driver on a node.  Shares are measured
on the simulated GPU's timeline over short windows here (with a wide tolerance: the machine running
the tests is loaded); bench/bench_compute.py measures them precisely.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpumanager.selftest.checks import Span, credit, share
from simnode.gpusim_state import repo_root, sim_env, spec_dir
from simnode.simhost import install_sim_driver
from tests.vcuda_fixtures import BUILD, vcuda_built

__all__ = ["vcuda_built"]  # fixtures


def selftest(
    tmp_path: Path, *flags: str, timeout: float = 400, sampling: str | None = None, period_us: int | None = None
) -> subprocess.CompletedProcess[str]:
    """``gpu-manager selftest`` on a simulated T4; ``sampling``: GPUSIM_PROCESS_SAMPLE_MODE, ``period_us``:
    GPUSIM_PROCESS_SAMPLE_PERIOD_US (None: the simulator's defaults, as an H200's driver answers the limiter)."""
    root = tmp_path / "host"
    if not root.exists():
        install_sim_driver(root)
    env = sim_env(spec_dir() / "t4-x1.json", tmp_path / "node.state")
    if sampling is not None:
        env["GPUSIM_PROCESS_SAMPLE_MODE"] = sampling
    if period_us is not None:
        env["GPUSIM_PROCESS_SAMPLE_PERIOD_US"] = str(period_us)
    return subprocess.run(
        [sys.executable, "-m", "gpumanager.cli", "selftest", f"--driver-root={root}", *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=repo_root(),
    )


ALL_CHECKS = (
    "--memory-mib=1024",
    "--settle=1",
    "--measure=1.5",
    "--tolerance=12",
    "--limits=30,70",
    "--calls=20000",
)
#: The rows of the 30/70 pair (two containers on one GPU at once).
PAIR_ROWS = ("two containers: the 30 % one", "two containers: the 70 % one", "two containers together")


def _check_rows(out: str) -> dict[str, str]:
    """The table's check rows by name (``name  ok|FAIL|info  text``)."""
    rows = {}
    for line in out.splitlines():
        found = re.match(r"\s+(\S.*?)\s{2,}(ok|FAIL)\s{2,}", line)
        if found:
            rows[found.group(1)] = found.group(2)
    return rows


def test_every_check_passes_where_nvml_names_every_10ms_period(vcuda_built: Path, tmp_path: Path) -> None:
    """Every check, the 30/70 pair too, where NVML's answer holds every sampling period, each naming one process
    drawn by its GPU time (GPUSIM_PROCESS_SAMPLE_MODE=gpu: what a driver's whole buffer holds), at a 10 ms period
    (kinder than any real driver: at the H200's 200 ms the pair split 12.4/87.6 once)."""
    done = selftest(tmp_path, f"--vcuda-library={vcuda_built}", *ALL_CHECKS, sampling="gpu", period_us=0)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    _assert_the_table(out)


def test_every_check_but_the_pair_passes_as_an_h200_samples(vcuda_built: Path, tmp_path: Path) -> None:
    """The simulator's default sampling, as an H200 with driver 580.159 answers the limiter (one sample per process
    named since the query's start, each period naming the busiest process): every check but the pair's rows passes,
    as on that H200; those rows are reported, and judged by test_the_pair_splits_30_70_as_an_h200_samples."""
    done = selftest(tmp_path, f"--vcuda-library={vcuda_built}", *ALL_CHECKS)
    out = done.stdout
    rows = _check_rows(out)
    assert set(PAIR_ROWS) <= set(rows), out
    failed = [name for name, verdict in rows.items() if verdict == "FAIL" and name not in PAIR_ROWS]
    assert not failed, out + done.stderr
    assert done.returncode == (1 if any(rows[name] == "FAIL" for name in PAIR_ROWS) else 0), out + done.stderr
    _assert_the_table(out)


@pytest.mark.xfail(
    reason="known: where NVML names only the busiest process of each period (an H200, driver 580.159), the 30 % "
    "container is rarely named and is paced by the wall time its launches are outstanding (2.5-4.3 ms for 1 ms "
    "kernels here, as each waits for the other's time slice), and the 70 % one is charged the whole GPU's time of "
    "its periods: 8-18 % and 61-82 % (the H200: 9.7-30.1 % and 69.9-90.3 % of the pair)",
    strict=False,
)
def test_the_pair_splits_30_70_as_an_h200_samples(vcuda_built: Path, tmp_path: Path) -> None:
    done = selftest(tmp_path, f"--vcuda-library={vcuda_built}", *ALL_CHECKS, "--only=share")
    rows = _check_rows(done.stdout)
    assert all(rows.get(name) == "ok" for name in PAIR_ROWS), done.stdout + done.stderr


def _assert_the_table(out: str) -> None:
    for path in ("cuMemAlloc", "cuMemAllocAsync", "cuMemCreate + cuMemMap", "cuArray3DCreate", "graph memory node",
                 "cuMemAlloc (CUDA 2.0 ABI)"):  # fmt: skip
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(path + " "))
        assert " ok " in line and "held:" in line and "of 1024 MiB" in line, line
    assert "4 processes of one container" in out and "ESCAPED" not in out
    assert "cuMemGetInfo" in out and "nvmlDeviceGetMemoryInfo" in out
    assert "limit 30 %" in out and "limit 70 %" in out and "two containers: the 70 % one" in out
    assert "pass-through (cuDriverGetVersion)" in out and "cuLaunchKernel" in out
    assert "checks passed" in out.splitlines()[-1]


def test_an_escape_fails_the_selftest(vcuda_built: Path, tmp_path: Path) -> None:
    """Without an interceptor (the driver itself in its place) every allocation path escapes: exit 1."""
    del vcuda_built
    done = selftest(tmp_path, f"--vcuda-library={BUILD / 'sim' / 'libcuda.so.1'}", "--memory-mib=1024",
                    "--only=memory")  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    line = next(ln for ln in done.stdout.splitlines() if ln.strip().startswith("cuMemAlloc "))
    assert "FAIL" in line and "ESCAPED" in line and "on a 1024 MiB cap" in line
    assert "FAILED:" in done.stdout.splitlines()[-1]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--vcuda-library=/nonexistent/libcuda-control.so"], "--vcuda-library /nonexistent/libcuda-control.so"),
        (["--gpu=5"], "--gpu 5: this node has 1 GPU(s)"),
        (["--limits=30,120"], "every limit must be 1..99"),
        (["--only=memory,disk"], "choose from memory"),
    ],
)
def test_operator_errors_exit_2_naming_the_flag(
    vcuda_built: Path, tmp_path: Path, flags: list[str], message: str
) -> None:
    library = [] if any(f.startswith("--vcuda-library") for f in flags) else [f"--vcuda-library={vcuda_built}"]
    done = selftest(tmp_path, *library, *flags, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_a_driver_root_without_the_driver_is_named(vcuda_built: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    (empty / "etc").mkdir(parents=True)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpumanager.cli",
            "selftest",
            f"--driver-root={empty}",
            f"--vcuda-library={vcuda_built}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=repo_root(),
    )
    assert done.returncode == 2
    assert f"--driver-root {empty}" in done.stderr and "ld.so.cache" in done.stderr


def test_a_late_poll_of_nvml_counts_all_the_time_it_covers() -> None:
    """A loaded machine let 1.5 s pass between two polls: NVML's sample (70 % since the last one) covers
    all of it, not a second of it (which read a 70 % share as 47 %)."""
    spans: list[Span] = []
    start = 1_000_000
    assert credit(spans, [(42, start + 250_000, 70)], start) == start + 250_000
    newest = credit(spans, [(42, start + 1_750_000, 70)], start + 250_000)
    assert newest == start + 1_750_000
    assert share(spans, 42, (start, newest), (start, newest)) == pytest.approx(70.0)


def test_several_samples_of_one_process_in_one_answer_are_chained_not_overlapped() -> None:
    spans: list[Span] = []
    newest = credit(spans, [(7, 300, 20), (9, 200, 100), (7, 200, 60), (7, 100, 99)], 100)
    assert newest == 300
    # pid 7: 100..200 at 60 %, 200..300 at 20 % (the sample at the start itself covers nothing)
    assert sorted(spans, key=lambda sp: (sp.pid, sp.start_us)) == [
        Span(7, 100, 200, 60), Span(7, 200, 300, 20), Span(9, 100, 200, 100)]  # fmt: skip
    assert share(spans, 7, (100, 300), (100, newest)) == pytest.approx(40.0)
    assert share(spans, 9, (100, 300), (100, newest)) == pytest.approx(50.0)  # idle after its last sample


def test_the_share_is_read_over_the_programs_own_window_not_the_samplers() -> None:
    """The parent came late to stop sampling (a loaded machine): NVML was read for 2 s, the program ran
    at 70 % for the 1.2 s it measured and then ended. Spread over the sampler's 2 s that read 48 %."""
    spans: list[Span] = []
    t = 5_000_000
    since = t
    for k in range(1, 7):  # the program runs from t to t + 1.4 s; polls every 0.25 s
        since = credit(spans, [(42, t + k * 233_333, 70)], since)
    newest = credit(spans, [(99, t + 2_000_000, 5)], since)  # another process, after the program ended
    assert share(spans, 42, (t + 200_000, t + 1_400_000), (t, newest)) == pytest.approx(70.0, abs=0.01)
    # Nothing sampled inside the window: no share rather than 0 %.
    assert share(spans, 42, (t + 2_100_000, t + 2_500_000), (t, newest)) is None
