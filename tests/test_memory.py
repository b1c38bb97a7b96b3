"""The agent caps glibc's malloc arenas, unless the operator chose a number."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpumanager.memory import ARENAS, QuietTrim, limit_malloc_arenas
from tests.wakeups import ASLEEP, idle_switches, named_thread, wait_until

# Threads calling malloc and free through ctypes (which lets go of the GIL) contend for the
# allocator as the agent's gRPC threads do; glibc's malloc_info then lists the arenas in use.
PROGRAM = textwrap.dedent(
    """
    import ctypes, json, os, sys, threading
    from gpumanager.memory import limit_malloc_arenas
    limited = limit_malloc_arenas() if sys.argv[1] == "limit" else False
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    start = threading.Barrier(16)

    def churn():
        start.wait()
        for _ in range(3000):
            libc.free(libc.malloc(4096))

    threads = [threading.Thread(target=churn) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = sys.argv[2].encode()
    f = libc.fopen(out, b"w")
    libc.malloc_info(0, f)
    libc.fclose(f)
    text = open(out).read()
    print(json.dumps({"limited": limited, "heaps": text.count("<heap nr=")}))
    """
)


def _arenas(mode: str, tmp_path: Path, env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode, str(tmp_path / f"{mode}.xml")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_contending_threads_share_at_most_two_arenas(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    free = _arenas("free", tmp_path, env)
    limited = _arenas("limit", tmp_path, env)
    assert limited["limited"] is True
    assert isinstance(limited["heaps"], int) and 1 <= limited["heaps"] <= ARENAS
    # The check can fail: without the cap the same threads spread over more arenas.
    assert isinstance(free["heaps"], int) and free["heaps"] > ARENAS


def test_the_operators_setting_wins() -> None:
    assert limit_malloc_arenas({"MALLOC_ARENA_MAX": "8"}) is False


# Blocks of the main heap freed in long runs between blocks still in use: only malloc_trim gives
# their pages back (the top of the heap is held, so free() alone cannot shrink it).
HOLES = textwrap.dedent(
    """
    import ctypes, json
    from gpumanager.memory import trim
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096

    blocks = [libc.malloc(64 << 10) for _ in range(1000)]
    for b in blocks:
        libc.memset(b, 1, 64 << 10)
    for i, b in enumerate(blocks):
        if i % 10:
            libc.free(b)
    before = rss()
    trimmed = trim()
    print(json.dumps({"trimmed": trimmed, "freed": before - rss()}))
    """
)


def test_trim_gives_freed_heap_pages_back() -> None:
    done = subprocess.run([sys.executable, "-c", HOLES], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["trimmed"] is True
    assert result["freed"] > 32 << 20  # of the ~56 MiB freed in runs of 576 KiB


def test_quiet_trim_sleeps_until_poked_and_trims_once_after_the_last_poke() -> None:
    trims: list[float] = []

    def counted() -> bool:
        trims.append(time.monotonic())
        return True

    quiet = QuietTrim(quiet=0.3, trim=counted)
    quiet.start()
    try:
        assert idle_switches(named_thread("memory-trim")) <= ASLEEP and trims == []
        last = 0.0
        for _ in range(5):  # a burst of changes: one trim, once they stop
            quiet.poke()
            last = time.monotonic()
            time.sleep(0.05)
        wait_until(lambda: trims, "a trim after the burst")
        assert len(trims) == 1 and trims[0] - last >= 0.3
        time.sleep(0.5)
        assert len(trims) == 1
    finally:
        quiet.stop()


def test_settling_after_the_start_takes_what_lives_out_of_the_collectors_walk() -> None:
    program = textwrap.dedent(
        """
        import gc, json, time
        import gpumanager.app, gpumanager.metrics.query  # what an agent has loaded once started
        from gpumanager.memory import settle_after_start

        class Node:
            pass

        def cycle():
            a, b = Node(), Node()
            a.other, b.other = b, a
            return a

        cycle()  # garbage the start left
        settle_after_start()
        frozen = gc.get_freeze_count()
        cycle()  # garbage made later is still collected
        found = gc.collect()
        print(json.dumps({"frozen": frozen, "found": found, "tracked": len(gc.get_objects())}))
        """
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["frozen"] > 10_000  # modules, classes, functions: never garbage
    assert result["found"] >= 2
    assert result["tracked"] < 1_000  # what a full collection walks now
