"""Building a client for the Kubernetes API server.

Only the client's request path and the one configuration loader in use are loaded (see
:mod:`gpumanager.lazy_package`): the agent never needs the rest of the package.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from gpumanager import lazy_imports, lazy_package

#: urllib3 imports ``importlib.metadata`` (with ``zipfile`` and ``csv``: about 0.6 MiB for good) only
#: to check the version of an HTTP/2 package when asked to use it; the agent speaks HTTP/1.1.
URLLIB3_UNUSED = {"urllib3.http2": ("importlib.metadata",)}
for _importer, _targets in URLLIB3_UNUSED.items():
    lazy_imports.defer_imports(_importer, *_targets)

from urllib3.util.retry import Retry  # noqa: E402 - after the deferral above

log = logging.getLogger(__name__)


KUBECONFIG_LOADER = "kubernetes.config.kube_config"

#: What the kubeconfig loader imports for users that authenticate with an OIDC provider (its token
#: refresh: OAuth2 over ``requests``, and the typed ``ApiClient``, which loads pydantic) or Google
#: credentials: about 16 MiB that a kubeconfig with a token, a client certificate or an exec plugin
#: never needs. The loader's module gets stand-ins that load them when such a user is used
#: (:func:`gpumanager.lazy_imports.defer_imports`).
KUBECONFIG_AUTH_IMPORTS = (
    "oauthlib.oauth2",
    "requests_oauthlib",
    "kubernetes.client:ApiClient",
    "google.auth",
    "google.auth.transport.requests",
)


#: What a pod's environment holds and the in-cluster configuration needs (with the service account's token).
SERVICE_HOST_ENV = "KUBERNETES_SERVICE_HOST"
SERVICE_PORT_ENV = "KUBERNETES_SERVICE_PORT"


class KubeUnavailableError(RuntimeError):
    """No usable API server configuration."""


@dataclass(frozen=True)
class KubeClient:
    """The parts of the Kubernetes client the agent's requests go through (:mod:`gpumanager.kube.rest`):
    its ``Configuration`` (host, token) and its ``RESTClientObject`` (TLS, proxy, pool, retries).
    ``ApiClient``, which holds the same two, loads pydantic (about 9 MiB) for nothing the agent uses."""

    configuration: Any
    rest_client: Any


def api_client(kubeconfig: str = "", *, wait_as_told: bool = True) -> Any:
    """The Kubernetes package's ``ApiClient`` (for its typed API classes) from ``kubeconfig``, or the
    in-cluster configuration when it is empty. ``wait_as_told=False``: a 429 or 503 is answered to the
    caller at once instead of waiting its ``Retry-After`` (up to three times): for callers with a
    deadline of their own (the extender's bind)."""
    cfg = kube_client(kubeconfig).configuration
    if not wait_as_told:
        cfg.retries = Retry(total=3, connect=0, read=0, respect_retry_after_header=False)
    return lazy_package.import_module("kubernetes.client.api_client").ApiClient(cfg)


def kube_client(kubeconfig: str = "") -> KubeClient:
    """The agent's client from ``kubeconfig``, or the in-cluster configuration when it is empty."""
    where = kubeconfig or "in-cluster configuration"
    if kubeconfig and not any(os.path.exists(p) for p in _kubeconfig_paths(kubeconfig)):
        # What the loader would find out after loading YAML, OAuth and the typed client (16 MiB).
        raise KubeUnavailableError(f"cannot configure the Kubernetes client from {where}: no such file")
    if not kubeconfig and not (os.environ.get(SERVICE_HOST_ENV) and os.environ.get(SERVICE_PORT_ENV)):
        raise KubeUnavailableError(
            f"cannot configure the Kubernetes client from {where}: {SERVICE_HOST_ENV} and {SERVICE_PORT_ENV} "
            "are not set (not running in a pod): name a kubeconfig with --kubeconfig"
        )
    # The client's rest module imports kubernetes.utils.retry; loaded first, the utils package
    # (whose __init__ loads the YAML object creator) stays deferred too.
    lazy_package.import_module("kubernetes.utils.quantity")
    try:
        cfg = lazy_package.import_module("kubernetes.client.configuration").Configuration()
        if kubeconfig:
            lazy_imports.defer_imports(KUBECONFIG_LOADER, *KUBECONFIG_AUTH_IMPORTS)
            loader = lazy_package.import_module(KUBECONFIG_LOADER)
            loader.load_kube_config(config_file=kubeconfig, client_configuration=cfg, persist_config=False)
        else:
            incluster = lazy_package.import_module("kubernetes.config.incluster_config")
            incluster.load_incluster_config(client_configuration=cfg)
        cfg.retries = retries()
        rest = lazy_package.import_module("kubernetes.client.rest").RESTClientObject(cfg)
        # The proxy the connection pool was made with, kept: the kubeconfig loader's token hook sets the
        # host again before every request, and the client then reads the whole environment again for a
        # proxy the pool never uses (about 0.1 ms of CPU a request, or more with a large environment).
        cfg.proxy = cfg.proxy
        return KubeClient(cfg, rest)
    except Exception as exc:  # the loader raises whatever its YAML parser or a malformed structure raises
        reason = (_not_a_kubeconfig(kubeconfig) if kubeconfig else _incluster_problem()) or " ".join(
            str(exc).split()
        )  # one log line
        raise KubeUnavailableError(f"cannot configure the Kubernetes client from {where}: {reason}") from exc


def _incluster_problem() -> str:
    """Which file of the pod's service account the in-cluster configuration misses, naming it (the
    loader's own error names none); "" when both are there."""
    incluster = lazy_package.import_module("kubernetes.config.incluster_config")
    for what, path in (
        ("service account token", incluster.SERVICE_TOKEN_FILENAME),
        ("service account CA certificate", incluster.SERVICE_CERT_FILENAME),
    ):
        try:
            empty = os.path.getsize(path) == 0
        except OSError as exc:
            return (
                f"the {what} {path} cannot be read ({exc.strerror or exc}): the pod needs a service account "
                "with its token mounted (automountServiceAccountToken must not be false), or name a kubeconfig "
                "with --kubeconfig"
            )
        if empty:
            return f"the {what} {path} is empty"
    return ""


def _not_a_kubeconfig(kubeconfig: str) -> str:
    """Why a kubeconfig file the loader refused is none at all (its YAML is no mapping, where the loader's
    own error reads "'str' object does not support item assignment", or no YAML, which the parser says in
    three lines), naming the file; "" otherwise."""
    yaml = lazy_package.import_module("yaml")
    for path in _kubeconfig_paths(kubeconfig):
        try:
            with open(path, encoding="utf-8") as file:
                doc = yaml.safe_load(file)
        except yaml.MarkedYAMLError as exc:  # its own text is three lines, the file's name among them
            mark = exc.problem_mark
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = " ".join(str(exc.problem or exc.context or "a syntax error").split())
            return f"{path} is not valid YAML: {problem}{where}"
        except (OSError, ValueError, yaml.YAMLError):
            continue  # the loader's own error says more
        if doc is not None and not isinstance(doc, dict):
            return (
                f"{path} is not a kubeconfig: its YAML is a {type(doc).__name__}, not a mapping "
                "with clusters, contexts and users"
            )
    return ""


def _kubeconfig_paths(kubeconfig: str) -> list[str]:
    """The files a kubeconfig setting names, as the client's loader reads them: a list separated as
    in ``KUBECONFIG``, each with ``~`` expanded."""
    return [os.path.expanduser(p) for p in kubeconfig.split(os.pathsep) if p]


#: The longest wait a ``Retry-After`` answer is granted before its request is sent again (seconds).
RETRY_AFTER_MAX = 10.0


class _BoundedRetry(Retry):
    """urllib3's ``Retry``, waiting at most :data:`RETRY_AFTER_MAX` for one ``Retry-After``.

    urllib3 sleeps whatever a 429/503 asks (up to six hours) inside the request, past its timeout: one
    answer saying ``Retry-After: 3600`` (a proxy's, an overloaded server's) held the pod cache's list,
    and with it every PreStartContainer lookup, for three hours, long after the server answered again.
    """

    def parse_retry_after(self, retry_after: str) -> float:
        seconds = super().parse_retry_after(retry_after)
        if seconds > RETRY_AFTER_MAX:
            log.warning(
                "the API server asked to wait %g s before retrying (Retry-After: %s); retrying after %g s",
                seconds,
                retry_after.strip(),
                RETRY_AFTER_MAX,
            )
            return RETRY_AFTER_MAX
        return seconds


def retries() -> Retry:
    """What the client's HTTP pool retries by itself: a redirect and a 429/503 with Retry-After
    (three in all, as urllib3's default, each wait at most :data:`RETRY_AFTER_MAX`), but no
    connection or read error. With urllib3's default, a read timeout was retried three times over
    new connections, so a call to a hanging API server took four times its timeout (a 10 s
    ResourceSlice write, 40 s); every caller retries with a backoff of its own."""
    return _BoundedRetry(total=3, connect=0, read=0)
