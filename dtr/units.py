"""Byte quantities: parsing budgets and printing sizes."""

from __future__ import annotations

import math
import re
from fractions import Fraction

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE](\d+))?\s*([a-zA-Z]*)\s*$")
MAX_BYTES = 2**63 - 1
ACCEPTED = (
    "a positive number of bytes (int), or a string such as '800000B', '512MB', "
    "'1.5GiB' (units B, KB, MB, GB, TB in powers of 1000; KiB, MiB, GiB, TiB in "
    "powers of 1024), or a percentage of the device's memory such as '80%'"
)


def parse_bytes(value: object) -> int:
    """Parse a byte count. Raises ValueError (without the dtr prefix) when malformed."""
    if isinstance(value, bool):
        raise ValueError("a bool is not a byte count")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("not a finite number")
        nbytes = math.floor(value)
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        if match is None:
            raise ValueError("not a number with an optional unit")
        number, exponent, unit = match.groups()
        scale = _UNITS.get(unit.lower() if unit else "b")
        if scale is None:
            raise ValueError(f"unknown unit {unit!r}")
        if exponent and int(exponent) > 30:  # 10**huge would take forever to build
            raise ValueError(f"more than {MAX_BYTES} bytes")
        # Exact arithmetic: in floats "8.2MB" is 8199999 bytes, and "1e400" overflows.
        amount = Fraction(number) * (10 ** int(exponent) if exponent else 1)
        nbytes = math.floor(amount * scale)
    else:
        raise ValueError(f"a {type(value).__name__} is not a byte count")
    if nbytes <= 0:
        raise ValueError("must be at least one byte")
    if nbytes > MAX_BYTES:  # the C++ core counts bytes in an int64
        raise ValueError(f"more than {MAX_BYTES} bytes")
    return nbytes


def format_bytes(nbytes: int | float | None) -> str:
    """1536 -> '1.50 KiB'."""
    if nbytes is None:
        return "unlimited"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
