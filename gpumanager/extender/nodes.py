"""One node's GPUs as the extender sees them: a topology tree and what pods hold on each GPU.

The GPUs come from the node's ``tencent.com/gpu-inventory`` annotation (each GPU its own
memory, health and topology). A node without a usable annotation is judged by gpu-admission's
rule: ``capacity(vcuda-core) / 100`` equal GPUs (index = minor = 0..n-1), each with
``capacity(vcuda-memory) / n`` blocks, all healthy, no topology; :attr:`NodeGPUs.note` says so.

What pods hold is kept as per-GPU sums (shares: cores and bytes; whole GPUs: a count), and
each GPU of the tree is set from its sums through the tree's own ``free``/``occupy``, so
charges may come and go in any order and the tree the evaluators read is always exact.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from gpumanager import names
from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.dra import quantity
from gpumanager.kube import shape
from gpumanager.kube.gpu_inventory import ANNOTATION, InventoryError, decode
from gpumanager.topology import HUNDRED_CORES, Level, TopologyTree, build_tree

log = logging.getLogger(__name__)

Node = Mapping[str, Any]

#: The most GPUs a node judged from its capacity may have: its flat topology costs the square of
#: their number (no node has this many; a capacity claiming more is a mistake, not a node).
MAX_CAPACITY_GPUS = 256


class UnusableNodeError(ValueError):
    """The node's object cannot be judged; the message names the field and the value."""


@dataclass(frozen=True)
class Charge:
    """What one container holds on one GPU: a share (cores < 100, bytes) or the whole GPU."""

    minor: int
    cores: int
    memory: int

    @property
    def whole(self) -> bool:
        """True for a whole GPU."""
        return self.cores >= HUNDRED_CORES


@dataclass
class _Held:
    cores: int = 0
    memory: int = 0
    whole: int = 0


#: The largest quantity the API server stores (it caps larger ones).
_MAX_QUANTITY = 2**63 - 1


def _quantity(raw: object) -> int:
    """A capacity as the API server answers it (canonical form: ten GPUs have ``1k`` cores); 0 if unreadable."""
    try:
        value = quantity.parse(raw)  # the API server's grammar: not "5_000", "١٢٣" or "5 k"
    except quantity.QuantityError:
        return 0
    # Bounded before int(): 1e999999999 would take it minutes (the API server stores no larger quantity).
    return int(value) if value.is_finite() and 0 <= value <= _MAX_QUANTITY else 0


def _field(value: object) -> Mapping[str, Any]:
    """An object field of a node, as a mapping: {} when absent or of another shape (a server that sent a
    list there failed the state's listener, so the node was never judged)."""
    return value if isinstance(value, dict) else {}


def _resources(node: Node, section: str) -> Mapping[str, Any]:
    return _field(_field(node.get("status")).get(section))


def node_name(node: Node) -> str:
    """``metadata.name``."""
    return str(_field(node.get("metadata")).get("name", ""))


def node_annotations(node: Node) -> Mapping[str, Any]:
    """``metadata.annotations`` ({} when absent or not a map, which is warned of, naming the node)."""
    annotations = _field(node.get("metadata")).get("annotations")
    if annotations is not None and not isinstance(annotations, dict):
        log.warning(
            "node %s: metadata.annotations is not a map but %s; taken as none",
            node_name(node),
            shape.shown(annotations),
        )
    return _field(annotations)


def fingerprint(node: Node) -> tuple[str, str, str]:
    """What the GPUs of a node are built from: the annotation and the two capacities."""
    annotations = node_annotations(node)
    capacity = _resources(node, "capacity")
    return (
        str(annotations.get(ANNOTATION, "")),
        str(capacity.get(names.VCORE_RESOURCE, "")),
        str(capacity.get(names.VMEMORY_RESOURCE, "")),
    )


@dataclass
class NodeGPUs:
    """The GPUs of one node with their charges. Not thread-safe: the cluster state's lock guards it."""

    name: str
    tree: TopologyTree
    empty: TopologyTree
    """The same GPUs with nothing held (to tell "not now" from "never")."""
    share_mode: bool
    from_inventory: bool
    note: str = ""
    """Why the node is judged by its capacity, and as what (empty when the annotation was used)."""
    basis: str = ""
    """:attr:`note` without the node's own figures (the same on every node judged so), for filter's reasons."""
    held: dict[int, _Held] = field(default_factory=dict)
    missing: set[int] = field(default_factory=set)
    """Minors of GPUs the node does not have that a pod was charged on (each logged once)."""

    def __post_init__(self) -> None:
        self.held = {leaf.minor: _Held() for leaf in self.tree.leaves}

    @property
    def gpu_count(self) -> int:
        """Number of GPUs."""
        return len(self.tree)

    def charge(self, charges: Iterable[Charge], sign: int = 1, *, pod: str = "") -> None:
        """Add (``sign=1``) or remove (``sign=-1``) charges of ``pod`` (named in logs); charges on GPUs
        the node does not have are skipped, and logged once per GPU."""
        touched = set()
        for c in charges:
            held = self.held.get(c.minor)
            if held is None:
                if sign > 0 and c.minor not in self.missing:
                    self.missing.add(c.minor)
                    log.warning(
                        "node %s: pod %s holds GPU %d, which the node does not have (GPUs %s%s); that charge is "
                        "not counted (logged once per node and GPU)",
                        self.name,
                        pod or "(unknown)",
                        c.minor,
                        ",".join(map(str, sorted(self.held))) or "none",
                        f"; {self.note}" if self.note else "",
                    )
                continue
            if c.whole:
                held.whole += sign
            else:
                held.cores += sign * c.cores
                held.memory += sign * c.memory
            touched.add(c.minor)
        for minor in touched:
            self._sync(minor)

    def _sync(self, minor: int) -> None:
        held = self.held[minor]
        leaf = self.tree.leaf_by_minor(minor)
        self.tree.free(leaf.index, HUNDRED_CORES, 0)
        if held.whole > 0 or held.cores >= HUNDRED_CORES:
            self.tree.occupy(leaf.index, HUNDRED_CORES, 0)
        elif held.cores > 0 or held.memory > 0:
            self.tree.occupy(leaf.index, max(held.cores, 0), min(max(held.memory, 0), leaf.total_memory))

    @contextmanager
    def trial(self) -> Iterator[list[Charge]]:
        """Charges appended to the yielded list are held until the block ends, then dropped."""
        added: list[Charge] = []
        try:
            yield added
        finally:
            self.charge(added, -1)

    def over_committed(self) -> list[int]:
        """Minors of GPUs holding more than they have (should never happen)."""
        out = []
        for minor, held in self.held.items():
            total = self.tree.leaf_by_minor(minor).total_memory
            cores = held.whole * HUNDRED_CORES + held.cores
            if cores > HUNDRED_CORES or (held.whole and held.cores) or held.memory > total:
                out.append(minor)
        return out

    def used(self) -> tuple[int, int]:
        """Cores and bytes held on the whole node (a whole GPU counts as all of it)."""
        cores = memory = 0
        for minor, held in self.held.items():
            if held.whole:
                cores += HUNDRED_CORES
                memory += self.tree.leaf_by_minor(minor).total_memory
            else:
                cores += held.cores
                memory += held.memory
        return cores, memory


def _from_inventory(name: str, text: str) -> NodeGPUs:
    inventory = decode(text)
    if not inventory.gpus:
        raise InventoryError("no GPUs")
    gpus = [g.info() for g in inventory.gpus]
    topology = inventory.topology()
    tree, empty = build_tree(gpus, topology), build_tree(gpus, topology)
    for g in inventory.gpus:
        tree.set_healthy(g.index, g.healthy)
        empty.set_healthy(g.index, g.healthy)
    return NodeGPUs(name, tree, empty, share_mode=inventory.share_mode, from_inventory=True)


def _from_capacity(name: str, node: Node, why: str, cause: str) -> NodeGPUs | None:
    """``why``: why the capacity is used, for logs; ``cause``: the same without the node's own figures."""
    capacity = _resources(node, "capacity")
    raw = capacity.get(names.VCORE_RESOURCE, 0)
    count = _quantity(raw) // HUNDRED_CORES
    if count <= 0:
        return None
    if count > MAX_CAPACITY_GPUS:
        raise UnusableNodeError(
            f"capacity {names.VCORE_RESOURCE}={raw} would be {count} GPUs ({why}), more than "
            f"{MAX_CAPACITY_GPUS}: not believed; the agent's {ANNOTATION} annotation names the real GPUs"
        )
    blocks = _quantity(capacity.get(names.VMEMORY_RESOURCE, 0)) // count
    gpus = [
        GPUInfo(
            index=i,
            uuid=f"{name}-gpu-{i}",
            name="",
            minor=i,
            memory_total=blocks * names.MEMORY_BLOCK_BYTES,
            pci_bus_id="",
        )
        for i in range(count)
    ]
    flat = NodeTopology(
        levels=tuple(tuple(0 if i == j else int(Level.SYSTEM) for j in range(count)) for i in range(count))
    )
    note = f"{why}: judged as {count} equal GPUs of {blocks} vcuda-memory blocks (node capacity divided evenly)"
    basis = f"{cause}: judged as equal GPUs (node capacity divided evenly)"
    return NodeGPUs(
        name,
        build_tree(gpus, flat),
        build_tree(gpus, flat),
        share_mode=True,
        from_inventory=False,
        note=note,
        basis=basis,
    )


def node_gpus(node: Node) -> NodeGPUs | None:
    """The node's GPUs with nothing charged, or None when it has none (:class:`UnusableNodeError`
    when its capacity claims more than :data:`MAX_CAPACITY_GPUS`)."""
    name = node_name(node)
    text = _field(_field(node.get("metadata")).get("annotations")).get(ANNOTATION)
    if text is None:
        why = f"no {ANNOTATION} annotation"
        return _from_capacity(name, node, why, why)
    try:
        return _from_inventory(name, str(text))
    except (InventoryError, ValueError) as exc:
        log.warning("node %s: annotation %s is unusable (%s); using its capacity", name, ANNOTATION, exc)
        why = f"annotation {ANNOTATION} unusable"
        return _from_capacity(name, node, f"{why} ({exc})", why)
