"""Choosing GPUs on one node for every GPU container of a pod, and scoring the choice.

Whole GPUs are chosen by the agent's own evaluators (:func:`gpumanager.topology.choose`:
``link`` for several GPUs, ``fragment`` for one), so the extender picks what the agent would.
A share goes, under ``binpack``, to the fullest GPU that holds it (the agent's ``share``
evaluator) and, under ``spread``, to the emptiest. Containers are placed in the order the kubelet
allocates them (GPU sidecars, then ``spec.containers``), each seeing what the previous ones took;
then each ordinary init container, beside all of them. Nothing here changes the node: choices
are made inside :meth:`NodeGPUs.trial`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from gpumanager.allocation.pods import GPURequest
from gpumanager.extender.nodes import Charge, NodeGPUs
from gpumanager.topology import HUNDRED_CORES, GroupNode, Level, TopologyTree, choose

Policy = Literal["binpack", "spread"]
POLICIES: tuple[Policy, ...] = ("binpack", "spread")
MAX_SCORE = 10
MIB = 1 << 20

#: Topology score of the tightest group that holds all GPUs of one container.
_LEVEL_SCORE = {
    Level.NVLINK: 10,
    Level.SINGLE: 8,
    Level.MULTIPLE: 6,
    Level.HOSTBRIDGE: 4,
    Level.CPU: 2,
}


@dataclass(frozen=True)
class ContainerChoice:
    """The GPUs (minors) chosen for one container."""

    request: GPURequest
    minors: tuple[int, ...]

    def charges(self) -> list[Charge]:
        """What the container will hold on each GPU."""
        return [Charge(m, self.request.cores, self.request.memory_bytes) for m in self.minors]


@dataclass(frozen=True)
class Placement:
    """A pod's GPUs on one node, or why there are none (``failed`` names the container)."""

    choices: tuple[ContainerChoice, ...]
    """The containers that hold their GPUs while the pod runs (sidecars, then ``spec.containers``)."""
    failed: str = ""
    score: int = 0
    inits: tuple[ContainerChoice, ...] = ()
    """The ordinary init containers: where each runs, before the others (no lasting charge)."""

    @property
    def ok(self) -> bool:
        """True when every GPU container has its GPUs."""
        return not self.failed


def _spread_share(tree: TopologyTree, cores: int, memory: int) -> list[int]:
    fits = [
        leaf
        for leaf in tree.leaves
        if leaf.healthy and leaf.allocatable_cores >= cores and leaf.allocatable_memory >= memory
    ]
    if not fits:
        return []
    best = min(fits, key=lambda g: (-g.allocatable_cores, -g.allocatable_memory, g.index))
    return [best.index]


def pick(tree: TopologyTree, request: GPURequest, policy: Policy) -> list[int]:
    """NVML indices for one container (empty when nothing fits now)."""
    if request.shared and policy == "spread":
        return _spread_share(tree, request.cores, request.memory_bytes)
    return choose(tree, request.cores, request.memory_bytes if request.shared else 0)


def free_figures(tree: TopologyTree) -> str:
    """What each GPU of the node has free, for logs and bind's refusal (a node's own figures, which a
    reason given to filter leaves out)."""
    return ", ".join(
        f"GPU {leaf.minor}: {leaf.allocatable_cores} cores / {leaf.allocatable_memory // MIB} MiB free of "
        f"{leaf.total_memory // MIB} MiB"
        if leaf.healthy
        else f"GPU {leaf.minor}: unhealthy"
        for leaf in tree.leaves
    )


def _who(request: GPURequest, sidecar: bool = False) -> str:
    kind = "sidecar" if sidecar else "init container" if request.index < 0 else "container"
    return f"{kind} {request.name!r}"


def _why_not(tree: TopologyTree, request: GPURequest, sidecar: bool = False) -> str:
    """Why one container does not fit the tree now, in words that name what it lacks and none of the
    node's own figures: nodes that fail alike get the same reason, which the kube-scheduler counts
    together (its event lists each distinct reason). The figures are :func:`free_figures`."""
    who = _who(request, sidecar)
    healthy = [leaf for leaf in tree.leaves if leaf.healthy]
    sick = len(healthy) < len(tree)
    if request.shared:
        cores, memory = request.cores, request.memory_bytes
        text = f"{who} needs {cores} cores and {memory // MIB} MiB on one GPU: "
        if not healthy:
            return text + "every GPU of the node is unhealthy"
        if not any(leaf.total_memory >= memory for leaf in healthy):
            text += f"no GPU of the node has {memory // MIB} MiB of memory"
        else:
            core_fit = any(leaf.allocatable_cores >= cores for leaf in healthy)
            memory_fit = any(leaf.allocatable_memory >= memory for leaf in healthy)
            if core_fit and memory_fit:
                text += "no single GPU has both free (the free cores and the free memory are on different GPUs)"
            else:
                short = [] if core_fit else [f"no GPU has {cores} free cores"]
                if not memory_fit:
                    mib = memory // MIB
                    if sum(leaf.allocatable_memory for leaf in healthy) >= memory:
                        short.append(f"GPU memory fragmented: {mib} MiB free on the node in all but on no single GPU")
                    else:
                        short.append(f"no GPU has {mib} MiB free")
                text += " and ".join(short)
    else:
        whole = request.cores // HUNDRED_CORES
        text = f"{who} needs {whole} whole GPU(s): "
        if len(tree) < whole:
            return text + f"the node has fewer than {whole} GPUs"
        if not healthy:
            return text + "every GPU of the node is unhealthy"
        if len(healthy) < whole:
            return text + f"fewer than {whole} GPUs of the node are healthy"
        text += f"fewer than {whole} healthy GPUs are entirely free" if whole > 1 else "no healthy GPU is entirely free"
    if sick:
        text += " (the node has unhealthy GPUs)"
    return text


def _invalid(node: NodeGPUs, request: GPURequest, sidecar: bool = False) -> str:
    who = _who(request, sidecar)
    if request.cores > HUNDRED_CORES and request.cores % HUNDRED_CORES:
        return f"{who}: {request.cores} tencent.com/vcuda-core is more than 100 and not a multiple of 100"
    if request.shared and not node.share_mode:
        return f"{who}: {request.cores} cores is a share, and the agent on this node runs without --share-mode"
    return ""


def never_served(requests: Sequence[GPURequest]) -> str:
    """Why no node can run these containers (all of a pod's, GPU or not), "" when one may.

    A share without ``vcuda-memory``, or ``vcuda-memory`` without ``vcuda-core``, is no GPU container to
    gpu-admission, yet the agent refuses its Allocate: the pod would be placed only to fail with
    ``UnexpectedAdmissionError``.
    """
    for r in requests:
        if 0 < r.cores < HUNDRED_CORES and r.memory_blocks <= 0:
            return (
                f"{_who(r)}: a share ({r.cores} tencent.com/vcuda-core) needs tencent.com/vcuda-memory "
                "> 0 as well; the node agent refuses it without"
            )
        if r.cores <= 0 < r.memory_blocks:
            return (
                f"{_who(r)}: {r.memory_blocks} tencent.com/vcuda-memory without tencent.com/vcuda-core gives "
                "no GPU; the node agent refuses it"
            )
    return ""


def _topology_score(tree: TopologyTree, indices: Sequence[int]) -> int:
    if len(indices) < 2:
        return MAX_SCORE
    wanted = set(indices)
    group: GroupNode | None = tree.leaf(indices[0]).parent
    while group is not None and not wanted.issubset(group.indices):
        group = group.parent
    if group is None or group.is_root:
        return 0
    return _LEVEL_SCORE.get(group.level, 0)


def _policy_score(node: NodeGPUs, request: GPURequest, indices: Sequence[int], policy: Policy) -> int:
    """How full the GPU (a share) or the node (whole GPUs) is once the container is placed, 0-10.

    Computed from the state *before* the container is placed.
    """
    if request.shared:
        leaf = node.tree.leaf(indices[0])
        fullness = (HUNDRED_CORES - leaf.allocatable_cores + request.cores) / HUNDRED_CORES
    else:
        cores, _ = node.used()
        fullness = (cores + HUNDRED_CORES * len(indices)) / (HUNDRED_CORES * max(node.gpu_count, 1))
    score = round(MAX_SCORE * min(fullness, 1.0))
    return score if policy == "binpack" else MAX_SCORE - score


def _container_score(node: NodeGPUs, request: GPURequest, indices: Sequence[int], policy: Policy) -> tuple[int, int]:
    """(weighted score, weight) of one placed container (scored before it is held)."""
    policy_score = _policy_score(node, request, indices, policy)
    if len(indices) > 1:
        return 3 * _topology_score(node.tree, indices) + policy_score, 4
    return policy_score, 1


def _could_fit(tree: TopologyTree, request: GPURequest) -> bool:
    """Whether one container fits the tree now (the evaluators' answer, without choosing)."""
    if request.shared:
        return any(
            leaf.healthy and leaf.allocatable_cores >= request.cores and leaf.allocatable_memory >= request.memory_bytes
            for leaf in tree.leaves
        )
    # link and fragment both find GPUs exactly when the root has that many available.
    return tree.root.available_count >= request.cores // HUNDRED_CORES


def fits(
    node: NodeGPUs,
    requests: Sequence[GPURequest],
    policy: Policy,
    *,
    empty: bool = False,
    inits: Sequence[GPURequest] = (),
    sidecars: Sequence[GPURequest] = (),
) -> str:
    """ "" when the pod's GPU containers fit the node (with nothing held when ``empty``), else why not.

    The same answer as :func:`place`, faster for the usual pod of one GPU container.
    """
    if len(requests) != 1 or inits or sidecars:
        return place(node, requests, policy, empty=empty, inits=inits, sidecars=sidecars).failed
    request = requests[0]
    problem = _invalid(node, request)
    if problem:
        return problem
    tree = node.empty if empty else node.tree
    return "" if _could_fit(tree, request) else _why_not(tree, request)


def place(
    node: NodeGPUs,
    requests: Sequence[GPURequest],
    policy: Policy,
    *,
    empty: bool = False,
    inits: Sequence[GPURequest] = (),
    sidecars: Sequence[GPURequest] = (),
) -> Placement:
    """Choose GPUs for the pod's GPU containers on ``node``; the node is left as it was.

    ``requests``: the GPU containers of ``spec.containers``; ``sidecars``: the GPU init containers
    with ``restartPolicy: Always``, which run beside them for the pod's whole life and so hold their
    GPUs as they do; ``inits``: the ordinary GPU init containers.

    ``empty=True`` asks the same of the node with nothing held (is it possible at all?).
    The score (0-10) is the mean over the sidecars and containers of the policy score, and for
    containers of several GPUs the topology score (counted three times: NVLink matters more than
    packing).

    The kubelet allocates every container of a pod when it admits it, init containers first, and
    the agent keeps an init container's GPUs while the others allocate. An ordinary init container
    runs alone before the others (one at a time), and the kubelet may hand its devices on to a later
    container; it is not charged while the others are placed, but each must fit beside what the
    sidecars and containers hold: it gets the GPUs it fits on beside all of them
    (:attr:`Placement.inits`), named for the agent like the others' so both place it alike. Once the
    pod is bound, it is charged as the agent counts it (:mod:`gpumanager.extender.charges`).
    """
    tree = node.empty if empty else node.tree
    if len(requests) == 1 and not empty and not inits and not sidecars:  # the usual pod
        request = requests[0]
        problem = _invalid(node, request)
        if problem:
            return Placement((), problem)
        indices = pick(tree, request, policy)
        if not indices:
            return Placement((), _why_not(tree, request))
        weighted, weight = _container_score(node, request, indices, policy)
        choice = ContainerChoice(request, tuple(tree.leaf(i).minor for i in indices))
        return Placement((choice,), "", max(0, min(MAX_SCORE, round(weighted / weight))))
    choices: list[ContainerChoice] = []
    init_choices: list[ContainerChoice] = []
    weighted = weights = 0
    scratch: list[int] = []  # GPUs of the empty tree (nothing held there) taken by this call
    held_by_pod = [(r, True) for r in sidecars] + [(r, False) for r in requests]
    with node.trial() as held:
        try:
            for request, sidecar in held_by_pod:
                problem = _invalid(node, request, sidecar)
                if problem:
                    return Placement(tuple(choices), problem)
                indices = pick(tree, request, policy)
                if not indices:
                    return Placement(tuple(choices), _why_not(tree, request, sidecar))
                choice = ContainerChoice(request, tuple(tree.leaf(i).minor for i in indices))
                choices.append(choice)
                if empty:
                    for i in indices:
                        tree.occupy(i, request.cores, request.memory_bytes if request.shared else 0)
                        scratch.append(i)
                    continue
                score, weight = _container_score(node, request, indices, policy)
                weighted += score
                weights += weight
                node.charge(choice.charges())
                held.extend(choice.charges())
            for request in inits:  # each alone beside the others: none is charged
                problem = _invalid(node, request)
                if problem:
                    return Placement(tuple(choices), problem)
                indices = pick(tree, request, policy)
                if not indices:
                    return Placement(tuple(choices), _why_not(tree, request))
                init_choices.append(ContainerChoice(request, tuple(tree.leaf(i).minor for i in indices)))
        finally:
            for i in scratch:
                tree.free(i, HUNDRED_CORES, 0)
    score = round(weighted / weights) if weights else MAX_SCORE
    return Placement(tuple(choices), "", max(0, min(MAX_SCORE, score)), tuple(init_choices))
