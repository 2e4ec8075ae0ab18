"""Device profiles: measured (or published reference) cost constants per device and model.

A profile is YAML. Constants for a model are keyed by the model's fingerprint so that a profile
calibrated for one model is never silently applied to another; a profile may also carry `reference`
constants (published figures) that apply to any model, reported as such.

    name: cpu-2core
    kind: measured            # or: reference
    device: {name: ..., kind: cpu|gpu|jetson, memory_bytes: ...}
    models:
      <fingerprint>:
        model: olmoe-tiny.gguf
        t_ar_ms: 10.0
        c_draft_ms: 7.7
        t_exp_ms: 0.05
        t_tok_ms: 4.0
        intercept_ms: 1.0
    reference: {t_ar_ms: 100, c_draft_ms: 7.5, t_exp_ms: 0.156, t_tok_ms: 0, intercept_ms: 0}
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from .errors import ConfigError
from .events import CostConstants

_CONST_KEYS = ("t_ar_ms", "c_draft_ms", "t_exp_ms")
_OPTIONAL_KEYS = ("t_tok_ms", "intercept_ms")


def user_profile_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "s2moe" / "profiles"


def shipped_profile_dir() -> Path:
    from .. import profiles

    return Path(profiles.__file__).parent


def find_profile(name: str) -> Path:
    candidate = Path(name)
    if candidate.suffix in (".yaml", ".yml") and candidate.is_file():
        return candidate
    for folder in (user_profile_dir(), shipped_profile_dir()):
        for suffix in (".yaml", ".yml"):
            p = folder / f"{name}{suffix}"
            if p.is_file():
                return p
    raise ConfigError(f"no profile named {name!r} (looked in {user_profile_dir()} and the shipped profiles)")


def load_profile(name: str) -> dict:
    path = find_profile(name)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"profile {path.name}: invalid YAML{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"profile {path.name}: expected a mapping at top level")
    data.setdefault("name", path.stem)
    data["_path"] = str(path)
    return data


def _constants(block: dict, where: str, source: str) -> CostConstants:
    if not isinstance(block, dict):
        raise ConfigError(f"{where}: expected a mapping of constants")
    values = {}
    for key in _CONST_KEYS + _OPTIONAL_KEYS:
        if key not in block:
            if key in _CONST_KEYS:
                raise ConfigError(f"{where}: missing field {key}")
            values[key] = 0.0
            continue
        v = block[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ConfigError(f"{where}: field {key} must be a non-negative number, got {v!r}")
        values[key] = float(v)
    if values["t_ar_ms"] <= 0:
        raise ConfigError(f"{where}: field t_ar_ms must be positive")
    fit = block.get("fit") or {}
    return CostConstants(
        t_ar=values["t_ar_ms"] / 1e3,
        c_draft=values["c_draft_ms"] / 1e3,
        t_exp=values["t_exp_ms"] / 1e3,
        t_tok=values["t_tok_ms"] / 1e3,
        intercept=values["intercept_ms"] / 1e3,
        source=source,
        r2=fit.get("r2") if isinstance(fit, dict) else None,
        mape=fit.get("mape") if isinstance(fit, dict) else None,
    )


def cost_for_model(profile: dict, fingerprint: str, model_name: str = "") -> CostConstants:
    """The profile's constants for this model, or its reference constants, or a clear error."""
    name = profile.get("name", "?")
    models = profile.get("models") or {}
    if not isinstance(models, dict):
        raise ConfigError(f"profile {name}: field models must be a mapping of fingerprint → constants")
    if fingerprint in models:
        return _constants(models[fingerprint], f"profile {name}, model {fingerprint}", f"profile:{name}")
    if profile.get("reference") is not None:
        return _constants(profile["reference"], f"profile {name}, reference", f"profile:{name} (reference values)")
    raise ConfigError(
        f"profile {name} was not calibrated for this model ({model_name or 'fingerprint'} {fingerprint}); "
        f"run `s2moe calibrate --model ... --name {name}`"
    )
