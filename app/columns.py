"""Which columns of a table fit a width: one rule for the app's tables and the CLI's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    """A table column. Lower `priority` is kept longer as the table narrows; a column with `min_width`
    shrinks to the room left (down to that width) instead of being dropped."""

    key: str
    label: str
    width: int
    priority: float
    min_width: int | None = None


def columns_that_fit(columns: Sequence[Column], room: int, padding: int = 1) -> list[tuple[Column, int]]:
    """The columns to show in `room` cells, in their display order, each with the width it gets.

    Columns are admitted by priority; each costs its width plus the cell padding on both sides. The first
    column (by priority) is always shown, so a very narrow table still says what its rows are."""
    chosen: dict[str, int] = {}
    left = room
    for col in sorted(columns, key=lambda c: c.priority):
        cost = col.width + 2 * padding
        if cost <= left or not chosen:
            chosen[col.key] = col.width
        elif col.min_width is not None and col.min_width + 2 * padding <= left:
            chosen[col.key] = left - 2 * padding
        else:
            continue
        left -= chosen[col.key] + 2 * padding
    return [(c, chosen[c.key]) for c in columns if c.key in chosen]
