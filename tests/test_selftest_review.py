"""gpu-manager selftest: missing pieces, hanging children and NVML answers that cannot tell."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from gpumanager.selftest import checks, command, mirror, programs
from simnode.gpusim_state import GpuSimState, repo_root
from simnode.simhost import _ldconfig, install_sim_driver

MIB = 1 << 20


def test_no_cuda_package_at_all_is_a_clear_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Neither cuda-bindings nor any other package of the ``cuda`` namespace is installed.
    monkeypatch.setitem(sys.modules, "cuda", None)  # type: ignore[arg-type]
    monkeypatch.delitem(sys.modules, "cuda.bindings", raising=False)
    assert command.main(["--driver-root", str(tmp_path)]) == command.EXIT_USAGE
    err = capsys.readouterr().err
    assert "cuda-bindings" in err
    assert "Traceback" not in err


HANG = "import time\ntime.sleep(60)\n"


def _setup(tmp_path: Path) -> checks.Setup:
    return checks.Setup(uuid="GPU-00000000-0000-0000-0000-000000000000", gpu_index=0, gpu_total=1 << 34,
                        work=tmp_path, mirror=tmp_path / "mirror", direct=tmp_path / "direct", cap=1 << 30,
                        settle=0.1, measure=0.1, tolerance=3.0, calls=10)  # fmt: skip


def _within(seconds: float, call: Callable[[], object]) -> object:
    """``call()``'s value or exception, or a test failure when it has not returned after ``seconds``."""
    box: list[object] = []

    def target() -> None:
        try:
            box.append(call())
        except BaseException as err:  # handed to the test
            box.append(err)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    return box[0]


def test_a_child_that_never_answers_is_an_error_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checks, "CHILD_TIMEOUT", 1.0)
    result = _within(20, lambda: checks.run_held(HANG, {}, dict(os.environ), "GPU-x"))
    assert isinstance(result, checks.ChildError)
    assert "no answer within" in str(result)


def test_memory_rows_say_error_when_the_program_hangs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(checks, "CHILD_TIMEOUT", 1.0)
    monkeypatch.setattr(checks, "ALLOCATION_PATHS", ("cuMemAlloc",))
    monkeypatch.setattr(programs, "ALLOCATE", HANG)
    rows = _within(20, lambda: checks.allocation_paths(_setup(tmp_path)))
    assert isinstance(rows, list)
    assert [(r.name, r.ok) for r in rows] == [("cuMemAlloc", False)]
    assert "no answer within" in rows[0].result


def test_four_processes_that_hang_are_an_error_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(checks, "CHILD_TIMEOUT", 1.0)
    monkeypatch.setattr(programs, "HOLD", HANG)
    rows = _within(30, lambda: checks.four_processes(_setup(tmp_path)))
    assert isinstance(rows, list)
    assert len(rows) == 1 and not rows[0].ok
    assert "no answer within" in rows[0].result


class _NoSampler:
    def __init__(self, gpu_index: int) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def share(self, pid: int, window: tuple[int, int]) -> float | None:
        return None


def test_a_launch_loop_that_hangs_is_an_error_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(checks, "CHILD_TIMEOUT", 1.0)
    monkeypatch.setattr(checks, "UtilSampler", _NoSampler)
    # Starts its loop, then never finishes it (a launch or the final synchronize that does not return).
    monkeypatch.setattr(programs, "SPIN", "print('running', flush=True)\n" + HANG)
    rows = _within(30, lambda: checks.sm_shares(_setup(tmp_path), [30]))
    assert isinstance(rows, list), rows
    assert len(rows) == 1 and not rows[0].ok
    assert "no answer within" in rows[0].result


def test_a_launch_loop_that_never_starts_is_an_error_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(checks, "CHILD_TIMEOUT", 1.0)
    monkeypatch.setattr(checks, "UtilSampler", _NoSampler)
    monkeypatch.setattr(programs, "SPIN", HANG)
    rows = _within(30, lambda: checks.sm_shares(_setup(tmp_path), [30]))
    assert isinstance(rows, list), rows
    assert len(rows) == 1 and not rows[0].ok
    assert "no answer within" in rows[0].result


def _processes(monkeypatch: pytest.MonkeyPatch, answer: Callable[[object], list[SimpleNamespace]]) -> None:
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", lambda uuid: "handle")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", answer)


def test_nvml_without_per_process_memory_cannot_tell(monkeypatch: pytest.MonkeyPatch) -> None:
    # NVML lists the process but cannot say its memory (NVML_VALUE_NOT_AVAILABLE: pynvml gives None).
    _processes(monkeypatch, lambda handle: [SimpleNamespace(pid=4242, usedGpuMemory=None)])
    assert checks.nvml_held("GPU-x", {4242}) is None


def test_nvml_that_fails_is_an_error_not_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(handle: object) -> list[SimpleNamespace]:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    _processes(monkeypatch, fail)
    with pytest.raises(checks.ChildError, match="NVML"):
        checks.nvml_held("GPU-x", {4242})


def _sim_selftest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    install_sim_driver(tmp_path / "host")
    env = dict(os.environ, GPUSIM_SPEC=str(repo_root() / "deploy" / "sim" / "t4-x1.json"),
               GPUSIM_STATE=str(tmp_path / "node.state"))  # fmt: skip
    library = repo_root() / "vcuda" / "build" / "libcuda-control.so"
    return subprocess.run(
        [sys.executable, "-m", "gpumanager.cli", "selftest", "--driver-root", str(tmp_path / "host"),
         "--vcuda-library", str(library), *args],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_a_cap_larger_than_the_gpu_is_refused_not_passed(tmp_path: Path) -> None:
    # The T4 has 15360 MiB: the driver, not the cap, would stop every allocation, and all would "pass".
    done = _sim_selftest(tmp_path, "--only", "memory", "--memory-mib", "20000")
    assert done.returncode == command.EXIT_USAGE, done.stdout
    assert "--memory-mib 20000" in done.stderr and "MiB free" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_busy_gpu_shrinks_the_default_cap_below_what_is_free(tmp_path: Path) -> None:
    install_sim_driver(tmp_path / "host")
    with GpuSimState(tmp_path / "node.state") as state:
        state.set_process(0, os.getpid(), 13000 * MIB)  # 2360 MiB left of 15360
    done = _sim_selftest(tmp_path, "--only", "memory")
    assert done.returncode == command.EXIT_OK, done.stdout + done.stderr
    cap = int(done.stdout.split("test container cap ")[1].split(" MiB")[0])
    assert cap * 9 // 8 <= 2360


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build a library with a soname")
def test_the_driver_helpers_libcuda_opens_by_soname_are_in_both_directories(tmp_path: Path) -> None:
    # In the agent's pod the image's ld.so.cache knows nothing of the host's driver: libcuda's PTX JIT
    # (libnvidia-ptxjitcompiler.so.1, dlopened by soname) is found only beside it on LD_LIBRARY_PATH.
    root = tmp_path / "host"
    libdir = install_sim_driver(root)
    name = "libnvidia-ptxjitcompiler.so"
    source = tmp_path / "jit.c"
    source.write_text("int ptx_jit(void) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{name}.1", "-o", str(libdir / f"{name}.550.54.15"),
                    str(source)], check=True)  # fmt: skip
    subprocess.run([_ldconfig(), "-r", str(root), "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache"], check=True)
    driver = mirror.find_driver(root)
    (tmp_path / "work").mkdir()
    direct, mirrored = mirror.lay_out(tmp_path / "work", driver, repo_root() / "vcuda" / "build" / "libcuda-control.so")
    for directory in (direct, mirrored):
        assert (directory / f"{name}.1").resolve() == (libdir / f"{name}.550.54.15").resolve()


def _sim_env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, LD_LIBRARY_PATH=str(repo_root() / "vcuda" / "build" / "sim"),
                GPUSIM_SPEC=str(repo_root() / "deploy" / "sim" / "t4-x1.json"),
                GPUSIM_STATE=str(tmp_path / "node.state"))  # fmt: skip


ABSENT = "GPU-00000000-1111-2222-3333-444444444444"


def test_a_gpu_cuda_does_not_show_is_named_in_the_error(tmp_path: Path) -> None:
    # CUDA does not show the GPU NVML chose (CUDA_VISIBLE_DEVICES, a GPU in MIG mode): say so, by UUID.
    with pytest.raises(checks.ChildError, match=ABSENT):
        checks.run_held(programs.VIEWS, {"uuid": ABSENT, "alloc": MIB}, _sim_env(tmp_path), ABSENT)


def test_the_cost_program_does_not_measure_another_gpu(tmp_path: Path) -> None:
    with pytest.raises(checks.ChildError, match=ABSENT):
        checks.run_child(programs.COST, {"uuid": ABSENT, "ptx": programs.PTX, "calls": 10}, _sim_env(tmp_path))


def test_the_operators_visible_devices_do_not_hide_the_gpu(tmp_path: Path) -> None:
    setup = _setup(tmp_path)
    setup.base_env = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "1"}
    assert "CUDA_VISIBLE_DEVICES" not in setup.plain()
    assert "CUDA_VISIBLE_DEVICES" not in setup.container(memory=MIB)


def test_a_lost_gpu_is_named_not_a_traceback(tmp_path: Path) -> None:
    install_sim_driver(tmp_path / "host")
    with GpuSimState(tmp_path / "node.state") as state:
        state.set_lost(0)
    done = _sim_selftest(tmp_path, "--only", "memory")
    assert done.returncode == command.EXIT_USAGE, done.stdout + done.stderr
    assert "--gpu 0" in done.stderr and "lost" in done.stderr.lower()
    assert "Traceback" not in done.stderr


def test_no_writable_temporary_directory_is_named_not_a_traceback(tmp_path: Path) -> None:
    install_sim_driver(tmp_path / "host")
    library = repo_root() / "vcuda" / "build" / "libcuda-control.so"
    code = (
        "import sys, tempfile\n"
        "tempfile.tempdir = '/proc'\n"  # a directory nobody can create anything in
        "from gpumanager.selftest import main\n"
        f"sys.exit(main(['--driver-root', {str(tmp_path / 'host')!r}, '--vcuda-library', {str(library)!r},"
        " '--only', 'cost']))\n"
    )
    env = _sim_env(tmp_path)
    del env["LD_LIBRARY_PATH"]
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip
    assert done.returncode == command.EXIT_USAGE, done.stdout + done.stderr
    assert "/proc" in done.stderr and "TMPDIR" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_interrupted_selftest_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "run", interrupted)
    assert command.main([]) == command.EXIT_FAILED
    assert "interrupted" in capsys.readouterr().err


def test_a_gpu_lost_before_the_share_section_is_its_error_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The GPU was read at the start; by the share section NVML no longer finds it.
    def lost(index: int) -> object:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lost)
    rows = checks.sm_shares(_setup(tmp_path), [30])
    assert [(r.section, r.ok) for r in rows] == [("SM share", False)]
    assert "NVML" in rows[0].result and "lost" in rows[0].result.lower()


def _patched_interceptor(tmp_path: Path, offset: int, value: bytes) -> Path:
    """A copy of the interceptor with bytes of its ELF header changed."""
    data = bytearray((repo_root() / "vcuda" / "build" / "libcuda-control.so").read_bytes())
    data[offset : offset + len(value)] = value
    path = tmp_path / "libcuda-control.so"
    path.write_bytes(bytes(data))
    return path


def _selftest_with(tmp_path: Path, library: Path) -> subprocess.CompletedProcess[str]:
    install_sim_driver(tmp_path / "host")
    env = dict(os.environ, GPUSIM_SPEC=str(repo_root() / "deploy" / "sim" / "t4-x1.json"),
               GPUSIM_STATE=str(tmp_path / "node.state"))  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "gpumanager.cli", "selftest", "--driver-root", str(tmp_path / "host"),
         "--vcuda-library", str(library), "--only", "memory"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _refused(done: subprocess.CompletedProcess[str], library: Path, what: str) -> None:
    assert done.returncode == command.EXIT_USAGE, done.stdout + done.stderr
    assert str(library) in done.stderr and what in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert "ESCAPED" not in done.stdout


def test_a_file_that_is_not_a_library_is_named_not_run_without(tmp_path: Path) -> None:
    library = tmp_path / "libcuda-control.so"
    library.write_text("<html>404 Not Found</html>\n")
    _refused(_selftest_with(tmp_path, library), library, "not an ELF")


def test_an_interceptor_for_another_machine_is_named_not_run_without(tmp_path: Path) -> None:
    library = _patched_interceptor(tmp_path, 18, (183).to_bytes(2, "little"))  # e_machine: EM_AARCH64
    _refused(_selftest_with(tmp_path, library), library, "EM_AARCH64")


def test_a_32_bit_interceptor_is_named_not_run_without(tmp_path: Path) -> None:
    library = _patched_interceptor(tmp_path, 4, b"\x01")  # EI_CLASS: ELFCLASS32
    _refused(_selftest_with(tmp_path, library), library, "32-bit")


def test_a_library_without_the_interceptors_entry_points_is_named(tmp_path: Path) -> None:
    library = repo_root() / "vcuda" / "build" / "sim" / "libnvidia-ml.so.1"  # a library, but no cu* at all
    done = _selftest_with(tmp_path, library)
    _refused(done, library, "cuMemAlloc_v2")


def _selftest_with_nvml(tmp_path: Path, patch: str) -> subprocess.CompletedProcess[str]:
    """The self-test on the simulated node, in a process whose pynvml answers as ``patch`` makes it."""
    install_sim_driver(tmp_path / "host")
    library = repo_root() / "vcuda" / "build" / "libcuda-control.so"
    code = (
        "import sys, pynvml\n"
        f"{patch}\n"
        "from gpumanager.selftest import main\n"
        f"sys.exit(main(['--driver-root', {str(tmp_path / 'host')!r}, '--vcuda-library', {str(library)!r},"
        " '--only', 'footprint']))\n"
    )
    env = _sim_env(tmp_path)
    del env["LD_LIBRARY_PATH"]
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip


@pytest.mark.parametrize(
    ("mode", "name"),
    [
        (pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS, "EXCLUSIVE_PROCESS"),
        (pynvml.NVML_COMPUTEMODE_PROHIBITED, "PROHIBITED"),
    ],
)
def test_a_gpu_in_an_exclusive_compute_mode_is_refused(tmp_path: Path, mode: int, name: str) -> None:
    # Four processes of one container cannot all have a context: refused contexts read as "no room", and pass.
    done = _selftest_with_nvml(tmp_path, f"pynvml.nvmlDeviceGetComputeMode = lambda handle: {mode}")
    assert done.returncode == command.EXIT_USAGE, done.stdout + done.stderr
    assert "--gpu 0" in done.stderr and name in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "4 processes" not in done.stdout


def test_a_gpu_in_mig_mode_is_refused(tmp_path: Path) -> None:
    done = _selftest_with_nvml(tmp_path, "pynvml.nvmlDeviceGetMigMode = lambda handle: [1, 1]")
    assert done.returncode == command.EXIT_USAGE, done.stdout + done.stderr
    assert "--gpu 0" in done.stderr and "MIG" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "4 processes" not in done.stdout


def test_a_gpu_whose_mig_mode_is_only_pending_is_tested(tmp_path: Path) -> None:
    # MIG enabled but not active before a reset: the GPU still runs as one device.
    done = _selftest_with_nvml(tmp_path, "pynvml.nvmlDeviceGetMigMode = lambda handle: [0, 1]")
    assert done.returncode == command.EXIT_OK, done.stdout + done.stderr
    assert "4 processes of one container" in done.stdout


def test_memory_views_without_nvmls_count_cannot_tell(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # NVML does not list the process: what it holds is known only from the interceptor's own answers, so
    # comparing those answers with it checks the interceptor against itself.
    setup = _setup(tmp_path)
    monkeypatch.setattr(setup, "container", lambda **kw: {})
    cap, used = setup.cap, 256 * MIB
    views = {"free": cap - used, "total": cap, "device_total": cap, "nvml_total": cap, "nvml_used": used}
    monkeypatch.setattr(checks, "run_held", lambda *args: (views, None))
    rows = {r.name: r for r in checks.memory_views(setup)}
    for name in ("cuMemGetInfo", "nvmlDeviceGetMemoryInfo"):
        assert not rows[name].ok and "cannot tell" in rows[name].result, rows[name]
    assert rows["cuDeviceTotalMem"].ok


def test_memory_views_without_nvmls_count_still_fail_a_wrong_total(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    setup = _setup(tmp_path)
    monkeypatch.setattr(setup, "container", lambda **kw: {})
    gpu = setup.gpu_total
    views = {"free": gpu // 2, "total": gpu, "device_total": gpu, "nvml_total": gpu, "nvml_used": gpu // 2}
    monkeypatch.setattr(checks, "run_held", lambda *args: (views, None))
    rows = checks.memory_views(setup)
    assert not any(r.ok for r in rows)
    assert all("total" in r.result or "MiB" in r.result for r in rows)


def test_cost_rows_are_shown_but_not_counted_as_checks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A cost has no pass condition: it cannot fail, so counting it would only pad "N of N checks passed".
    setup = _setup(tmp_path)
    monkeypatch.setattr(setup, "container", lambda **kw: {})
    monkeypatch.setattr(setup, "plain", lambda: {})
    cost = {"passthrough": 20.0, "alloc_free": 900.0, "launch": 3000.0}
    monkeypatch.setattr(checks, "run_child", lambda *args: cost)
    rows = [checks.Row("views", "cuDeviceTotalMem", "1024 MiB", True), *checks.call_costs(setup)]
    command.print_table(rows)
    table = capsys.readouterr().out
    cost_lines = [line for line in table.splitlines() if "ns without" in line]
    assert len(cost_lines) == 3 and all(" info " in line and " ok " not in line for line in cost_lines), table
    assert command.summary(rows, 1.0).startswith("1 of 1 checks passed")


def test_cost_programs_that_fail_are_a_failed_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    setup = _setup(tmp_path)
    monkeypatch.setattr(setup, "container", lambda **kw: {})
    monkeypatch.setattr(setup, "plain", lambda: {})

    def fail(*args: object) -> dict[str, float]:
        raise checks.ChildError("cuInit: 999")

    monkeypatch.setattr(checks, "run_child", fail)
    rows = checks.call_costs(setup)
    assert command.summary(rows, 1.0).startswith("0 of 1 checks passed")


def test_a_node_without_gpus_says_so_without_a_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 0)
    with pytest.raises(mirror.SelftestError) as raised:
        command._gpu(0)
    assert "--gpu 0" in str(raised.value) and "no GPU" in str(raised.value)
    assert "-1" not in str(raised.value)
