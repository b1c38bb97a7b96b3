"""SIGTERM while the agent is still starting: it leaves at once, whatever start-up is waiting on."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from simnode.dra_cluster import DRACluster


@pytest.mark.parametrize("mode", ["hang", "refuse", "503"])
def test_sigterm_while_dra_start_waits_on_the_api_server(tmp_path: Path, mode: str) -> None:
    with DRACluster(tmp_path / "c", "t4-x1") as c:
        assert c.agent is not None
        c.agent.stop()
        c.api.set_down(True, mode)
        try:
            agent = c.start_agent(wait=False)
            agent.wait_for_log("starting on node", timeout=30)
            time.sleep(1.0)  # well into start-up, the API server not answering
            agent.signal(signal.SIGTERM)
            sent = time.monotonic()
            code = agent.wait(timeout=20)
            took = time.monotonic() - sent
        finally:
            c.api.set_down(False)
        # The kubelet waits 30 s before it kills; a rolling update should not wait at all.
        assert took < 5, f"the agent took {took:.1f} s to leave after SIGTERM:\n{agent.log_text()[-3000:]}"
        assert code == 0
        assert list(c.registry_dir.glob("*.sock")) == []
