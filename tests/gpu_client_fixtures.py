"""The gpu-client binaries (vcuda/client/), built once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from simnode.gpusim_state import repo_root
from tests.make_lock import run_make

VCUDA = repo_root() / "vcuda"
CLIENT = VCUDA / "build" / "gpu-client"
ASAN_CLIENT = VCUDA / "build" / "asan" / "gpu-client"


def build_client() -> Path:
    """``make -C vcuda client`` (incremental): the static client and its sanitizer build."""
    done = run_make(
        ["make", "-C", str(VCUDA), "client", f"PYTHON={sys.executable}"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"make -C vcuda client failed:\n{done.stdout}{done.stderr}")
    return CLIENT


@pytest.fixture(scope="session")
def client_built() -> Path:
    """vcuda/build/gpu-client (and vcuda/build/asan/gpu-client)."""
    return build_client()
