"""Start-up cost constants measured under a memory budget, remembered between runs.

Without a profile a generation measures what its steps cost before it starts. Resident, that takes a
fraction of a second; under a budget, a model many times the budget's size reads its experts from storage in
every step, and the measurement takes a minute. What it finds depends on the model, the budget (its size,
what is pinned, the batch), the threads and the llama.cpp build: a later run with all of them the same
reads it back instead of measuring again. `s2moe calibrate --budget` stays the way to measure on purpose; a
profile's constants are used before anything remembered here.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ..errors import S2MoEError
from ..events import CostConstants
from ..files import read_json, state_dir, write_atomic

_MAX_BYTES = 4 << 20
_KEEP = 64  # entries: one per model, budget and setting a user runs


def _file() -> Path:
    return state_dir() / "startup-costs.json"


def _entries() -> dict[str, Any]:
    try:
        entries = read_json(_file(), "record", _MAX_BYTES)
    except S2MoEError:  # a record that cannot be read is measured again, not reported
        return {}
    return entries if isinstance(entries, dict) else {}


def recall(key: str) -> CostConstants | None:
    entry = _entries().get(key)
    if not isinstance(entry, dict):
        return None
    try:
        cost = CostConstants(**entry["cost"])
    except (KeyError, TypeError):
        return None
    return replace(cost, source=f"measured at start-up under this budget on {entry.get('when', '?')}, remembered")


def remember(key: str, cost: CostConstants) -> None:
    entries = _entries()
    entries.pop(key, None)
    entries[key] = {"cost": asdict(cost), "when": time.strftime("%Y-%m-%d %H:%M")}
    while len(entries) > _KEEP:
        entries.pop(next(iter(entries)))
    try:
        _file().parent.mkdir(parents=True, exist_ok=True)
        write_atomic(_file(), json.dumps(entries, indent=1) + "\n", "record")
    except (OSError, S2MoEError):
        pass  # an unwritable state folder only means the next run measures again
