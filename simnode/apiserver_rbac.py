"""RBAC for the API-server simulator: service accounts with the rules of their (Cluster)Roles.

A request carrying the bearer token of a service account added with
:meth:`simnode.apiserver.ApiServerSimulator.add_service_account` is allowed only when one of its
rules grants it, as the real server's RBAC authorizer decides (``rbac/v1`` ``PolicyRule``:
``verbs``, ``apiGroups``, ``resources`` with ``resource/subresource`` and ``*/subresource``,
``resourceNames``; ``*`` in each), and is answered otherwise with the real server's 403 ``Status``
(its message worded as ``k8s.io/apiserver``'s ``responsewriters.Forbidden``). Non-resource paths
(``/api``, ``/apis``, ``/version``, health) are open to every authenticated user, as the
``system:discovery`` and ``system:public-info-viewer`` roles open them.

The attributes are the real server's ``RequestInfo``: the verb of a ``GET`` is ``get``, ``list``
or ``watch`` (``?watch=true`` or ``/watch/``), a ``DELETE`` of a collection is
``deletecollection``; a list or watch with the field selector ``metadata.name=<n>`` is authorized
for that name. Every authorized request is recorded (:attr:`Authorizer.seen`), so a test can tell
which rules were used.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import yaml

from simnode.apiserver_errors import ApiError

JSON = dict[str, Any]


@dataclass(frozen=True)
class Attributes:
    """What the authorizer decides on (``authorizer.Attributes`` of a resource request)."""

    verb: str
    group: str
    resource: str
    subresource: str = ""
    namespace: str = ""
    name: str = ""

    @property
    def combined(self) -> str:
        """``resource`` or ``resource/subresource``, as rules name it."""
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


@dataclass(frozen=True)
class Rule:
    """One ``PolicyRule`` (resource rules only)."""

    verbs: tuple[str, ...]
    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    resource_names: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, rule: Mapping[str, Any]) -> Rule:
        """A rule as written in a ClusterRole's ``rules``."""
        return cls(
            verbs=tuple(rule.get("verbs") or ()),
            api_groups=tuple(rule.get("apiGroups") or ()),
            resources=tuple(rule.get("resources") or ()),
            resource_names=tuple(rule.get("resourceNames") or ()),
        )

    def allows(self, a: Attributes) -> bool:
        """Whether the rule grants the request (``rbac.RuleAllows``)."""
        if "*" not in self.verbs and a.verb not in self.verbs:
            return False
        if "*" not in self.api_groups and a.group not in self.api_groups:
            return False
        if not self._resource_matches(a):
            return False
        return not self.resource_names or a.name in self.resource_names

    def _resource_matches(self, a: Attributes) -> bool:
        for res in self.resources:
            if res in ("*", a.combined):
                return True
            # "*/status" matches any resource's status (there is no "pods/*").
            if a.subresource and res == f"*/{a.subresource}":
                return True
        return False


@dataclass
class ServiceAccount:
    """A user of the simulator and what its roles grant."""

    namespace: str
    name: str
    rules: tuple[Rule, ...]

    @property
    def username(self) -> str:
        """``system:serviceaccount:<namespace>:<name>``."""
        return f"system:serviceaccount:{self.namespace}:{self.name}"


def rules_of(documents: Iterable[Mapping[str, Any]], namespace: str, name: str) -> list[JSON]:
    """The rules of every ClusterRole (and Role of ``namespace``) bound to the service account
    ``namespace/name`` by a ClusterRoleBinding (or RoleBinding) among ``documents`` (a manifest's
    objects): what the real server would grant it. A RoleBinding's rules are granted in its namespace
    only; the simulator grants them everywhere, which can only hide a 403, never invent one, and
    no shipped manifest has one."""
    docs = [d for d in documents if d]
    roles = {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d for d in docs}
    out: list[JSON] = []
    for binding in docs:
        if binding.get("kind") not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        subjects = binding.get("subjects") or []
        if not any(
            s.get("kind") == "ServiceAccount" and s.get("name") == name and s.get("namespace", namespace) == namespace
            for s in subjects
        ):
            continue
        ref = binding["roleRef"]
        scope = "" if ref["kind"] == "ClusterRole" else binding["metadata"].get("namespace", "")
        role = roles.get((ref["kind"], scope, ref["name"]))
        if role is not None:
            out += list(role.get("rules") or [])
    return out


@dataclass
class Authorizer:
    """Tokens of service accounts and their rules; thread-safe."""

    accounts: dict[str, ServiceAccount] = field(default_factory=dict)
    seen: list[tuple[str, Attributes]] = field(default_factory=list)
    """``(username, attributes)`` of every request authorized for a service account."""
    refused: list[tuple[str, Attributes]] = field(default_factory=list)
    """``(username, attributes)`` of every request answered 403."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, token: str, account: ServiceAccount) -> None:
        """Accept ``token`` as ``account``."""
        with self._lock:
            self.accounts[token] = account

    def account(self, token: str) -> ServiceAccount | None:
        """The service account whose token this is."""
        with self._lock:
            return self.accounts.get(token)

    def authorize(self, account: ServiceAccount, attrs: Attributes) -> None:
        """Return when one of the account's rules grants the request; raise the 403 otherwise."""
        allowed = any(rule.allows(attrs) for rule in account.rules)
        with self._lock:
            (self.seen if allowed else self.refused).append((account.username, attrs))
        if not allowed:
            raise forbidden(account.username, attrs)


def forbidden(username: str, a: Attributes) -> ApiError:
    """The real server's 403 for a request RBAC refuses (``responsewriters.Forbidden`` and
    ``apierrors.NewForbidden``)."""
    scope = f"in the namespace {_quote(a.namespace)}" if a.namespace else "at the cluster scope"
    why = (
        f"User {_quote(username)} cannot {a.verb} resource {_quote(a.combined)} in API group {_quote(a.group)} {scope}"
    )
    qualified = f"{a.resource}.{a.group}" if a.group else a.resource
    message = f"{qualified} {_quote(a.name)} is forbidden: {why}" if a.name else f"{qualified} is forbidden: {why}"
    details: JSON = {"name": a.name} if a.name else {}
    if a.group:
        details["group"] = a.group
    details["kind"] = a.resource
    return ApiError(403, message, details=details)


def _quote(text: str) -> str:
    """Go's ``%q`` for the plain names used here."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def name_from_field_selector(selector: str) -> str:
    """The name a list or watch is narrowed to by ``metadata.name=<n>`` (``RequestInfo`` does the same)."""
    for term in selector.split(","):
        key, sep, value = term.partition("=")
        if key.strip() == "metadata.name" and sep and not value.startswith("="):
            return value.strip()
        if key.strip() == "metadata.name" and value.startswith("="):  # metadata.name==n
            return value[1:].strip()
    return ""


_METHOD_VERBS: Mapping[str, str] = {
    "POST": "create",
    "GET": "get",
    "HEAD": "get",
    "PUT": "update",
    "PATCH": "patch",
    "DELETE": "delete",
}


def request_attributes(method: str, path: str, query: Mapping[str, str]) -> Attributes | None:
    """The authorizer's attributes of any resource request, served or not, as the real server's
    ``RequestInfoFactory`` reads them from the path alone (it authorizes before it looks for the
    resource); None for a non-resource path (``/api``, ``/apis/<group>/<version>``, ``/version`` ...)."""
    parts = [unquote(p) for p in path.strip("/").split("/") if p]
    if len(parts) < 3 or parts[0] not in ("api", "apis"):
        return None
    prefix, parts = parts[0], parts[1:]
    group = ""
    if prefix == "apis":
        if len(parts) < 3:
            return None
        group, parts = parts[0], parts[1:]
    parts = parts[1:]  # the version
    verb = _METHOD_VERBS.get(method.upper(), method.lower())
    if parts[0] in ("watch", "proxy"):
        if len(parts) < 2:
            return None
        verb, parts = parts[0], parts[1:]
    namespace = ""
    if parts[0] == "namespaces" and len(parts) > 1:
        namespace = parts[1]
        if len(parts) > 2 and parts[2] not in ("status", "finalize"):
            parts = parts[2:]
    resource = parts[0]
    name = parts[1] if len(parts) >= 2 else ""
    subresource = parts[2] if len(parts) >= 3 else ""
    if not name and verb == "get":
        verb = "watch" if query.get("watch") in ("1", "true", "True") else "list"
        name = name_from_field_selector(query.get("fieldSelector", ""))
    if not name and verb == "delete":
        verb = "deletecollection"
    return Attributes(verb, group, resource, subresource, namespace, name)


def make_rules(rules: Sequence[Mapping[str, Any]]) -> tuple[Rule, ...]:
    """Rules from a ClusterRole's ``rules`` list (nonResourceURLs rules are skipped)."""
    return tuple(Rule.from_json(r) for r in rules if not r.get("nonResourceURLs"))


# -- the shipped manifests' rules ----------------------------------------------------------------------

SHIPPED = "shipped"
"""``agent_rules`` default of the cluster harnesses: the rules the shipped manifest of the component
grants its service account (:func:`shipped_rules`). ``None`` there is explicit: unrestricted."""

_DEPLOY = Path(__file__).resolve().parent.parent / "deploy"

# component -> (manifest under deploy/, its service account in kube-system)
SHIPPED_ACCOUNTS: dict[str, tuple[str, str]] = {
    "device-plugin": ("daemonset.yaml", "gpu-manager"),
    "dra": ("dra/daemonset.yaml", "gpu-manager-dra"),
    "extender": ("extender.yaml", "gpu-manager-extender"),
}


@functools.cache
def _shipped(component: str) -> tuple[str, tuple[JSON, ...]]:
    try:
        manifest, account = SHIPPED_ACCOUNTS[component]
    except KeyError:
        raise ValueError(f"no shipped manifest for the component {component!r}") from None
    documents = list(yaml.safe_load_all((_DEPLOY / manifest).read_text()))
    rules = rules_of(documents, "kube-system", account)
    if not rules:
        raise ValueError(f"deploy/{manifest} binds no rules to kube-system/{account}")
    return account, tuple(rules)


def shipped_rules(component: str) -> list[JSON]:
    """What the shipped manifest of ``component`` (``device-plugin``: deploy/daemonset.yaml, the
    chart's default rendering; ``dra``: deploy/dra/daemonset.yaml; ``extender``: deploy/extender.yaml)
    grants its service account in ``kube-system``."""
    return [dict(rule) for rule in _shipped(component)[1]]


def shipped_account(component: str) -> str:
    """The name of ``component``'s service account in ``kube-system`` (see :func:`shipped_rules`)."""
    return _shipped(component)[0]


def resolve_rules(
    rules: Sequence[Mapping[str, Any]] | str | None, component: str
) -> Sequence[Mapping[str, Any]] | None:
    """A harness's ``agent_rules`` argument made concrete: :data:`SHIPPED` -> :func:`shipped_rules`,
    ``None`` (unrestricted) and explicit rules as given."""
    if rules is None or not isinstance(rules, str):
        return rules
    if rules != SHIPPED:
        raise ValueError(f"agent_rules={rules!r}: expected {SHIPPED!r}, None or a list of rules")
    return shipped_rules(component)
