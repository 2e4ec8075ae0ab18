"""Sizes in bytes: one parser for every size a user types (budgets, the wizard's fields), one formatter."""

from __future__ import annotations

import math
import os
import re

from ..errors import ConfigError

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MAX_SIZE = float(1 << 62)  # far beyond any memory, and still an int64 for cgroup files

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
}


def parse_size(text: str | int) -> int:
    """'800M', '1.5G', '300MiB', '2GB', '123456' → bytes (K/M/G alone are binary, as in `free`)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"invalid size {text!r}: use a number with an optional unit, e.g. 800M, 1.5G, 300MiB")
        number = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if not number < MAX_SIZE:  # also inf, from a number of hundreds of digits
            raise ConfigError(f"size {str(text)[:24]}{'…' if len(str(text)) > 24 else ''} is too large")
        value = int(number)
    if value < PAGE:
        raise ConfigError(f"size {text!r} is too small (at least one page, {PAGE} bytes)")
    return value


def fmt_bytes(n: float, *, round_up: bool = False) -> str:
    """'83.3 MiB'; round_up: never less than n (a least size stated must be enough as printed)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{math.ceil(n) if round_up else n:.0f} B"
            return f"{math.ceil(n * 10) / 10 if round_up else n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
