"""DRA mode serves the kubelet's sockets without waiting for the pod cache.

The DRA sockets were started after the pod cache's wait for its first sync (made for Allocate in
device-plugin mode, up to 5 s): with the API server down or hanging at start, the kubelet could not
register the driver, nor prepare a claim already prepared, for about 6 s. The sockets now start
before that wait; the ResourceSlice's first write is still tried first (1 s at most).
"""

from __future__ import annotations

import time

import pytest

from simnode.dra_cluster import DRIVER
from tests.dra_claim_fixtures import DRAClient, dra_node

__all__ = ["dra_node"]


@pytest.mark.parametrize("down", ["503", "hang"])
def test_the_driver_registers_while_the_api_server_is_down(dra_node: DRAClient, down: str) -> None:
    c = dra_node.cluster
    assert c.agent is not None and c.agent.stop() == 0 and c.kubelet is not None
    before = c.kubelet.registrations(DRIVER)
    c.api.set_down(True, down)  # type: ignore[arg-type]
    try:
        started = time.monotonic()
        c.start_agent(wait=False)
        c.kubelet.wait_registered(DRIVER, after=before, timeout=60)
        took = time.monotonic() - started
    finally:
        c.api.set_down(False)
    assert took < 4.0, f"registered {took:.1f} s after the start: the sockets waited for the pod cache"
