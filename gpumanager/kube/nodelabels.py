"""``--node-labels``: labels applied to this node once at start-up, as gpu-manager does.

The key ``gaia.tencent.com/gpu-model`` takes its value from the model of GPU 0:
the second word of the NVML name when it has more than two words (``NVIDIA H100
80GB HBM3`` gives ``H100``); otherwise the label is skipped with a warning.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Literal

from gpumanager.kube.apierror import failure
from gpumanager.kube.rest import MERGE_PATCH, ApiClient, ApiException, KubeRest
from gpumanager.retry import Backoff

log = logging.getLogger(__name__)

GPU_MODEL_LABEL = "gaia.tencent.com/gpu-model"


def resolve(labels: dict[str, str], gpu_name: str) -> dict[str, str]:
    """The labels to apply, with the GPU model filled in."""
    out = dict(labels)
    if GPU_MODEL_LABEL in out:
        words = gpu_name.split()
        if len(words) > 2:
            out[GPU_MODEL_LABEL] = words[1]
        else:
            log.warning("cannot tell a GPU model from %r; %s not set", gpu_name, GPU_MODEL_LABEL)
            del out[GPU_MODEL_LABEL]
    return out


#: Seconds the start tries to label the node before it reports the failure (the labelling goes on after it).
LABEL_WINDOW = 60.0
#: Statuses that refuse the labels themselves: tried again, they are refused again.
_REFUSALS = frozenset({403, 404, 422})

Outcome = Literal["labelled", "refused", "unanswered", "stopped"]


def label(
    api: ApiClient,
    node: str,
    labels: dict[str, str],
    *,
    timeout: float,
    stop: threading.Event,
) -> tuple[Outcome, str]:
    """Merge-patch the labels onto the node, retrying with backoff for up to ``timeout`` seconds:
    ``(outcome, the last problem)``. ``refused``: the API server refused them (403, 404, 422; trying again
    is no use); ``unanswered``: it did not take them within ``timeout`` (an outage, an overload, a 401 while
    the token is renewed; worth trying again later)."""
    rest = KubeRest(api)
    deadline = time.monotonic() + timeout
    backoff = Backoff()
    while True:
        try:
            rest.patch_node(node, {"metadata": {"labels": labels}}, content_type=MERGE_PATCH, timeout=10)
            log.info("labelled node %s: %s", node, labels)
            return "labelled", ""
        except ApiException as exc:
            problem = failure(exc)
            if exc.status in _REFUSALS:
                return "refused", problem
        except Exception as exc:
            problem = failure(exc)
        delay = backoff.next_delay()
        if time.monotonic() + delay > deadline:
            return "unanswered", problem
        if stop.wait(delay):
            return "stopped", problem


def apply(
    api: ApiClient,
    node: str,
    labels: dict[str, str],
    *,
    timeout: float = LABEL_WINDOW,
    stop: threading.Event | None = None,
) -> bool:
    """Merge-patch the labels onto the node, retrying with backoff for up to ``timeout`` seconds."""
    if not labels:
        return True
    outcome, problem = label(api, node, labels, timeout=timeout, stop=stop or threading.Event())
    if outcome == "refused":
        log.error("cannot label node %s: %s", node, problem)
    elif outcome == "unanswered":
        log.error("gave up labelling node %s: %s", node, problem)
    return outcome == "labelled"
