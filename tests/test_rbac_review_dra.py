"""DRA mode against the RBAC deploy/dra/daemonset.yaml grants (see tests/test_rbac_review.py)."""

from __future__ import annotations

from pathlib import Path

from tests.test_rbac_review import DEPLOY, JSON, granted, manifest_rules, used, wait_until

# -- DRA mode under deploy/dra/daemonset.yaml's ClusterRole --------------------------------------------


def dra_rules() -> list[JSON]:
    return manifest_rules(DEPLOY / "dra" / "daemonset.yaml", "gpu-manager-dra")


def test_dra_agent_lives_a_pods_life_under_the_manifests_rbac(tmp_path: Path, sim_built: Path) -> None:
    from simnode.dra_cluster import NODE, DRACluster, claim_pod, claim_template

    # --node-labels is an agent flag in both modes (deploy/dra/daemonset.yaml passes EXTRA_FLAGS on)
    flags = ["--node-labels=gaia.tencent.com/gpu-model=auto,team=ml"]
    with DRACluster(tmp_path / "node", "t4-x1", agent_flags=flags, agent_rules=dra_rules()) as c:
        api = c.api
        c.add_template(claim_template("c30", cores=30, memory="4Gi"))
        # the agent's watches lag (a loaded API server's watch cache): the claim's pod is read by GET
        api.hold_watches(True)
        c.create_pod(claim_pod("p30", "c30"))
        c.settle()
        api.hold_watches(False)
        assert c.pod("p30")["status"]["phase"] == "Running"
        # someone changes the node's slice, and leaves another one of the node and driver: the agent
        # puts its own back and deletes the other
        ours = c.slice()
        assert ours is not None
        stale = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{NODE}-stale"},
            "spec": {**ours["spec"], "pool": {**ours["spec"]["pool"], "generation": 0}},
        }
        c.resource.create_resource_slice(stale)
        ours["spec"]["devices"][0]["attributes"]["productName"] = {"string": "changed"}
        c.resource.replace_resource_slice(ours["metadata"]["name"], ours)
        wait_until(lambda: ("update", "resource.k8s.io", "resourceslices") in used(api), "the slice put back")
        wait_until(lambda: ("delete", "resource.k8s.io", "resourceslices") in used(api), "the stale slice deleted")
        c.end_pod("p30")
        c.settle()
        wait_until(
            lambda: (api.get_node(NODE) or {}).get("metadata", {}).get("labels", {}).get("team") == "ml",
            "the node labels",
            timeout=10,
        )
        assert c.agent is not None
        log = c.agent.log_text()
        assert not api.forbidden(), (api.forbidden(), log[-3000:])
        unused = granted(dra_rules()) - used(api)
        assert not unused, f"granted but never used: {unused}"


def test_dra_agent_says_which_permission_it_lacks(tmp_path: Path, sim_built: Path) -> None:
    from simnode.dra_cluster import DRACluster, claim_pod, claim_template

    # the slices alone: claims, pods and the node are refused
    rules = [r for r in dra_rules() if r["resources"] == ["resourceslices"]]
    with DRACluster(tmp_path / "node", "t4-x1", agent_rules=rules) as c:
        c.add_template(claim_template("c30", cores=30, memory="4Gi"))
        c.create_pod(claim_pod("p30", "c30"))
        c.settle()
        assert c.pod("p30")["status"].get("phase") != "Running"
        assert c.agent is not None
        log = c.agent.log_text()
        user = "system:serviceaccount:kube-system:gpu-manager-dra"
        for what in (
            'cannot get resource "nodes"',
            'cannot list resource "pods"',
            'cannot get resource "resourceclaims"',
        ):
            hits = [line for line in log.splitlines() if what in line]
            assert hits and all(user in line for line in hits), (what, log[-4000:])
        assert "Traceback" not in log and "HTTP response headers" not in log, log[-4000:]
