"""Building the API client: what a kubeconfig that cannot work costs and says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpumanager.kube.client import KubeUnavailableError, api_client
from simnode.apiserver import ApiServerSimulator
from simnode.apiserver_objects import pod_manifest
from tests.fresh_python import run_json

#: Loaded by the kubeconfig loader (YAML) and by its auth providers when used (OAuth, the typed client).
LOADER_ONLY = ["yaml", "requests", "oauthlib", "pydantic", "kubernetes.config.kube_config"]

MISSING = r"""
import json, sys
from gpumanager.kube.client import KubeUnavailableError, api_client
try:
    api_client(sys.argv[1])
except KubeUnavailableError as exc:
    error = str(exc)
print(json.dumps({"error": error, "loaded": [m for m in sys.argv[2:] if m in sys.modules]}))
"""


def test_a_missing_kubeconfig_is_named_without_loading_the_loader(tmp_path: Path) -> None:
    missing = tmp_path / "no-kubeconfig"
    result = run_json(MISSING, str(missing), *LOADER_ONLY)
    assert result["error"] == f"cannot configure the Kubernetes client from {missing}: no such file"
    assert result["loaded"] == []


def test_kubeconfig_paths_are_looked_up_as_the_loader_does(tmp_path: Path) -> None:
    # A list of files (as KUBECONFIG): any one that exists is loaded; one that is not a file is named.
    with pytest.raises(KubeUnavailableError, match="no such file"):
        api_client(f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    with pytest.raises(KubeUnavailableError, match=f"from {tmp_path}: .*Is a directory"):
        api_client(str(tmp_path))  # a directory: the loader says what is wrong with it
    config = tmp_path / "b"
    config.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    assert api_client(f"{tmp_path / 'a'}:{config}").configuration.host == "http://127.0.0.1:1"


IN_CLUSTER = r"""
import json, sys
from gpumanager import lazy_package
incluster = lazy_package.import_module("kubernetes.config.incluster_config")
incluster.SERVICE_TOKEN_FILENAME, incluster.SERVICE_CERT_FILENAME = sys.argv[1], sys.argv[2]
load = incluster.InClusterConfigLoader._load_config
def load_http(self):  # the service address is https; the simulator speaks http
    load(self)
    self.host = sys.argv[3]
incluster.InClusterConfigLoader._load_config = load_http
from gpumanager.kube.client import kube_client
from gpumanager.kube.rest import KubeRest
api = kube_client("")
pods = KubeRest(api).list_pods(field_selector="spec.nodeName=node-1", timeout=5)
loaded = [m for m in ("pydantic",) if m in sys.modules]
print(json.dumps({"pods": [p["metadata"]["name"] for p in pods["items"]], "loaded": loaded}))
"""


def test_the_in_cluster_client_asks_with_its_token_and_loads_no_pydantic(tmp_path: Path) -> None:
    # kubernetes >= 37's ApiClient module loads pydantic and builds a model: about 9 MiB that the
    # agent, which sends plain JSON through the client's HTTP layer, never uses.
    token, cert = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("in-cluster-token")
    cert.write_text("not used over http")
    with ApiServerSimulator(token="in-cluster-token") as api:
        api.add_node("node-1")
        api.create_pod(pod_manifest("p", node="node-1"))
        host, port = api.url.removeprefix("http://").split(":")
        env = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}
        result = run_json(IN_CLUSTER, str(token), str(cert), api.url, env=env)
    assert result == {"pods": ["p"], "loaded": []}


HTTP2_METADATA = r"""
import json, sys
from gpumanager.kube.client import kube_client
from gpumanager.kube.rest import KubeRest
pods = KubeRest(kube_client(sys.argv[1])).list_pods(field_selector="spec.nodeName=node-1", timeout=5)
unused = ["importlib.metadata", "zipfile", "csv"]
before = [m for m in unused if m in sys.modules]
import urllib3, urllib3.http2
version = urllib3.http2.version("urllib3")  # what urllib3's HTTP/2 check calls, loaded at first use
print(json.dumps({"pods": len(pods["items"]), "before": before, "version": version == urllib3.__version__}))
"""


def test_the_client_loads_no_package_metadata_reader_until_http2_asks(tmp_path: Path) -> None:
    # urllib3 before 2.3 (the declared minimum is 1.26) has no HTTP/2 module, nor its version check.
    pytest.importorskip("urllib3.http2", reason="this urllib3 has no HTTP/2 module")
    with ApiServerSimulator() as api:
        api.add_node("node-1")
        config = api.write_kubeconfig(tmp_path / "kubeconfig")
        result = run_json(HTTP2_METADATA, str(config))
    assert result == {"pods": 0, "before": [], "version": True}
