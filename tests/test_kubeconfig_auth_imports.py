"""The kubeconfig loader's authentication providers load only for a kubeconfig that uses them.

A plain kubeconfig (a token) leaves OAuth2, ``requests``, the typed ``ApiClient`` and pydantic
unloaded (about 16 MiB); a kubeconfig whose user refreshes an OIDC token still works, the
modules loading when the refresh runs. Each case runs in a fresh interpreter.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from simnode.cluster import SimCluster, gpu_pod
from tests.fresh_python import run_json

#: What only the OIDC and Google providers of the loader use.
AUTH_ONLY = ["requests", "requests_oauthlib", "oauthlib", "pydantic", "kubernetes.client.api_client"]

SCRIPT = r"""
import json, sys
from gpumanager.kube.client import kube_client, KubeUnavailableError
try:
    client = kube_client(sys.argv[1])
    result = {"token": client.configuration.api_key.get("BearerToken"), "host": client.configuration.host}
except KubeUnavailableError as exc:
    result = {"error": str(exc)}
result["loaded"] = [m for m in json.loads(sys.argv[2]) if m in sys.modules]
print(json.dumps(result))
"""


def _b64(data: dict[str, object]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")


def _jwt(exp: int) -> str:
    """An id-token the loader reads the expiry of (it checks no signature)."""
    return f"{_b64({'alg': 'none'})}.{_b64({'exp': exp, 'sub': 'agent'})}.c2ln"


def _kubeconfig(path: Path, user: dict[str, object]) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


class Issuer:
    """An OIDC issuer: its discovery document and a token endpoint that answers ``answer``."""

    def __init__(self) -> None:
        self.answer: tuple[int, dict[str, object]] = (200, {})
        self.refreshed: list[str] = []
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/.well-known/openid-configuration":
                    self._reply(404, {})
                    return
                self._reply(200, {"issuer": issuer.url, "token_endpoint": f"{issuer.url}/token"})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0"))).decode()
                issuer.refreshed.append(body)
                self._reply(*issuer.answer)

            def _reply(self, status: int, doc: dict[str, object]) -> None:
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)


@pytest.fixture
def issuer() -> Iterator[Issuer]:
    got = Issuer()
    got.thread.start()
    try:
        yield got
    finally:
        got.server.shutdown()
        got.server.server_close()


def _load(config: Path) -> dict[str, object]:
    env = {"OAUTHLIB_INSECURE_TRANSPORT": "1"}  # the test issuer speaks http
    result: dict[str, object] = run_json(SCRIPT, str(config), json.dumps(AUTH_ONLY), env=env)
    return result


def _oidc(issuer: Issuer, id_token: str) -> dict[str, object]:
    config = {
        "client-id": "agent",
        "client-secret": "secret",
        "id-token": id_token,
        "refresh-token": "refresh-1",
        "idp-issuer-url": issuer.url,
    }
    return {"auth-provider": {"name": "oidc", "config": config}}


def test_a_kubeconfig_with_a_token_loads_none_of_the_auth_providers(tmp_path: Path) -> None:
    got = _load(_kubeconfig(tmp_path / "kubeconfig", {"token": "abc"}))
    assert got == {"token": "Bearer abc", "host": "http://127.0.0.1:1", "loaded": []}


def test_an_oidc_user_with_a_valid_token_needs_no_refresh_and_loads_nothing_for_it(
    tmp_path: Path, issuer: Issuer
) -> None:
    token = _jwt(exp=4_000_000_000)
    got = _load(_kubeconfig(tmp_path / "kubeconfig", _oidc(issuer, token)))
    assert got["token"] == f"Bearer {token}" and got["loaded"] == []
    assert issuer.refreshed == []


def test_an_expired_oidc_token_is_refreshed_through_the_providers_loaded_then(tmp_path: Path, issuer: Issuer) -> None:
    fresh = _jwt(exp=4_000_000_000)
    issuer.answer = (
        200,
        {"access_token": "a", "token_type": "Bearer", "id_token": fresh, "refresh_token": "r2", "expires_in": 60},
    )
    got = _load(_kubeconfig(tmp_path / "kubeconfig", _oidc(issuer, _jwt(exp=1))))
    assert got["token"] == f"Bearer {fresh}"
    assert len(issuer.refreshed) == 1 and "refresh-1" in issuer.refreshed[0]
    assert sorted(got["loaded"]) == sorted(AUTH_ONLY)  # type: ignore[arg-type]


def test_a_refresh_the_issuer_refuses_is_handled_as_the_loader_handles_it(tmp_path: Path, issuer: Issuer) -> None:
    # oauthlib raises InvalidClientIdError for this answer; the loader catches it (its except
    # clause names the class through the deferred oauthlib) and keeps the token it had.
    expired = _jwt(exp=1)
    issuer.answer = (400, {"error": "invalid_request", "error_description": "Invalid client_id parameter value."})
    got = _load(_kubeconfig(tmp_path / "kubeconfig", _oidc(issuer, expired)))
    assert got["token"] == f"Bearer {expired}"
    assert len(issuer.refreshed) == 1


def test_a_refresh_that_fails_otherwise_names_the_kubeconfig(tmp_path: Path, issuer: Issuer) -> None:
    issuer.answer = (400, {"error": "invalid_grant", "error_description": "refresh token revoked"})
    got = _load(_kubeconfig(tmp_path / "kubeconfig", _oidc(issuer, _jwt(exp=1))))
    assert "kubeconfig" in str(got.get("error")) and "revoked" in str(got.get("error")), got


def test_the_agent_started_with_a_kubeconfig_maps_none_of_the_auth_providers_libraries(
    tmp_path: Path, sim_built: Path
) -> None:
    # pydantic's core and requests' charset detector are compiled libraries: mapped only if loaded.
    with SimCluster(tmp_path, "h100-nvlink-x8") as cluster:
        assert cluster.agent is not None
        cluster.admit(gpu_pod("p", [("main", 10, 1)]))
        maps = Path(f"/proc/{cluster.agent.pid}/maps").read_text()
        assert f"--kubeconfig={cluster.agent_kubeconfig}" in cluster.agent.args  # a file, with a token user
    assert [lib for lib in ("pydantic_core", "charset_normalizer") if lib in maps] == []
