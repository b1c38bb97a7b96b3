"""gpu_manager_xid_events_total never goes backwards while XID events arrive during a scrape."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gpumanager.metrics.collector import AgentCollector
from gpumanager.metrics.textformat import FamilyText


class _RacingHealth:
    """A HealthMonitor's counters, with an ignored XID event arriving between two reads of a scrape
    (the event thread runs between the collector's attribute reads)."""

    def __init__(self) -> None:
        self.xid_events = 3
        self._ignored = 1
        self.critical_xid_events = 2

    def snapshot(self) -> dict[int, object]:
        return {}

    @property
    def ignored_xid_events(self) -> int:
        # The event thread's _handle_event for an ignored XID: the total first, then the ignored count.
        self.xid_events += 1
        self._ignored += 1
        return self._ignored


def _critical(collector: AgentCollector) -> float:
    registry = CollectorRegistry()
    registry.register(collector)
    for family in text_string_to_metric_families(FamilyText().render(registry.collect())):
        for s in family.samples:
            if s.name == "gpu_manager_xid_events_total" and s.labels == {"ignored": "false"}:
                return float(s.value)
    raise AssertionError("no gpu_manager_xid_events_total{ignored=false}")


def test_critical_xid_counter_does_not_drop_when_ignored_events_arrive() -> None:
    health = _RacingHealth()
    agent = SimpleNamespace(gpus=[], layout=None, health=health, plugins=None, allocator=None)
    collector = AgentCollector(agent)  # type: ignore[arg-type]
    values = [_critical(collector) for _ in range(5)]
    # Only ignored XIDs arrived: the critical count is the same at every scrape (a drop reads as a reset,
    # and increase() would count the whole counter again).
    assert values == [2.0] * 5
