"""API server refusals as text that says why (:mod:`gpumanager.kube.apierror`, shared with the
device-plugin side)."""

from __future__ import annotations

from gpumanager.kube.apierror import MAX_MESSAGE, describe, plain

__all__ = ["MAX_MESSAGE", "describe", "plain"]
