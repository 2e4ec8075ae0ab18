"""What the app remembers between runs (XDG state): the active profile and the chat's settings."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields, replace
from pathlib import Path

from ...engine.errors import ConfigError, S2MoEError
from ...engine.files import read_bounded, read_json, state_dir, write_atomic
from .chat_settings import ChatSettings, engine_modes

# What the app keeps here is a few hundred bytes; the bound keeps a wrong file from being read whole.
MAX_STATE_BYTES = 1 << 20


def _active_file() -> Path:
    return state_dir() / "active-profile"


def remembered_profile() -> str | None:
    """The profile the app had active when it last changed, if it still loads (a profile deleted or
    broken since then is forgotten, not an error at start-up)."""
    from ...engine.profiles import load_profile

    try:
        name = read_bounded(_active_file(), "active profile", MAX_STATE_BYTES).decode("utf-8").strip()
    except (S2MoEError, UnicodeDecodeError):
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
        write_atomic(_active_file(), (name or "") + "\n", "active profile")
    except (OSError, S2MoEError):
        pass


def _settings_file() -> Path:
    return state_dir() / "chat-settings.json"


def remember_settings(values: dict) -> None:
    """Keep the chat's settings (mode, k_d, n, …) for the next run; unwritable state only loses that."""
    try:
        state_dir().mkdir(parents=True, exist_ok=True)
        write_atomic(_settings_file(), json.dumps(values, indent=1, sort_keys=True) + "\n", "chat settings")
    except (OSError, S2MoEError):
        pass


def remembered_settings() -> dict:
    """The chat's settings as last remembered ({} when there are none yet). A file that is not a JSON object
    (not JSON, not a regular file, nested too deep, …) is a ConfigError saying so: the caller starts from the
    defaults and tells the user once, rather than forgetting the settings without a word. The caller keeps only
    the values it still accepts."""
    path = _settings_file()
    if not os.path.lexists(path):
        return {}
    data = read_json(path, "chat settings", MAX_STATE_BYTES)
    if not isinstance(data, dict):
        raise ConfigError(f"chat settings {path}: not a JSON object")
    return data


def settings_from_state(data: dict) -> ChatSettings:
    """The chat's settings as remembered (state.remembered_settings): each value kept where it has its
    field's type, then the whole kept only if the engine accepts it; anything else is the default."""
    from ...engine.decoding.generation_config import GenerationConfig

    kept = {}
    for f in fields(ChatSettings):
        if f.name not in data:
            continue
        v = data[f.name]
        allowed = {t.strip() for t in str(f.type).split("|")}
        if isinstance(v, int) and not isinstance(v, bool) and "float" in allowed and "int" not in allowed:
            try:
                v = float(v)  # JSON's 2 for 2.0; one of hundreds of digits is no float
            except OverflowError:
                continue
        if (
            (v is None and "None" in allowed)
            or (isinstance(v, bool) and "bool" in allowed)
            or (isinstance(v, str) and "str" in allowed)
            or (isinstance(v, int) and not isinstance(v, bool) and "int" in allowed)
            or (isinstance(v, float) and "float" in allowed)
        ):
            kept[f.name] = v
    settings = replace(ChatSettings(), **kept)
    if settings.mode not in engine_modes():
        settings = replace(settings, mode=ChatSettings.mode)
    engine = {f.name for f in fields(GenerationConfig)}
    try:
        GenerationConfig(**{k: v for k, v in asdict(settings).items() if k in engine and v is not None}).validate()
    except (S2MoEError, TypeError):
        return ChatSettings()
    return settings
