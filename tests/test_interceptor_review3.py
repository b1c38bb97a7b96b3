"""The container's budget file where it cannot be shared (a full or unusable budget directory), and processes
forked while other threads allocate.

Each case is a C program (vcuda/tests/review3_*.c, built with the project's warnings, and once more under
AddressSanitizer/UBSan against the sanitizer builds of the interceptor and the simulated driver) run in a
simulated container.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.test_interceptor_review2 import asan_built, asan_mirror, build_program
from tests.vcuda_fixtures import Container, container, last_json, vcuda_built

__all__ = ["asan_built", "container", "vcuda_built"]  # fixtures

MakeContainer = Callable[..., Container]


def run(c: Container, argv: list[str], mirror: Path | None, env_over: dict[str, str] | None = None,
        timeout: float = 180) -> tuple[subprocess.CompletedProcess[str], dict[str, object] | None]:  # fmt: skip
    env = c.env(**(env_over or {}))
    if mirror is not None:
        env["LD_LIBRARY_PATH"] = str(mirror)
        env["ASAN_OPTIONS"] = "detect_leaks=0"
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    try:
        out = last_json(done.stdout)
    except Exception:
        out = None
    return done, out if isinstance(out, dict) else None


def can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=64k t /mnt"],
                           capture_output=True, check=False)  # fmt: skip
    return probe.returncode == 0


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_a_full_budget_directory_leaves_the_process_running_with_a_limit_of_its_own(
    container: MakeContainer, asan_built: Path, tmp_path: Path, sanitize: bool
) -> None:
    """/dev/shm (the budget directory) is full: a new budget file can be created and sized with ftruncate (a
    tmpfs file is sparse), but the first store into its mapping finds no page and the process dies of SIGBUS
    inside its first cuMemAlloc.  It must run on, with the limit enforced for it alone."""
    if not can_mount_tmpfs():
        pytest.skip("no user and mount namespaces here (unshare -Urm) to mount a small tmpfs")
    c = container(1024)
    exe = build_program("review3_budget", tmp_path, sanitize)
    mirror = asan_mirror(c, asan_built) if sanitize else None
    c.budget_dir.mkdir(parents=True, exist_ok=True)
    script = ('mount -t tmpfs -o size=64k full "$0" && { dd if=/dev/zero of="$0/fill" bs=4k 2>/dev/null; '
              'exec "$1" alloc "$2"; }')  # fmt: skip
    done, out = run(c, ["unshare", "-Urm", "sh", "-c", script, str(c.budget_dir), str(exe), "64"], mirror)
    assert done.returncode == 0 and out is not None, f"rc {done.returncode}: {done.stdout}{done.stderr}"
    assert out["alloc"] == 0, out
    assert "per process only" in done.stderr, done.stderr
    # the limit still holds for the process: 1100 MiB of a 1024 MiB container is refused
    done, out = run(c, ["unshare", "-Urm", "sh", "-c", script, str(c.budget_dir), str(exe), "1100"], mirror)
    assert done.returncode == 0 and out is not None, f"rc {done.returncode}: {done.stdout}{done.stderr}"
    assert out["alloc"] == 2, out  # CUDA_ERROR_OUT_OF_MEMORY


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_a_child_forked_without_a_shared_budget_neither_hangs_nor_inherits_its_parents_charges(
    container: MakeContainer, asan_built: Path, tmp_path: Path, sanitize: bool
) -> None:
    """No shared budget file (its directory cannot be used): each process keeps its budget in private memory,
    lock included.  A process holding 600 MiB of a 1024 MiB container, with 16 threads allocating and freeing
    1 MiB, forks 40 children one by one (a data-loader's workers); each asks NVML for the GPU's memory.  A
    child forked while a thread held the private budget lock inherited it locked, by a thread that does not
    exist in the child: its NVML query waited forever.  The others were told of a frozen copy of their
    parent's charges (its 600 MiB and context), which nothing in the child ever frees, as their own.  No
    child may hang, and a child that allocated nothing uses nothing."""
    c = container(1024)
    exe = build_program("review3_budget", tmp_path, sanitize)
    mirror = asan_mirror(c, asan_built) if sanitize else None
    blocker = c.root / "not-a-directory"
    blocker.write_text("")
    done, out = run(c, [str(exe), "fork", "600", "16", "40"], mirror,
                    {"VCUDA_BUDGET_DIR": str(blocker / "shm")})  # fmt: skip
    assert done.returncode == 0 and out is not None, f"rc {done.returncode}: {done.stdout}{done.stderr}"
    assert out["stuck"] == 0, f"a forked child waited forever on a lock: {out}"
    assert out["ok"] == out["forks"] == 40, out
    assert out["child_used_mib"] == 0, f"a child was charged its parent's memory: {out}"
