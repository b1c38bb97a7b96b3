"""Shared fixtures; the guard that keeps the tests off the host's agent directories (tests/host_paths.py);
and a short temporary root for the tests' unix sockets."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent_fixtures import kubelet, sim_built, start_agent

pytest_plugins = ["tests.host_paths"]

__all__ = ["kubelet", "sim_built", "start_agent"]

#: A unix socket's path holds at most 107 bytes. pytest's own root, /tmp/pytest-of-<user>/pytest-<N>,
#: grows a digit as N counts the runs of the machine: past a thousand runs, the sockets of the
#: simulated node under it no longer fit. Each run gets a directory of its own under this root instead.
SHORT_ROOT = Path(tempfile.gettempdir()) / f"gmt-{os.getuid()}"
KEEP_RUNS = 3  # as pytest keeps its last three; only ones an hour old are removed (others may still run)
STALE_SECONDS = 3600.0


def pytest_configure(config: pytest.Config) -> None:
    if config.option.basetemp is not None or hasattr(config, "workerinput"):
        return  # given on the command line, or an xdist worker (it gets the controller's)
    SHORT_ROOT.mkdir(mode=0o700, exist_ok=True)
    runs = sorted(SHORT_ROOT.iterdir(), key=_mtime)
    for old in runs[: max(0, len(runs) - (KEEP_RUNS - 1))]:
        if time.time() - _mtime(old) > STALE_SECONDS:
            shutil.rmtree(old, ignore_errors=True)
    config.option.basetemp = tempfile.mkdtemp(dir=SHORT_ROOT)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked xfail measures a known limit (its reason says which): it is marked ``known_limit`` too, which
    ``make test`` leaves out and ``make test-known`` runs (an xfail cannot fail the run; each costs seconds)."""
    for item in items:
        if item.get_closest_marker("xfail") is not None:
            item.add_marker(pytest.mark.known_limit)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


@pytest.fixture
def clean_logging() -> Iterator[None]:
    """The root logger as the test found it after a test that let the agent's CLI configure logging."""
    yield
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    root.setLevel(logging.WARNING)
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = True
