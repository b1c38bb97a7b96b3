"""Label and field selectors as the API server parses and applies them.

Label selectors follow ``k8s.io/apimachinery/pkg/labels``: ``k=v``, ``k==v``, ``k!=v``,
``k in (a,b)``, ``k notin (a,b)``, ``k`` (exists), ``!k`` (does not exist), ``k>1``, ``k<1``,
joined by commas (AND). ``!=`` and ``notin`` also match objects without the label.

Field selectors follow ``k8s.io/apimachinery/pkg/fields``: ``f=v``, ``f==v``, ``f!=v`` joined by
commas, with ``\\`` escaping ``,``, ``=`` and ``!``; each resource supports a fixed set of fields
(an unsupported one is a 400, as on the real server).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from simnode.apiserver_errors import ApiError, bad_request

log = logging.getLogger(__name__)

JSON = dict[str, Any]

_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_QUALIFIED_KEY = re.compile(rf"^({_PREFIX}/)?{_NAME}$")
_LABEL_VALUE = re.compile(rf"^({_NAME})?$")
_TOKEN = r"[^\s=!<>(),]+"
_RE_NOT_EXISTS = re.compile(rf"^!\s*({_TOKEN})$")
_RE_SET = re.compile(rf"^({_TOKEN})\s+(in|notin)\s*\((.*)\)$")
_RE_CMP = re.compile(rf"^({_TOKEN})\s*(==|=|!=|>|<)\s*([^\s=!<>(),]*)$")
_RE_EXISTS = re.compile(rf"^({_TOKEN})$")


def valid_label_key(key: str) -> bool:
    """Whether ``key`` is a qualified name (``[prefix/]name``, name at most 63 characters)."""
    if not _QUALIFIED_KEY.match(key):
        return False
    prefix, _, name = key.rpartition("/")
    return len(name) <= 63 and len(prefix) <= 253


def valid_label_value(value: str) -> bool:
    """Whether ``value`` is a valid label value (empty, or at most 63 alphanumerics, ``-_.`` inside)."""
    return len(value) <= 63 and bool(_LABEL_VALUE.match(value))


@dataclass(frozen=True)
class LabelRequirement:
    """One term of a label selector."""

    key: str
    op: str
    """One of ``=``, ``!=``, ``in``, ``notin``, ``exists``, ``!``, ``>``, ``<``."""
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether a label map satisfies this term."""
        has = self.key in labels
        value = labels.get(self.key)
        if self.op in ("=", "in"):
            return has and value in self.values
        if self.op in ("!=", "notin"):
            return not has or value not in self.values
        if self.op == "exists":
            return has
        if self.op == "!":
            return not has
        if not has or value is None:
            return False
        try:
            have = int(value)
        except ValueError:
            return False
        want = int(self.values[0])
        return have > want if self.op == ">" else have < want


@dataclass(frozen=True)
class LabelSelector:
    """A parsed label selector: every requirement must hold."""

    requirements: tuple[LabelRequirement, ...] = ()

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        """Whether ``labels`` (``None`` = no labels) satisfies the selector."""
        have = labels or {}
        return all(r.matches(have) for r in self.requirements)

    @property
    def empty(self) -> bool:
        """True when the selector selects everything."""
        return not self.requirements


def _split_top_level(text: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


def _label_error(term: str, why: str) -> ApiError:
    return bad_request(f"unable to parse requirement: {why} (in {term!r})")


def _check_key(term: str, key: str) -> None:
    if not valid_label_key(key):
        raise _label_error(
            term,
            f'key: Invalid value: "{key}": name part must consist of alphanumeric characters, '
            "'-', '_' or '.', and must start and end with an alphanumeric character",
        )


def _check_value(term: str, value: str) -> None:
    if not valid_label_value(value):
        raise _label_error(
            term,
            f'values[0]: Invalid value: "{value}": a valid label must be an empty string or consist of '
            "alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character",
        )


def _parse_label_term(term: str) -> LabelRequirement:
    text = term.strip()
    if m := _RE_NOT_EXISTS.match(text):
        _check_key(term, m.group(1))
        return LabelRequirement(m.group(1), "!")
    if m := _RE_SET.match(text):
        key, op, inner = m.group(1), m.group(2), m.group(3)
        _check_key(term, key)
        values = tuple(v.strip() for v in inner.split(",")) if inner.strip() else ()
        if not values:
            raise _label_error(term, "for 'in', 'notin' operators, values set can't be empty")
        for v in values:
            _check_value(term, v)
        return LabelRequirement(key, op, values)
    if m := _RE_CMP.match(text):
        key, op, value = m.group(1), m.group(2), m.group(3)
        _check_key(term, key)
        if op in (">", "<"):
            try:
                int(value)
            except ValueError:
                raise _label_error(term, f"for 'Gt', 'Lt' operators, the value must be an integer: {value!r}") from None
            return LabelRequirement(key, op, (value,))
        _check_value(term, value)
        return LabelRequirement(key, "=" if op in ("=", "==") else "!=", (value,))
    if m := _RE_EXISTS.match(text):
        _check_key(term, m.group(1))
        return LabelRequirement(m.group(1), "exists")
    raise _label_error(term, "found unexpected token")


def parse_label_selector(text: str | None) -> LabelSelector:
    """Parse a ``labelSelector`` query value; raises :class:`ApiError` 400 when malformed."""
    if text is None or not text.strip():
        return LabelSelector()
    return LabelSelector(tuple(_parse_label_term(term) for term in _split_top_level(text)))


# --------------------------------------------------------------------------------------------
# field selectors


@dataclass(frozen=True)
class FieldRequirement:
    """One term of a field selector."""

    field: str
    equal: bool
    value: str


@dataclass(frozen=True)
class FieldSelector:
    """A parsed field selector: every requirement must hold."""

    requirements: tuple[FieldRequirement, ...] = ()

    def matches(self, fields: Mapping[str, str]) -> bool:
        """Whether an object's selectable fields satisfy the selector."""
        return all((fields.get(r.field, "") == r.value) == r.equal for r in self.requirements)

    @property
    def empty(self) -> bool:
        """True when the selector selects everything."""
        return not self.requirements


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    escaped = False
    for ch in text:
        if escaped:
            current.append("\\" + ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == sep:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if escaped:
        current.append("\\")
    parts.append("".join(current))
    return parts


def _unescape(text: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt not in "\\,=!":
                raise bad_request(f"invalid field selector: invalid escape sequence: \\{nxt}")
            out.append(nxt)
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def _find_operator(term: str) -> tuple[int, str] | None:
    i = 0
    while i < len(term):
        ch = term[i]
        if ch == "\\":
            i += 2
            continue
        if term.startswith("!=", i):
            return i, "!="
        if term.startswith("==", i):
            return i, "=="
        if ch == "=":
            return i, "="
        i += 1
    return None


def parse_field_selector(text: str | None, supported: Mapping[str, Callable[[JSON], str]]) -> FieldSelector:
    """Parse a ``fieldSelector`` query value against the fields a resource supports."""
    if text is None or not text.strip():
        return FieldSelector()
    reqs: list[FieldRequirement] = []
    for term in _split_unescaped(text, ","):
        found = _find_operator(term)
        if found is None:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{term}'")
        pos, op = found
        field = _unescape(term[:pos]).strip()
        value = _unescape(term[pos + len(op) :])
        if field not in supported:
            raise bad_request(f"field label not supported: {field}")
        reqs.append(FieldRequirement(field, op != "!=", value))
    return FieldSelector(tuple(reqs))


def _path(obj: JSON, *keys: str) -> Any:
    cur: Any = obj
    for key in keys:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(key)
    return cur


def _str_field(*keys: str) -> Callable[[JSON], str]:
    def get(obj: JSON) -> str:
        value = _path(obj, *keys)
        return "" if value is None else str(value)

    return get


def _bool_field(*keys: str) -> Callable[[JSON], str]:
    def get(obj: JSON) -> str:
        return "true" if _path(obj, *keys) is True else "false"

    return get


POD_FIELDS: Mapping[str, Callable[[JSON], str]] = {
    "metadata.name": _str_field("metadata", "name"),
    "metadata.namespace": _str_field("metadata", "namespace"),
    "spec.nodeName": _str_field("spec", "nodeName"),
    "spec.restartPolicy": _str_field("spec", "restartPolicy"),
    "spec.schedulerName": _str_field("spec", "schedulerName"),
    "spec.serviceAccountName": _str_field("spec", "serviceAccountName"),
    "spec.hostNetwork": _bool_field("spec", "hostNetwork"),
    "status.phase": _str_field("status", "phase"),
    "status.podIP": _str_field("status", "podIP"),
    "status.nominatedNodeName": _str_field("status", "nominatedNodeName"),
}
"""The pod fields the real server can select on (``pod.ToSelectableFields``)."""

NODE_FIELDS: Mapping[str, Callable[[JSON], str]] = {
    "metadata.name": _str_field("metadata", "name"),
    "spec.unschedulable": _bool_field("spec", "unschedulable"),
}
"""The node fields the real server can select on."""


def selectable_fields(obj: JSON, supported: Mapping[str, Callable[[JSON], str]]) -> dict[str, str]:
    """Every selectable field of ``obj``."""
    return {name: get(obj) for name, get in supported.items()}
