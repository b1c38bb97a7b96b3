"""The agent's open-files allowance.

Container runtimes start containers with a soft ``RLIMIT_NOFILE`` of 1024 (containerd 2, Docker 25 and
later) under a hard limit of 524288 or more. The agent holds a descriptor for each pod's ``vcuda.sock``,
and the containers of each pod may hold up to 64 more through it (16 relayed calls of three descriptors,
16 waiting for a slot): at a soft 1024, sixteen pods calling without pause would leave the agent none
for the kubelet's calls, its checkpoint or NVML. Go programs (upstream's agent among them) raise the
soft limit to the hard one at start; :func:`raise_open_files_limit` does the same.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

#: The most the soft limit is raised to (the kernel's default ``fs.nr_open``; a hard limit of
#: "infinity" cannot be taken whole).
MAX_OPEN_FILES = 1 << 20


def raise_open_files_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (at most :data:`MAX_OPEN_FILES`); returns the soft
    limit in force afterwards. Never lowers it; a refusal leaves it as it was (logged at debug)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, MAX_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            log.debug("cannot raise the open-files limit from %d to %d: %s", soft, target, exc)
            return soft
        return target
    return soft
