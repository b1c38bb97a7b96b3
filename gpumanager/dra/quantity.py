"""Kubernetes quantities: compared by value (the API server answers them in canonical form)."""

from __future__ import annotations

import math
import re
from decimal import Decimal

from gpumanager import lazy_package

_QUANTITY = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+|[numkMGTPE]|[KMGTPE]i)?\Z", re.ASCII)
_BINARY = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))


#: How much of an odd value an error shows.
SHOWN_CHARS = 80


class QuantityError(ValueError):
    """Text that is not a Kubernetes quantity."""


def shown(value: object) -> str:
    """``repr(value)`` for an error, cut short (with its length) when longer than :data:`SHOWN_CHARS`."""
    try:
        text = repr(value)
    except ValueError:  # an int of more than 4300 digits
        return f"<{type(value).__name__} too long to show>"
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}... ({len(value) if isinstance(value, str) else len(text)} characters)"


def parse(text: object) -> Decimal:
    """The exact value of a quantity (``"4Gi"``, ``"30"``, ``30``, ``1.5``); QuantityError otherwise.

    Only the API server's grammar is taken (ASCII digits, sign, point, exponent, one suffix, spaces
    around trimmed): ``Decimal()`` alone would also read ``5_000``, other scripts' digits and ``5 k``.
    """
    if isinstance(text, int | float) and not isinstance(text, bool):
        # A JSON number (the API server takes one for a quantity and answers it as text).
        if isinstance(text, float) and not math.isfinite(text):
            raise QuantityError(f"{shown(text)} is not a quantity")
        return Decimal(text)
    raw = text.strip() if isinstance(text, str) else None
    if raw is None or not _QUANTITY.match(raw):
        raise QuantityError(f"{shown(text)} is not a quantity")
    try:
        return Decimal(lazy_package.import_module("kubernetes.utils.quantity").parse_quantity(raw))
    except ValueError as exc:
        raise QuantityError(f"{shown(text)} is not a quantity: {str(exc)[:SHOWN_CHARS]}") from None


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
