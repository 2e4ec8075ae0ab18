"""What the app remembers between runs (XDG state): the active profile and the chat's settings."""

from __future__ import annotations

import json
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


def _settings_file() -> Path:
    return state_dir() / "chat-settings.json"


def remember_settings(values: dict) -> None:
    """Keep the chat's settings (mode, k_d, n, …) for the next run; unwritable state only loses that."""
    try:
        state_dir().mkdir(parents=True, exist_ok=True)
        write_atomic(_settings_file(), json.dumps(values, indent=1, sort_keys=True) + "\n")
    except OSError:
        pass


def remembered_settings() -> dict:
    """The chat's settings as last remembered ({} when there are none or the file is not a JSON object:
    forgotten, never an error at start-up). The caller keeps only the values it still accepts."""
    try:
        data = json.loads(_settings_file().read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
