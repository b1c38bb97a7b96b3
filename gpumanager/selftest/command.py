"""``gpu-manager selftest [flags]``: run the isolation checks on one GPU of this node and print the table.

Exit codes: 0 when every check passed; 1 when any allocation escaped its cap, a share was more than
``--tolerance`` points off, or a check could not run; 2 for a bad flag or when something the
self-test needs is missing (the interceptor, the driver, NVIDIA's cuda-bindings).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from gpumanager.config import Config
from gpumanager.selftest import checks, programs
from gpumanager.selftest.mirror import SelftestError, check_interceptor, find_driver, lay_out

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
SECTIONS = ("memory", "views", "footprint", "share", "cost")


def _limits(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of percentages") from None
    if not values or any(not 1 <= v <= 99 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every limit must be 1..99")
    return values


def _sections(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in SECTIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(SECTIONS)}")
    return names


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _index(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an NVML index (0 or more)")
    return value


class _Parser(argparse.ArgumentParser):
    """Reports a bad flag in one line (exit 2), as the agent's own flags are, not after the usage summary."""

    def error(self, message: str) -> NoReturn:
        one_line = " ".join(message.split("\n"))
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The self-test's flags."""
    d = Config()
    p = _Parser(
        prog="gpu-manager selftest",
        allow_abbrev=False,  # whole flag names only, as the agent's: --mem is not --memory-mib
        description="Prove memory and SM isolation on this node's GPU with the installed interceptor.",
    )
    p.add_argument("--vcuda-library", default=d.vcuda_library, help="the interceptor (default %(default)s)")
    p.add_argument("--driver-root", default=d.driver_root, help="root of the host's driver files (%(default)s)")
    p.add_argument("--gpu", type=_index, default=0, help="NVML index of the GPU to test (default 0)")
    p.add_argument("--memory-mib", type=_positive_int, default=0,
                   help="the test container's memory cap (default: a quarter of the GPU, at most 4096 and at most "
                        "8/9 of what is free on it)")  # fmt: skip
    p.add_argument("--limits", type=_limits, default=(10, 30, 50, 70, 90),
                   help="SM limits to measure, in %% (default 10,30,50,70,90)")  # fmt: skip
    p.add_argument("--settle", type=_positive_float, default=2.0, help="seconds before a share is measured (default 2)")
    p.add_argument("--measure", type=_positive_float, default=4.0, help="seconds a share is measured over (default 4)")
    p.add_argument("--tolerance", type=_positive_float, default=3.0, help="points a share may be off (default 3)")
    p.add_argument("--calls", type=_positive_int, default=200_000, help="calls per cost measurement (default 200000)")
    p.add_argument("--only", type=_sections, default=SECTIONS,
                   help=f"sections to run, comma-separated: {','.join(SECTIONS)} (default: all)")  # fmt: skip
    return p


def _gpu(index: int) -> tuple[str, int, int]:
    """The GPU's UUID, its memory and the memory free on it now."""
    import pynvml

    count = pynvml.nvmlDeviceGetCount()
    if count == 0:
        raise SelftestError(f"--gpu {index}: NVML shows no GPU on this node")
    if not 0 <= index < count:
        raise SelftestError(f"--gpu {index}: this node has {count} GPU(s) (0..{count - 1})")
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return uuid.decode() if isinstance(uuid, bytes) else uuid, int(memory.total), int(memory.free)


#: Compute modes in which the checks cannot run: several processes of one container (the footprint check, the
#: 30/70 pair) need a context each, and a refused context reads as "no room" (NVML_COMPUTEMODE_*).
UNTESTABLE_COMPUTE_MODES = {1: "EXCLUSIVE_THREAD", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS"}


def _check_modes(index: int) -> None:
    """SelftestError when the GPU is in a mode the checks cannot run in: an exclusive (or prohibited) compute
    mode, or MIG (CUDA shows its instances, not the GPU). NOT_SUPPORTED or FUNCTION_NOT_FOUND (a GPU
    without MIG, a driver that does not say) is neither."""
    import pynvml

    unanswered = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    try:
        mode = int(pynvml.nvmlDeviceGetComputeMode(handle))
    except unanswered:
        mode = 0
    if mode in UNTESTABLE_COMPUTE_MODES:
        raise SelftestError(
            f"--gpu {index}: the GPU is in compute mode {UNTESTABLE_COMPUTE_MODES[mode]}; the checks run several "
            "processes with a context each on it, which this mode refuses (the footprint check would read the "
            "refusals as 'no room' and pass). Test it in DEFAULT mode (nvidia-smi -i "
            f"{index} -c DEFAULT), or test another GPU with --gpu"
        )
    try:
        current = int(pynvml.nvmlDeviceGetMigMode(handle)[0])
    except unanswered:
        current = 0
    if current == pynvml.NVML_DEVICE_MIG_ENABLE:
        raise SelftestError(
            f"--gpu {index}: the GPU is in MIG mode; CUDA shows its MIG instances, not the GPU, and the self-test "
            "cannot run on them. Test a GPU with MIG disabled (--gpu), or disable it (nvidia-smi -i "
            f"{index} -mig 0)"
        )


MEMORY_SECTIONS = {"memory", "views", "footprint"}
DEFAULT_CAP_MIB, SMALLEST_DEFAULT_CAP_MIB = 4096, 512


def _cap(args: argparse.Namespace, total: int, free: int) -> int:
    """The test container's memory cap.  The memory checks need the cap and an eighth more free on the GPU:
    an interceptor that lets allocations past the cap must be seen holding more than the cap, not stopped
    by a full GPU at or below it (which would pass as held)."""
    room = free * 8 // 9 // checks.MIB * checks.MIB
    memory_checks = bool(MEMORY_SECTIONS.intersection(args.only))
    if args.memory_mib:
        cap = int(args.memory_mib) * checks.MIB
        if memory_checks and cap > room:
            raise SelftestError(
                f"--memory-mib {args.memory_mib}: GPU {args.gpu} has {checks.mib(free)} free of {checks.mib(total)}; "
                f"the memory checks need the cap and an eighth more free (at most --memory-mib {room // checks.MIB}"
                " now), or the full GPU, not the cap, stops the allocations"
            )
        return cap
    cap = min(DEFAULT_CAP_MIB * checks.MIB, total // 4 // checks.MIB * checks.MIB)
    if not memory_checks:
        return cap
    if room < SMALLEST_DEFAULT_CAP_MIB * checks.MIB:
        raise SelftestError(
            f"--gpu {args.gpu}: {checks.mib(free)} free of {checks.mib(total)}, too little for the memory checks "
            f"(a cap of at least {SMALLEST_DEFAULT_CAP_MIB} MiB and an eighth more free); run them on an idle GPU, "
            "or leave them out with --only share,cost"
        )
    return min(cap, room)


def _has_cuda_bindings() -> bool:
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except ImportError:  # no package of the ``cuda`` namespace at all
        return False


def _check_bindings_for_driver() -> None:
    """SelftestError when the installed cuda-bindings is of a newer CUDA major version than the driver runs:
    cuda-bindings N.x needs a driver of CUDA N.0 or newer (NVIDIA's minor-version compatibility: 12.x from
    driver 525.60.13, 13.x from 580), and with an older one every program would fail on its own."""
    import pynvml

    try:
        version = importlib.metadata.version("cuda-bindings")
        major = int(version.split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return  # installed some other way (a source tree): the programs say what fails
    try:
        cuda = int(pynvml.nvmlSystemGetCudaDriverVersion_v2())
        driver = pynvml.nvmlSystemGetDriverVersion()
    except pynvml.NVMLError:
        return
    driver = driver.decode() if isinstance(driver, bytes) else str(driver)
    if major * 1000 > cuda:
        have = f"{cuda // 1000}.{cuda % 1000 // 10}"
        fix = (
            f"pip install 'cuda-bindings>=12.9,<{cuda // 1000 + 1}' (or upgrade the driver)"
            if cuda >= 12000
            else "the self-test needs a driver of CUDA 12.0 (525.60.13) or newer"
        )
        raise SelftestError(
            f"NVIDIA's cuda-bindings {version} needs a driver of CUDA {major}.0 or newer; this node's driver "
            f"{driver} runs CUDA {have}: {fix}"
        )


def run(args: argparse.Namespace) -> int:
    """The self-test; returns the exit code."""
    if not _has_cuda_bindings():
        raise SelftestError(
            "the self-test runs its CUDA programs with NVIDIA's cuda-bindings, which is not installed: "
            "pip install 'gpu-manager[selftest]' (the gpu-manager image has it)"
        )
    interceptor = Path(args.vcuda_library)
    if interceptor.is_dir():
        raise SelftestError(f"--vcuda-library {interceptor}: is a directory, not the interceptor's file")
    if not interceptor.is_file():
        raise SelftestError(f"--vcuda-library {interceptor}: no such file")
    check_interceptor(interceptor)
    driver = find_driver(Path(args.driver_root))
    from gpumanager.device import nvml

    try:
        nvml.init(str(driver.libnvml))
    except nvml.NVMLUnavailableError as err:
        raise SelftestError(f"--driver-root {args.driver_root}: {err}") from err
    import pynvml

    _check_bindings_for_driver()
    try:
        uuid, total, free = _gpu(args.gpu)
        _check_modes(args.gpu)
    except pynvml.NVMLError as err:
        raise SelftestError(f"--gpu {args.gpu}: NVML cannot read this GPU: {err}") from err
    cap = _cap(args, total, free)
    started = time.monotonic()
    print(f"gpu-manager selftest: GPU {args.gpu} ({uuid}, {checks.mib(total)}), interceptor {interceptor}")
    print(f"  driver {driver.libcuda}, {driver.libnvml}; test container cap {checks.mib(cap)}", flush=True)
    try:
        holder = tempfile.TemporaryDirectory(prefix="gpu-manager-selftest-")
    except OSError as err:
        raise SelftestError(
            f"no writable temporary directory for the test's driver directories ({tempfile.tempdir or '$TMPDIR, /tmp'}"
            f": {err}); set TMPDIR to a writable directory"
        ) from err
    with holder as tmp:
        work = Path(tmp)
        try:
            direct, mirror = lay_out(work, driver, interceptor.resolve())
        except OSError as err:
            raise SelftestError(f"{work}: cannot lay out the test's driver directories: {err}; set TMPDIR to a "
                                "writable directory") from err  # fmt: skip
        setup = checks.Setup(uuid=uuid, gpu_index=args.gpu, gpu_total=total, work=work, mirror=mirror, direct=direct,
                             cap=cap, settle=args.settle, measure=args.measure, tolerance=args.tolerance,
                             calls=args.calls)  # fmt: skip
        _probe(setup)
        rows: list[checks.Row] = []
        plan = (
            ("memory", checks.allocation_paths),
            ("views", checks.memory_views),
            ("footprint", checks.four_processes),
            ("share", lambda s: checks.sm_shares(s, args.limits)),
            ("cost", checks.call_costs),
        )
        for name, check in plan:
            if name in args.only:
                try:
                    rows.extend(check(setup))
                except OSError as err:  # the work directory (disk full) or a child that could not start
                    rows.append(checks.Row(name, name, f"error: {err}", False))
    print_table(rows)
    print(f"\n{summary(rows, time.monotonic() - started)}")
    return EXIT_FAILED if any(not r.ok for r in rows) else EXIT_OK


def _probe(setup: checks.Setup) -> None:
    """SelftestError unless CUDA, without the interceptor, makes a context on the GPU: NVML can read a GPU that
    CUDA cannot use (no ``/dev/nvidia-uvm`` in the pod, no permission on the device files, a broken
    cuda-bindings), and every check would fail with the same error."""
    try:
        answer = checks.run_child(programs.PROBE, {"uuid": setup.uuid}, setup.plain())
    except checks.ChildError as err:
        reason = str(err)
    else:
        if answer.get("context") == "CUDA_SUCCESS":
            return
        reason = f"no context: {answer.get('context')}"
    raise SelftestError(
        f"--gpu {setup.gpu_index}: CUDA cannot use {setup.uuid} without the interceptor ({reason}); check that the "
        "device files (/dev/nvidia*, /dev/nvidia-uvm) are there and readable, and that cuda-bindings imports"
    )


def summary(rows: Sequence[checks.Row], seconds: float) -> str:
    """The last line: checks passed of checks run (informational rows are not checks), and the failed ones."""
    counted = [r for r in rows if not r.informational or not r.ok]
    failed = [r for r in counted if not r.ok]
    return f"{len(counted) - len(failed)} of {len(counted)} checks passed in {seconds:.0f} s" + (
        f"; FAILED: {', '.join(r.name for r in failed)}" if failed else ""
    )


def print_table(rows: Sequence[checks.Row]) -> None:
    """The one table: section, check, verdict (``info``: a measurement, not a check), result."""
    width = max((len(r.name) for r in rows), default=10)
    section = ""
    for r in rows:
        if r.section != section:
            section = r.section
            print(f"\n{section}")
        verdict = "FAIL" if not r.ok else "info" if r.informational else "ok  "
        print(f"  {r.name:<{width}}  {verdict}  {r.result}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gpu-manager selftest``."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except SelftestError as err:
        print(f"gpu-manager selftest: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\ngpu-manager selftest: interrupted; the checks did not finish (exit 1)", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
