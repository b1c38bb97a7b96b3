"""A DRA node for tests that talk to the agent's ``dra.sock`` themselves, with claims of any shape.

The claims are written straight into the API server (spec, then ``status.allocation``), as a
scheduler would, so a test can give them shapes the scheduler stand-in would never make.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpumanager.api import dra_v1_pb2 as v1
from gpumanager.api import dra_v1_pb2_grpc as v1_grpc
from simnode.dra_cluster import DRIVER, NODE, DRACluster

JSON = dict[str, Any]


def result(
    device: str = "gpu-0",
    *,
    cores: str | None = None,
    memory: str | None = None,
    share: str | None = None,
    request: str = "gpu",
    pool: str = NODE,
    driver: str = DRIVER,
) -> JSON:
    """One allocation result (``status.allocation.devices.results[]``)."""
    out: JSON = {"request": request, "driver": driver, "pool": pool, "device": device}
    if share:
        out["shareID"] = share
    consumed = {k: v for k, v in (("cores", cores), ("memory", memory)) if v is not None}
    if consumed:
        out["consumedCapacity"] = consumed
    return out


@dataclass(frozen=True)
class Answer:
    """One claim's entry in a NodePrepareResources answer."""

    error: str
    cdi_ids: list[str]
    share_ids: list[str]


class DRAClient:
    """NodePrepareResources / NodeUnprepareResources on the agent's dra.sock, as the kubelet calls them."""

    def __init__(self, cluster: DRACluster) -> None:
        self.cluster = cluster
        self._channel = grpc.insecure_channel(f"unix://{cluster.plugin_dir / 'dra.sock'}")
        self.stub = v1_grpc.DRAPluginStub(self._channel)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def claim(self, name: str, results: Sequence[JSON], namespace: str = "default") -> JSON:
        """Create a ResourceClaim and write its allocation; returns it as stored."""
        body: JSON = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
        }
        api = self.cluster.resource
        created: JSON = json.loads(api.create_namespaced_resource_claim(namespace, body, _preload_content=False).data)
        created["status"] = {"allocation": {"devices": {"results": list(results)}}}
        out: JSON = json.loads(
            api.replace_namespaced_resource_claim_status(name, namespace, created, _preload_content=False).data
        )
        return out

    @staticmethod
    def ref(claim: JSON) -> tuple[str, str, str]:
        """(namespace, name, uid) of a stored claim."""
        meta = claim["metadata"]
        return meta["namespace"], meta["name"], meta["uid"]

    def prepare(self, *refs: tuple[str, str, str], timeout: float = 30.0) -> dict[str, Answer]:
        """One NodePrepareResources call; the answer per claim UID."""
        req = v1.NodePrepareResourcesRequest(claims=[v1.Claim(namespace=n, name=m, uid=u) for n, m, u in refs])
        resp = self.stub.NodePrepareResources(req, timeout=timeout)
        return {
            uid: Answer(
                entry.error,
                [i for d in entry.devices for i in d.cdi_device_ids],
                [d.share_id for d in entry.devices if d.HasField("share_id")],
            )
            for uid, entry in resp.claims.items()
        }

    def unprepare(self, *refs: tuple[str, str, str], timeout: float = 30.0) -> dict[str, str]:
        """One NodeUnprepareResources call; the error text per claim UID."""
        req = v1.NodeUnprepareResourcesRequest(claims=[v1.Claim(namespace=n, name=m, uid=u) for n, m, u in refs])
        resp = self.stub.NodeUnprepareResources(req, timeout=timeout)
        return {uid: entry.error for uid, entry in resp.claims.items()}

    def prepare_killed_after_checkpoint(self, ref: tuple[str, str, str]) -> None:
        """The agent restarted to die in a Prepare of ``ref`` right after writing its checkpoint: the call fails
        and the agent exits non-zero; then it is started again."""
        c = self.cluster
        assert c.agent is not None
        c.agent.stop()
        c.start_agent(env={"GPU_MANAGER_CRASH_AT": "prepare-after-checkpoint"})
        with pytest.raises(grpc.RpcError):
            self.prepare(ref, timeout=20)
        assert c.agent.wait(20) != 0, "the agent did not die at the crash point"
        c.start_agent()

    def spec_path(self, uid: str) -> Path:
        """Where the agent writes the claim's CDI spec."""
        return self.cluster.cdi_root / f"{DRIVER}-{uid}.json"


@pytest.fixture
def dra_node(tmp_path: Path, sim_built: Path) -> Iterator[DRAClient]:
    """A one-GPU DRA node (t4-x1) and a client for its dra.sock."""
    client = start_dra_node(tmp_path / "node")
    try:
        yield client
    finally:
        stop_dra_node(client)


def start_dra_node(workdir: Path, spec: str = "t4-x1", flags: Sequence[str] = ()) -> DRAClient:
    """A started DRA node with agent ``flags`` and a client for its dra.sock (close with stop_dra_node)."""
    cluster = DRACluster(workdir, spec, agent_flags=flags)
    cluster.start()
    return DRAClient(cluster)


def stop_dra_node(client: DRAClient) -> None:
    """Close the client and stop its node."""
    client.close()
    client.cluster.stop()
