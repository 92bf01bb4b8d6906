"""Units the whole project counts in: bytes (GB = 1e9, GiB = 2**30), sizes written as text, and
the number formats the book and the reports print. Pure Python: the ledger and the engine share it."""
from __future__ import annotations

import re

GB = 10**9
GiB = 2**30
MiB = 2**20
KiB = 2**10

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12,
          "kib": KiB, "mib": MiB, "gib": GiB, "tib": 2**40}
_BYTE_UNITS = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "KB": 10**3, "MB": 10**6, "GB": GB}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def parse_size(text: str | int | float) -> int:
    """Bytes in ``"24GiB"``, ``"80GB"``, ``"512MiB"`` or a plain number; positive only."""
    if isinstance(text, bool):
        raise ValueError(f"size must be a number of bytes or a text like 24GiB, got {text!r}")
    if isinstance(text, (int, float)):
        value, unit = float(text), "b"
    else:
        match = _SIZE.match(str(text))
        if not match:
            raise ValueError(f"cannot read the size {text!r}: write a positive number with a unit, "
                             f"e.g. 24GiB, 80GB, 512MiB")
        value, unit = float(match.group(1)), (match.group(2) or "b").lower()
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return size


def fmt_int(x: float) -> str:
    """``8,030,261,248``: integers with thousands separators, as the book prints them."""
    return f"{round(x):,}"


def fmt_bytes(x: float, unit: str | None = None, digits: int = 2) -> str:
    """``14.96 GiB``, ``16.06 GB``, ``128 KiB``; ``unit=None`` picks GiB, MiB, KiB or B by size
    (and drops trailing zeros: ``24 GiB``, ``6.86 GiB``)."""
    if unit is None:
        unit = next((u for u in ("GiB", "MiB", "KiB") if abs(x) >= _BYTE_UNITS[u]), "B")
        value = round(x / _BYTE_UNITS[unit], digits)
        return f"{value:,g} {unit}" if unit != "B" else f"{x:,.0f} B"
    if unit not in _BYTE_UNITS:
        raise ValueError(f"unit must be one of {', '.join(_BYTE_UNITS)}, got {unit!r}")
    return f"{x / _BYTE_UNITS[unit]:,.{digits}f} {unit}"


def fmt_seconds(x: float | None) -> str:
    """``12.3 ms`` under a second, ``1.23 s`` from there; ``-`` for None (nothing measured)."""
    if x is None:
        return "-"
    return f"{x * 1e3:,.1f} ms" if x < 1 else f"{x:,.2f} s"


def fmt_or_dash(x: float | None, spec: str) -> str:
    """``x`` in the format ``spec`` (``".0%"``, ``".0f"``); ``-`` for None (nothing measured)."""
    return "-" if x is None else format(x, spec)
