"""What the app remembers between runs (XDG state): the active profile."""

from __future__ import annotations

import os
from pathlib import Path

from ...engine.bench import write_atomic
from ...engine.errors import S2MoEError


def state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "s2moe"


def _active_file() -> Path:
    return state_dir() / "active-profile"


def remembered_profile() -> str | None:
    """The profile the app had active when it last changed, if it still loads (a profile deleted or
    broken since then is forgotten, not an error at start-up)."""
    from ...engine.profiles import load_profile

    try:
        name = _active_file().read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not name:
        return None
    try:
        load_profile(name)
    except S2MoEError:
        return None
    return name


def remember_profile(name: str | None) -> None:
    """Keep the active profile for the next run; a state folder that cannot be written only loses that."""
    try:
        state_dir().mkdir(parents=True, exist_ok=True)
        write_atomic(_active_file(), (name or "") + "\n")
    except OSError:
        pass
