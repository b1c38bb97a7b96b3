"""gpu_manager_kubelet_registered and _registrations_total in DRA mode (the DRA driver's registration)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gpumanager.dra.plugin import RegistrationState
from gpumanager.metrics.collector import AgentCollector
from gpumanager.metrics.textformat import FamilyText


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _dra_agent(state: RegistrationState) -> SimpleNamespace:
    dra = SimpleNamespace(sockets=SimpleNamespace(state=state))
    return SimpleNamespace(gpus=[], layout=None, health=None, plugins=None, allocator=None, dra=dra)


def _render(agent: SimpleNamespace) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(AgentCollector(agent))  # type: ignore[arg-type]
    return _samples(FamilyText().render(registry.collect()))


def test_dra_mode_registered_with_the_kubelet_says_so() -> None:
    """In DRA mode the agent registers with the kubelet as a DRA driver (no device-plugin resources):
    gpu_manager_kubelet_registered said 0 for ever there, so GPUManagerNotRegistered fired on every
    healthy DRA node."""
    state = RegistrationState()
    samples = _render(_dra_agent(state))
    assert samples[("gpu_manager_kubelet_registered", ())] == 0.0
    assert samples[("gpu_manager_kubelet_registrations_total", ())] == 0.0
    state.registered = True
    state.registrations = 2
    samples = _render(_dra_agent(state))
    assert samples[("gpu_manager_kubelet_registered", ())] == 1.0
    assert samples[("gpu_manager_kubelet_registrations_total", ())] == 2.0
    state.last_error = "refused"
    state.registered = False
    assert _render(_dra_agent(state))[("gpu_manager_kubelet_registered", ())] == 0.0


def test_dra_registration_counter_counts_each_registration() -> None:
    from gpumanager.dra.plugin import DRAPluginSockets as PluginSockets

    sockets = PluginSockets.__new__(PluginSockets)
    sockets.state = RegistrationState()
    sockets.registered_event = threading.Event()
    for _ in range(150):  # more than the history keeps
        sockets.on_status(True, "")
    sockets.on_status(False, "no")
    assert sockets.state.registrations == 150
