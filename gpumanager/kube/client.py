"""Building a client for the Kubernetes API server.

Only the client's request path and the one configuration loader in use are loaded (see
:mod:`gpumanager.kube.lazy_package`): the agent never needs the rest of the package.
"""

from __future__ import annotations

import logging
from typing import Any

from gpumanager.kube import lazy_package

log = logging.getLogger(__name__)


class KubeUnavailableError(RuntimeError):
    """No usable API server configuration."""


def api_client(kubeconfig: str = "") -> Any:
    """A client (the Kubernetes package's ``ApiClient``) from ``kubeconfig``, or the in-cluster
    configuration when it is empty."""
    where = kubeconfig or "in-cluster configuration"
    # The client's rest module imports kubernetes.utils.retry; loaded first, the utils package
    # (whose __init__ loads the YAML object creator) stays deferred too.
    lazy_package.import_module("kubernetes.utils.quantity")
    try:
        if kubeconfig:
            loader = lazy_package.import_module("kubernetes.config.kube_config")
            return loader.new_client_from_config(config_file=kubeconfig)
        incluster = lazy_package.import_module("kubernetes.config.incluster_config")
        cfg = lazy_package.import_module("kubernetes.client.configuration").Configuration()
        incluster.load_incluster_config(client_configuration=cfg)
        return lazy_package.import_module("kubernetes.client.api_client").ApiClient(cfg)
    except Exception as exc:  # the loader raises whatever its YAML parser or a malformed structure raises
        raise KubeUnavailableError(f"cannot configure the Kubernetes client from {where}: {exc}") from exc
