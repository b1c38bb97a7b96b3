"""Building a client for the Kubernetes API server."""

from __future__ import annotations

import logging
from typing import cast

from kubernetes import client, config

log = logging.getLogger(__name__)


class KubeUnavailableError(RuntimeError):
    """No usable API server configuration."""


def api_client(kubeconfig: str = "") -> client.ApiClient:
    """A client from ``kubeconfig``, or the in-cluster configuration when it is empty."""
    try:
        if kubeconfig:
            return cast(client.ApiClient, config.new_client_from_config(config_file=kubeconfig))  # type: ignore[no-untyped-call]
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        return client.ApiClient(cfg)
    except Exception as exc:  # the loader raises whatever its YAML parser or a malformed structure raises
        where = kubeconfig or "in-cluster configuration"
        raise KubeUnavailableError(f"cannot configure the Kubernetes client from {where}: {exc}") from exc
