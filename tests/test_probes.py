"""/healthz and /readyz of the agent (gpumanager.metrics.endpoints), on the agent's parts alone."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any, cast

import pytest

from gpumanager.allocation.check import AllocationCheck
from gpumanager.metrics.endpoints import _liveness


def _check() -> AllocationCheck:
    return AllocationCheck(
        cast(Any, None),
        cast(Any, None),
        period=60.0,
        annotate=lambda uid: None,
        delete_failed=lambda pod: None,
        collect_dirs=lambda active, only=None: [],
        wait_synced=lambda timeout: True,
    )


def test_healthz_does_not_count_an_allocation_check_not_started_yet_as_dead() -> None:
    # The agent is ready (Allocate may proceed) a moment before its loops start: /healthz said 503 then.
    check = _check()
    ready = threading.Event()
    ready.set()
    agent = SimpleNamespace(plugins=None, dra=None, health=None, api=None, check=check, ready=ready)
    alive = _liveness(cast(Any, agent))["allocation-check"]
    assert alive()
    check._stop.set()  # a loop that ran and ended is dead
    check.start()
    check._thread.join(timeout=10)  # type: ignore[union-attr]
    assert not alive()


def test_healthz_holds_while_the_allocation_check_is_being_started(monkeypatch: pytest.MonkeyPatch) -> None:
    check = _check()
    ready = threading.Event()
    ready.set()
    agent = SimpleNamespace(plugins=None, dra=None, health=None, api=None, check=check, ready=ready)
    alive = _liveness(cast(Any, agent))["allocation-check"]
    seen: list[bool] = []
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        seen.append(alive())  # a probe that comes while the thread is being started
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    check.start()
    check.stop()
    assert seen == [True]
