"""A claim whose record was lost is rebuilt once the API server answers, however long that takes.

After the checkpoint is lost, a claim whose CDI spec is on disk is read again from the API server
and recorded again. The rebuild ran once: with the API server unreachable at that moment, the
claim stayed unrecorded for good, and its GPU took a second claim beside it (over-committed).
Such a claim is now tried again with backoff until rebuilt or removed, and until then no new
claim is prepared on the GPUs its spec names (a retryable error saying why).
"""

from __future__ import annotations

import os
import time

from tests.dra_claim_fixtures import DRAClient, dra_node, result

__all__ = ["dra_node"]


def test_a_claim_the_api_server_could_not_tell_about_is_rebuilt_later(dra_node: DRAClient) -> None:
    c = dra_node.cluster
    x = dra_node.claim("x", [result("gpu-0", cores="70", memory="8Gi", share="s-x")])
    rx = dra_node.ref(x)
    assert dra_node.prepare(rx)[rx[2]].error == ""
    assert c.agent is not None and c.agent.stop() == 0
    for name in os.listdir(c.checkpoint_dir):  # the checkpoint is lost
        os.unlink(c.checkpoint_dir / name)
    c.api.fail_next("GET", r"/resourceclaims/x$", 503, count=100000)
    c.start_agent()
    time.sleep(1.0)
    y = dra_node.claim("y", [result("gpu-0", cores="70", memory="8Gi", share="s-y")])
    ry = dra_node.ref(y)
    error = dra_node.prepare(ry)[ry[2]].error
    assert error and rx[2] in error and "GPU 0" in error, "a second 70-core claim was prepared on gpu-0"
    assert not dra_node.spec_path(ry[2]).exists()
    c.api.clear_faults()  # the API server answers again: x is rebuilt in the background
    deadline = time.monotonic() + 30
    while True:
        error = dra_node.prepare(ry)[ry[2]].error
        assert error, "a second 70-core claim was prepared on gpu-0 beside the rebuilt one"
        if rx[2] not in error:
            break  # refused by the allocator now: x is recorded again
        assert time.monotonic() < deadline, f"x was not rebuilt: {error}"
        time.sleep(0.5)
    assert dra_node.spec_path(rx[2]).exists()
    assert dra_node.unprepare(rx) == {rx[2]: ""}
    assert dra_node.prepare(ry)[ry[2]].error == ""
