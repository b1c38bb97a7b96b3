"""A kube-scheduler stand-in for DRA: allocates pending pods' claims with consumable capacity, binds the pods.

The allocator follows the kube-scheduler's DRA allocator (KEP-4381, KEP-5075 "Scheduling
enhancement"):

* devices come from the ResourceSlices of each node; per pool only the slices of the highest
  generation count, and devices are tried first-fit in slice order (pool, slice name, device);
* a device passes when the request's DeviceClass selectors and its own selectors (CEL, evaluated
  with cel-python over ``device.driver``, ``device.attributes``, ``device.capacity``,
  ``device.allowMultipleAllocations``) are true and each of its taints (NoSchedule, NoExecute) is
  tolerated by the request;
* a device without ``allowMultipleAllocations`` is used by at most one claim; a shareable device
  holds claims while, per capacity, the sum of ``consumedCapacity`` of every allocated claim plus
  the request fits its ``value``. A request is rounded by the capacity's ``requestPolicy``:
  absent -> ``default``, else ``min + ceil((req - min) / step) * step`` (or the smallest of
  ``validValues`` not below it), refused above ``max``; a capacity without a policy is consumed
  whole when not requested;
* ``count`` devices per request, ``allocationMode: All``; a device that allows multiple
  allocations may be chosen again within one claim, for another request or for the next device
  of the same request (as the real allocator does: only a ``distinctAttribute`` constraint
  prevents it), each time a share of its own ``shareID``, while their sum fits;
  ``constraints[].matchAttribute`` (every device of the listed requests has the same value of the
  attribute, and has it) and ``distinctAttribute``, by backtracking;
* the result: ``status.allocation.devices.results[]`` (request, driver, pool, device, ``shareID``
  for shareable devices, ``consumedCapacity``, the request's tolerations, ``adminAccess``: set on
  every result, true or false, as since 1.32), ``nodeSelector`` for the node, and ``reservedFor``
  the pod; then the pod is bound (``pods/binding``);
* admin access (``exactly.adminAccess: true``): the device is given whatever other claims hold of it
  (in use, or its capacity taken), and the result is not counted as allocated, as the real
  allocator does (the API server admits such requests only in namespaces labelled
  ``resource.kubernetes.io/admin-access: "true"``; not checked here).

A pod whose claims cannot all be allocated on any node stays pending; :attr:`DRAScheduler.pending`
says why. Not modelled: ``firstAvailable``, binding conditions, scoring (there is
none for DRA yet), preemption, claims shared by several pods on different nodes.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import celpy
from celpy.adapter import json_to_cel
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from simnode.apiserver_quantity import canonical, value

log = logging.getLogger(__name__)

JSON = dict[str, Any]


@dataclass(frozen=True)
class Candidate:
    """A device of a slice, in slice order."""

    node: str
    driver: str
    pool: str
    device: JSON

    @property
    def key(self) -> tuple[str, str, str]:
        """(driver, pool, device name)."""
        return (self.driver, self.pool, str(self.device.get("name")))


def _cel_device(c: Candidate) -> Any:
    attrs: dict[str, dict[str, Any]] = {}
    for name, attr in (c.device.get("attributes") or {}).items():
        domain, _, short = name.rpartition("/")
        domain = domain or c.driver
        val = next((attr[k] for k in ("bool", "int", "string", "version") if attr.get(k) is not None), None)
        attrs.setdefault(domain, {})[short] = val
    caps: dict[str, dict[str, Any]] = {}
    for name, cap in (c.device.get("capacity") or {}).items():
        domain, _, short = name.rpartition("/")
        caps.setdefault(domain or c.driver, {})[short] = int(value(cap.get("value", "0")))
    return json_to_cel(
        {
            "driver": c.driver,
            "attributes": attrs,
            "capacity": caps,
            "allowMultipleAllocations": bool(c.device.get("allowMultipleAllocations")),
        }
    )


class Selectors:
    """Compiled CEL selectors (cached by expression)."""

    def __init__(self) -> None:
        self._env = celpy.Environment()
        self._programs: dict[str, Any] = {}

    def matches(self, expressions: Sequence[str], c: Candidate) -> bool:
        """Whether every expression is true for the device (an evaluation error is false)."""
        if not expressions:
            return True
        activation = {"device": _cel_device(c)}
        for expr in expressions:
            program = self._programs.get(expr)
            if program is None:
                program = self._env.program(self._env.compile(expr))
                self._programs[expr] = program
            try:
                result = program.evaluate(activation)
            except Exception:
                return False
            if result is not True and not (hasattr(result, "__bool__") and bool(result) and str(result) == "True"):
                return False
        return True


def rounded(cap: JSON, requested: Any | None) -> Decimal | None:
    """What a request consumes of one capacity under its policy; None when it cannot be met."""
    total = value(cap.get("value", "0"))
    policy = cap.get("requestPolicy")
    if policy is None:
        if requested is None:
            return total
        want = value(requested)
        return want if want <= total else None
    want = value(requested) if requested is not None else value(policy.get("default", cap.get("value", "0")))
    values = policy.get("validValues")
    if values:
        fit = [value(v) for v in values if value(v) >= want]
        return min(fit) if fit else None
    rng = policy.get("validRange") or {}
    lo = value(rng.get("min", "0"))
    if want < lo:
        want = lo
    step = rng.get("step")
    if step is not None:
        s = value(step)
        want = lo + Decimal(math.ceil((want - lo) / s)) * s
    hi = rng.get("max")
    if hi is not None and want > value(hi):
        return None
    return want


def _like(amount: Decimal, template: Any) -> str:
    """``amount`` in the format of ``template`` (binary suffixes stay binary), canonical."""
    text = str(template)
    if text.endswith("i") and amount == amount.to_integral_value() and int(amount) % 1024 == 0:
        return canonical(f"{int(amount) // 1024}Ki")
    return canonical(str(amount))


class Allocator:
    """Allocation over a snapshot of slices, classes and already-allocated claims."""

    def __init__(
        self,
        slices: Sequence[JSON],
        classes: Mapping[str, JSON],
        allocated: Sequence[JSON],
        selectors: Selectors,
        *,
        consumable_capacity: bool = True,
    ) -> None:
        # consumable_capacity False: the scheduler's DRAConsumableCapacity gate is off (its allocator
        # knows neither allowMultipleAllocations nor capacity requests: every device goes to one claim,
        # whole, with no shareID or consumedCapacity in the result).
        self._consumable = consumable_capacity
        self._classes = classes
        self._sel = selectors
        self.candidates = self._candidates(slices)
        self.used: dict[tuple[str, str, str], dict[str, Decimal]] = {}
        self.exclusive: set[tuple[str, str, str]] = set()
        for claim in allocated:
            for r in (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []:
                if r.get("adminAccess") is True:  # not considered allocated, as the real allocator
                    continue
                self._charge((r["driver"], r["pool"], r["device"]), r.get("consumedCapacity"), bool(r.get("shareID")))

    @staticmethod
    def _candidates(slices: Sequence[JSON]) -> list[Candidate]:
        newest: dict[tuple[str, str], int] = {}
        for s in slices:
            spec = s.get("spec") or {}
            pool = spec.get("pool") or {}
            key = (str(spec.get("driver")), str(pool.get("name")))
            newest[key] = max(newest.get(key, 0), int(pool.get("generation") or 0))
        out = []
        ordered = sorted(slices, key=lambda s: ((s["spec"].get("pool") or {}).get("name", ""), s["metadata"]["name"]))
        for s in ordered:
            spec = s["spec"]
            pool = spec.get("pool") or {}
            if int(pool.get("generation") or 0) != newest[(str(spec.get("driver")), str(pool.get("name")))]:
                continue
            for dev in spec.get("devices") or []:
                out.append(Candidate(str(spec.get("nodeName", "")), str(spec["driver"]), str(pool["name"]), dev))
        return out

    def _charge(self, key: tuple[str, str, str], consumed: Mapping[str, Any] | None, shared: bool) -> None:
        if not shared or not consumed:
            self.exclusive.add(key)
            return
        per = self.used.setdefault(key, {})
        for name, amount in consumed.items():
            per[name] = per.get(name, Decimal(0)) + value(amount)

    def _consumption(
        self, c: Candidate, request: JSON, pending: Mapping[str, Decimal] | None = None
    ) -> dict[str, Decimal] | None:
        """What ``request`` consumes of ``c`` (``pending``: what other requests of the claim being
        allocated take of it already), or None when it does not fit."""
        admin = request.get("adminAccess") is True
        if c.key in self.exclusive and not admin:
            return None
        multi = self._consumable and bool(c.device.get("allowMultipleAllocations"))
        wanted = ((request.get("capacity") or {}).get("requests")) or {}
        if not multi:
            return {} if c.key not in self.used or admin else None
        out: dict[str, Decimal] = {}
        for name, cap in (c.device.get("capacity") or {}).items():
            amount = rounded(cap, wanted.get(name))
            if amount is None:
                return None
            taken = (pending or {}).get(name, Decimal(0))
            if not admin:  # admin access is given a device whatever the others take of it
                taken += self.used.get(c.key, {}).get(name, Decimal(0))
            if amount + taken > value(cap.get("value", "0")):
                return None
            out[name] = amount
        if set(wanted) - set(c.device.get("capacity") or {}):
            return None
        return out

    @staticmethod
    def _tolerated(c: Candidate, tolerations: Sequence[JSON]) -> bool:
        for taint in c.device.get("taints") or []:
            if taint.get("effect") not in ("NoSchedule", "NoExecute"):
                continue
            ok = False
            for t in tolerations:
                if t.get("effect") not in (None, "", taint.get("effect")):
                    continue
                exists = t.get("operator") == "Exists" and t.get("key") in (None, "", taint.get("key"))
                equal = t.get("key") == taint.get("key") and str(t.get("value", "")) == str(taint.get("value", ""))
                ok = ok or exists or equal
            if not ok:
                return False
        return True

    def _matching(self, node: str, request: JSON) -> list[Candidate]:
        cls = self._classes.get(str(request.get("deviceClassName")))
        if cls is None:
            return []
        exprs = [s["cel"]["expression"] for s in (cls.get("spec") or {}).get("selectors") or [] if s.get("cel")]
        exprs += [s["cel"]["expression"] for s in request.get("selectors") or [] if s.get("cel")]
        tolerations = request.get("tolerations") or []
        return [
            c
            for c in self.candidates
            if c.node == node and self._tolerated(c, tolerations) and self._sel.matches(exprs, c)
        ]

    def allocate(self, claim: JSON, node: str) -> list[JSON] | None:
        """The claim's results on ``node`` (and charge them), or None when it does not fit."""
        devices_spec = (claim.get("spec") or {}).get("devices") or {}
        slots: list[tuple[str, JSON]] = []
        for req in devices_spec.get("requests") or []:
            exactly = req.get("exactly")
            if exactly is None:
                return None
            if exactly.get("allocationMode") == "All":
                n = len(self._matching(node, exactly))
                if n == 0:
                    return None
            else:
                n = int(exactly.get("count", 1))
            slots.extend((req["name"], exactly) for _ in range(n))
        constraints = devices_spec.get("constraints") or []
        choice: list[tuple[Candidate, dict[str, Decimal]]] = []

        def attr(c: Candidate, name: str) -> Any:
            domain, _, short = name.rpartition("/")
            for key, a in (c.device.get("attributes") or {}).items():
                d, _, s = key.rpartition("/")
                if (d or c.driver) == domain and s == short:
                    return json.dumps(a, sort_keys=True)
            return None

        def consistent() -> bool:
            for con in constraints:
                members = [
                    c
                    for (name, _), (c, _) in zip(slots, choice, strict=False)
                    if not con.get("requests") or name in con["requests"]
                ]
                if con.get("matchAttribute"):
                    vals = [attr(c, con["matchAttribute"]) for c in members]
                    if any(v is None for v in vals) or len(set(vals)) > 1:
                        return False
                if con.get("distinctAttribute"):
                    vals = [attr(c, con["distinctAttribute"]) for c in members]
                    if any(v is None for v in vals) or len(set(vals)) != len(vals):
                        return False
            return True

        def search(i: int) -> bool:
            if i == len(slots):
                return True
            _name, request = slots[i]
            for c in self._matching(node, request):
                # A device that allows multiple allocations may be chosen again for any slot of the
                # claim (another request, or the next device of the same request: only a
                # distinctAttribute constraint prevents that), while its capacity lasts.
                same = [took for chosen, took in choice if chosen.key == c.key]
                multi = self._consumable and c.device.get("allowMultipleAllocations")
                if same and not multi and request.get("adminAccess") is not True:
                    continue
                pending: dict[str, Decimal] = {}
                for took in same:
                    for cap, amount in took.items():
                        pending[cap] = pending.get(cap, Decimal(0)) + amount
                consumed = self._consumption(c, request, pending)
                if consumed is None:
                    continue
                choice.append((c, consumed))
                if consistent() and search(i + 1):
                    return True
                choice.pop()
            return False

        if not slots or not search(0):
            return None
        results = []
        for (name, request), (c, consumed) in zip(slots, choice, strict=True):
            multi = self._consumable and bool(c.device.get("allowMultipleAllocations"))
            result: JSON = {"request": name, "driver": c.driver, "pool": c.pool, "device": c.device["name"]}
            if multi:
                result["shareID"] = str(uuid.uuid4())
                caps = c.device.get("capacity") or {}
                result["consumedCapacity"] = {k: _like(v, caps[k].get("value", "0")) for k, v in consumed.items()}
            if request.get("tolerations"):
                result["tolerations"] = request["tolerations"]
            # Set on every result since 1.32 (DRAAdminAccess on by default; GA 1.36).
            admin = request.get("adminAccess") is True
            result["adminAccess"] = admin
            results.append(result)
            if not admin:
                self._charge(c.key, result.get("consumedCapacity"), multi)
        return results


class DRAScheduler:
    """Schedules pods that use claims, through the real kubernetes client."""

    def __init__(self, api_client: Any, nodes: Sequence[str], *, consumable_capacity: bool = True) -> None:
        """``consumable_capacity`` False: the DRAConsumableCapacity gate is off in this scheduler
        (Kubernetes 1.35 with the gate on the API server only): see :class:`Allocator`."""
        self._consumable = consumable_capacity
        self._api: Any = k8s.ResourceV1Api(api_client)
        self._core: Any = k8s.CoreV1Api(api_client)
        self._nodes = list(nodes)
        self._sel = Selectors()
        self.pending: dict[str, str] = {}

    def _all(self, fn: Any, **kw: Any) -> list[JSON]:
        items: list[JSON] = json.loads(fn(_preload_content=False, **kw).data)["items"]
        return items

    def schedule_once(self) -> list[str]:
        """One pass over unscheduled pods with claims; returns the names of the pods bound."""
        pods = [
            p
            for p in self._all(self._core.list_pod_for_all_namespaces)
            if not (p.get("spec") or {}).get("nodeName") and (p.get("spec") or {}).get("resourceClaims")
        ]
        pods.sort(key=lambda p: (p["metadata"].get("creationTimestamp", ""), p["metadata"]["name"]))
        bound = []
        for pod in pods:
            if self._schedule(pod):
                bound.append(pod["metadata"]["name"])
        return bound

    def _claims_of(self, pod: JSON) -> list[JSON] | None:
        ns = pod["metadata"].get("namespace", "default")
        names: dict[str, str] = {}
        for e in pod["spec"].get("resourceClaims") or []:
            if e.get("resourceClaimName"):
                names[e["name"]] = e["resourceClaimName"]
        for e in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
            if e.get("resourceClaimName"):
                names[e["name"]] = e["resourceClaimName"]
        if len(names) < len(pod["spec"].get("resourceClaims") or []):
            return None
        out = []
        for n in names.values():
            try:
                out.append(json.loads(self._api.read_namespaced_resource_claim(n, ns, _preload_content=False).data))
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise
        return out

    def _schedule(self, pod: JSON) -> bool:
        name = f"{pod['metadata'].get('namespace', 'default')}/{pod['metadata']['name']}"
        claims = self._claims_of(pod)
        if claims is None:
            self.pending[name] = "waiting for its ResourceClaims to be created"
            return False
        slices = self._all(self._api.list_resource_slice)
        classes = {c["metadata"]["name"]: c for c in self._all(self._api.list_device_class)}
        every = self._all(self._api.list_resource_claim_for_all_namespaces)
        allocated = [c for c in every if (c.get("status") or {}).get("allocation")]
        reasons = []
        for node in self._nodes:
            allocator = Allocator(slices, classes, allocated, self._sel, consumable_capacity=self._consumable)
            plan: list[tuple[JSON, list[JSON] | None]] = []
            fits = True
            for claim in claims:
                alloc = (claim.get("status") or {}).get("allocation")
                if alloc is not None:
                    terms = ((alloc.get("nodeSelector") or {}).get("nodeSelectorTerms")) or []
                    on = {v for t in terms for f in t.get("matchFields") or [] for v in f.get("values") or []}
                    if on and node not in on:
                        fits = False
                        break
                    plan.append((claim, None))
                    continue
                results = allocator.allocate(claim, node)
                if results is None:
                    fits = False
                    reasons.append(f"node {node}: cannot allocate claim {claim['metadata']['name']}")
                    break
                plan.append((claim, results))
            if not fits:
                continue
            for claim, results in plan:
                self._write(claim, pod, node, results)
            self._bind(pod, node)
            self.pending.pop(name, None)
            log.info("scheduler: pod %s bound to %s", name, node)
            return True
        self.pending[name] = "; ".join(reasons) or "no node fits"
        return False

    def _write(self, claim: JSON, pod: JSON, node: str, results: list[JSON] | None) -> None:
        md = claim["metadata"]
        status = dict(claim.get("status") or {})
        if results is not None:
            status["allocation"] = {
                "devices": {"results": results},
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                    ]
                },
            }
        reserved = list(status.get("reservedFor") or [])
        if not any(r.get("uid") == pod["metadata"]["uid"] for r in reserved):
            reserved.append({"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]})
        status["reservedFor"] = reserved
        self._api.patch_namespaced_resource_claim_status(
            md["name"],
            md["namespace"],
            {"metadata": {"resourceVersion": md["resourceVersion"]}, "status": status},
            _content_type="application/merge-patch+json",
        )

    def _bind(self, pod: JSON, node: str) -> None:
        md = pod["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": md["name"]},
            "target": {"kind": "Node", "name": node},
        }
        self._core.create_namespaced_pod_binding(
            md["name"], md.get("namespace", "default"), body, _preload_content=False
        )
