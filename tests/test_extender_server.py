"""The extender's HTTP server: what it counts, and when."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

from gpumanager.extender.metrics import ExtenderMetrics
from gpumanager.extender.server import ExtenderServer, Routes


class _SlowLabels:
    """The requests counter, slow to count (as a thread the scheduler preempted would be)."""

    def __init__(self, counter: Any) -> None:
        self._counter = counter

    def labels(self, *values: str) -> Any:
        time.sleep(0.3)
        return self._counter.labels(*values)


def test_a_request_is_counted_before_its_answer_leaves() -> None:
    metrics = ExtenderMetrics(lambda: {})
    counter = metrics.requests
    metrics.requests = _SlowLabels(counter)  # type: ignore[assignment]
    routes = Routes(verbs={"filter": lambda body: ({"Nodes": None, "Error": ""}, 200)}, ready=lambda: (True, {}),
                    version={})  # fmt: skip
    server = ExtenderServer("127.0.0.1", 0, routes, metrics)
    server.start()
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{server.port}/scheduler/filter", data=b"{}")
        answer = json.loads(urllib.request.urlopen(req, timeout=10).read())
        # The client has its answer: a scrape now must find the request.
        assert counter.labels("filter", "200")._value.get() == 1.0
        assert answer == {"Nodes": None, "Error": ""}
    finally:
        server.stop()
