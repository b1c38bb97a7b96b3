"""Kubernetes quantities: compared by value (the API server answers them in canonical form)."""

from __future__ import annotations

import re
from decimal import Decimal

from gpumanager import lazy_package

_QUANTITY = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+|[numkMGTPE]|[KMGTPE]i)?$", re.ASCII)
_BINARY = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))


class QuantityError(ValueError):
    """Text that is not a Kubernetes quantity."""


def parse(text: object) -> Decimal:
    """The exact value of a quantity (``"4Gi"``, ``"30"``, ``30``); QuantityError otherwise."""
    raw = str(text).strip() if isinstance(text, str | int) and not isinstance(text, bool) else None
    if raw is None or not _QUANTITY.match(raw):
        raise QuantityError(f"{text!r} is not a quantity")
    try:
        return Decimal(lazy_package.import_module("kubernetes.utils.quantity").parse_quantity(raw))
    except ValueError as exc:
        raise QuantityError(f"{text!r} is not a quantity: {exc}") from None


def format_bytes(amount: int) -> str:
    """Bytes in the largest binary unit that divides them (``85899345920`` -> ``80Gi``)."""
    for suffix, power in _BINARY:
        if amount and amount % (1 << power) == 0:
            return f"{amount >> power}{suffix}"
    return str(amount)


def same(a: object, b: object) -> bool:
    """Whether two quantities have the same value (False when either is not a quantity)."""
    try:
        return parse(a) == parse(b)
    except QuantityError:
        return False
