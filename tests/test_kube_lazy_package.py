"""The agent loads only the parts of the Kubernetes client it uses, and the rest still works on demand."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters:
- name: sim
  cluster: {server: "http://127.0.0.1:1"}
users:
- name: sim
  user: {token: abc}
contexts:
- name: sim
  context: {cluster: sim, user: sim}
current-context: sim
"""

#: Parts of the client the agent never uses; the package's own __init__ would load all of them.
UNUSED = ["kubernetes.dynamic", "kubernetes.stream", "kubernetes.watch", "kubernetes.leaderelection"]


def _run(tmp_path: Path, body: str) -> dict[str, object]:
    config = tmp_path / "kubeconfig"
    config.write_text(KUBECONFIG)
    script = textwrap.dedent(body).replace("KUBECONFIG_PATH", repr(str(config)))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_the_agent_client_and_its_calls_load_none_of_the_unused_parts(tmp_path: Path) -> None:
    result = _run(
        tmp_path,
        f"""
        import json, sys
        from gpumanager.kube import client, rest
        from gpumanager.dra import quantity, publisher, prepare
        api = client.api_client(KUBECONFIG_PATH)
        kube = rest.KubeRest(api)
        try:
            kube.list_pods(field_selector="spec.nodeName=n", timeout=0.5)
        except Exception as exc:  # nothing listens there: the request path ran to the socket
            error = type(exc).__name__
        value = str(quantity.parse("4Gi"))
        print(json.dumps({{"loaded": [m for m in {UNUSED!r} if m in sys.modules], "error": error, "value": value,
                          "server": api.configuration.host}}))
        """,
    )
    assert result["loaded"] == []
    assert result["value"] == "4294967296"
    assert result["server"] == "http://127.0.0.1:1"
    assert result["error"] != "AttributeError"


def test_code_that_imports_the_package_later_gets_all_of_it(tmp_path: Path) -> None:
    result = _run(
        tmp_path,
        """
        import json
        from gpumanager import lazy_package
        from gpumanager.kube import client, rest
        client.api_client(KUBECONFIG_PATH)
        deferred = lazy_package.is_deferred("kubernetes")
        import kubernetes
        from kubernetes.client.exceptions import ApiException
        from kubernetes.utils import parse_quantity
        from kubernetes import client as typed, config, watch
        version = kubernetes.__version__  # defined by the package's __init__ only
        print(json.dumps({
            "deferred_before": deferred,
            "deferred_after": lazy_package.is_deferred("kubernetes"),
            "version": version,
            "same_exception": ApiException is rest.ApiException,
            "quantity": str(parse_quantity("1k")),
            "typed": typed.CoreV1Api.__name__,
            "loader": callable(config.load_incluster_config),
            "watch": watch.Watch.__name__,
        }))
        """,
    )
    assert result["deferred_before"] is True
    assert result["deferred_after"] is False
    assert isinstance(result["version"], str) and result["version"]
    assert result["same_exception"] is True
    assert result["quantity"] == "1000"
    assert result["typed"] == "CoreV1Api"
    assert result["loader"] is True
    assert result["watch"] == "Watch"


def test_a_name_the_package_does_not_have_is_an_attribute_error(tmp_path: Path) -> None:
    result = _run(
        tmp_path,
        """
        import json
        from gpumanager import lazy_package
        lazy_package.import_module("kubernetes.client.exceptions")
        import kubernetes
        try:
            kubernetes.no_such_name
            outcome = "found"
        except AttributeError as exc:
            outcome = str(exc)
        print(json.dumps({"outcome": outcome, "has_version": hasattr(kubernetes, "__version__")}))
        """,
    )
    assert "no_such_name" in str(result["outcome"])
    assert result["has_version"] is True


def test_a_package_that_provides_names_lazily_itself_still_does(tmp_path: Path) -> None:
    # kubernetes.client defines a module __getattr__ for its API classes: the first name asked
    # of the deferred package must reach it.
    result = _run(
        tmp_path,
        """
        import json
        from gpumanager import lazy_package
        lazy_package.import_module("kubernetes.client.exceptions")
        deferred = lazy_package.is_deferred("kubernetes.client")
        import kubernetes.client
        print(json.dumps({"deferred": deferred, "name": kubernetes.client.CoreV1Api.__name__}))
        """,
    )
    assert result == {"deferred": True, "name": "CoreV1Api"}
