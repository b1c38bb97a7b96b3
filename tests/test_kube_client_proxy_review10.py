"""The client's proxy, read from the environment once: not again before every request."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumanager.kube.client import kube_client
from gpumanager.kube.rest import KubeRest
from simnode.apiserver import ApiServerSimulator
from simnode.apiserver_objects import pod_manifest


def test_requests_with_a_token_do_not_read_the_environment_for_a_proxy_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kubernetes.client.configuration as configuration

    with ApiServerSimulator(token="node-token") as api:
        api.add_node("node-1")
        api.create_pod(pod_manifest("p", node="node-1"))
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig", token="node-token")
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        client = kube_client(str(kubeconfig))
        proxy = client.configuration.proxy
        read = []
        real = configuration.getproxies
        monkeypatch.setattr(configuration, "getproxies", lambda: read.append(1) or real())
        rest = KubeRest(client)
        for _ in range(3):
            pods = rest.list_pods(field_selector="spec.nodeName=node-1", timeout=5)
        assert [p["metadata"]["name"] for p in pods["items"]] == ["p"]
    assert read == []  # the token hook sets the host again each time; the proxy is not looked up again
    assert client.configuration.proxy == proxy


def test_the_proxy_of_the_environment_is_still_the_one_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        '{"apiVersion": "v1", "kind": "Config", "current-context": "c",'
        ' "clusters": [{"name": "c", "cluster": {"server": "https://api.example:6443"}}],'
        ' "users": [{"name": "c", "user": {"token": "t"}}],'
        ' "contexts": [{"name": "c", "context": {"cluster": "c", "user": "c"}}]}'
    )
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    client = kube_client(str(kubeconfig))
    assert client.configuration.proxy == "http://proxy.example:3128"
    client.configuration.refresh_api_key_hook(client.configuration)
    assert client.configuration.proxy == "http://proxy.example:3128"
