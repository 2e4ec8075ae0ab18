"""Device profiles: measured (or published reference) cost constants per device and model.

Where profiles are (the user's folder under XDG_CONFIG_HOME, then the shipped ones), finding one by name,
loading and listing them, writing one atomically, and reading from one the constants, hot experts and
tuned settings the engine decodes a model with. What a profile holds, and the checks it passes on load
and on save, are in profile_schema.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import files
from .errors import ConfigError
from .events import CostConstants
from .files import read_bounded
from .profile_schema import STORAGE_KEYS, TUNED_KEYS, validate_constants, validate_profile

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def user_profile_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "s2moe" / "profiles"


def shipped_profile_dir() -> Path:
    from .. import profiles

    return Path(profiles.__file__).parent


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(f"invalid profile name {name!r}: use letters, digits, '.', '_' or '-' (at most 64, no '/')")
    return name


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


# A profile is a few kilobytes (hot_experts of a 100-layer, 256-expert model stays under 1 MiB); the bound
# keeps a large file dropped into a profile folder from being read into memory whole.
MAX_PROFILE_BYTES = 8 << 20


def profile_text(path: Path) -> str:
    """A profile file's text, read with a bound; ConfigError when unreadable, not a regular file, too large
    or not UTF-8."""
    raw = read_bounded(path, "profile", MAX_PROFILE_BYTES)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"profile {path.name}: not UTF-8 text") from None


def _parse(path: Path) -> object:
    try:
        return yaml.safe_load(profile_text(path))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"profile {path.name}: invalid YAML{where}") from None
    except ValueError:  # an integer of more digits than Python converts
        raise ConfigError(f"profile {path.name}: a number too long to read") from None
    except RecursionError:
        raise ConfigError(f"profile {path.name}: nested too deeply") from None


def _checked(data: object, path: Path) -> dict[str, Any]:
    data = validate_profile(data, f"profile {path.name}")
    data.setdefault("name", path.stem)
    data.setdefault("kind", "measured")
    data["_path"] = str(path)
    return data


def load_profile(name: str) -> dict[str, Any]:
    path = find_profile(name)
    return _checked(_parse(path), path)


@dataclass(frozen=True)
class ProfileEntry:
    """A profile file as `--profile NAME` would find it: its data, or why it would not load."""

    name: str
    path: Path
    where: str  # "user" or "shipped"
    data: dict[str, Any] | None  # as loaded; as written when invalid; None when not a YAML mapping
    error: str | None = None  # what loading it by name would say

    @property
    def kind(self) -> str:
        """The profile's `kind` as loading it gives (measured when it has none, which is what calibrate's
        merge into an existing profile acts on), or "invalid"."""
        if self.error is not None:
            return "invalid"
        assert self.data is not None  # list_profiles gives an entry without an error the profile it loaded
        return str(self.data["kind"])

    @property
    def device(self) -> str:
        dev = (self.data or {}).get("device")
        if not isinstance(dev, dict):
            return ""
        return str(dev.get("name") or dev.get("kind") or "")

    @property
    def n_models(self) -> int:
        models = (self.data or {}).get("models")
        return len(models) if isinstance(models, dict) else 0

    def covers(self, fingerprint: str | None) -> str:
        """What cost_for_model would use for this model: "measured" constants, "reference" ones, or ""."""
        if self.data is None or self.error is not None:
            return ""
        models = self.data.get("models") or {}
        if fingerprint and isinstance(models, dict) and fingerprint in models:
            return "measured"
        if self.data.get("reference") is not None:
            return "reference"
        return ""


def list_profiles() -> list[ProfileEntry]:
    """Every profile loadable by name, the user's first, then the shipped ones not shadowed by a user
    profile of the same name; each folder in file name order. An invalid one is listed with its error."""
    out: list[ProfileEntry] = []
    seen: set[str] = set()
    for where, folder in (("user", user_profile_dir()), ("shipped", shipped_profile_dir())):
        if not folder.is_dir():
            continue
        for path in sorted(list(folder.glob("*.yaml")) + list(folder.glob("*.yml"))):
            if path.stem in seen:
                continue
            seen.add(path.stem)
            data: object = None
            error: str | None = None
            try:
                data = _parse(path)
                data = _checked(data, path)
            except ConfigError as e:
                error = str(e)
            out.append(ProfileEntry(path.stem, path, where, data if isinstance(data, dict) else None, error))
    return out


class _Dumper(yaml.SafeDumper):
    """Lists of short scalar lists (hot_experts pairs) in flow style: one line per few pairs."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    pairs = bool(data) and all(
        isinstance(x, list) and len(x) <= 3 and all(isinstance(v, (int, float)) for v in x) for x in data
    )
    flat = all(not isinstance(x, (list, dict)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True if (pairs or flat) else None)


_Dumper.add_representer(list, _represent_list)


# Room a profile write asks for: a profile is a few kilobytes, hot_experts of a 100-layer, 256-expert model
# stays under 1 MiB.
PROFILE_ROOM_BYTES = 1 << 20


def check_writable(name: str, folder: Path | None = None) -> Path:
    """Where save_profile(name, folder) would write, checked by doing it (files.check_writable): the folder
    can be made and takes a new file, the room for a profile is free, and the target is not a folder.
    ConfigError otherwise. Calibration asks before it measures, not after minutes of measurements."""
    check_name(name)
    folder = Path(folder) if folder is not None else user_profile_dir()
    target = folder / f"{name}.yaml"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot write profile {target}: {e.strerror}") from None
    written = files.check_writable(target, "profile")
    try:
        free = shutil.disk_usage(written.parent).free
    except OSError as e:
        raise ConfigError(f"cannot write profile {target}: {e.strerror}") from None
    if free < PROFILE_ROOM_BYTES:
        raise ConfigError(
            f"cannot write profile {target}: {free >> 10} KiB free, a profile needs up to "
            f"{PROFILE_ROOM_BYTES >> 20} MiB"
        )
    return target


def save_profile(profile: dict[str, Any], name: str, folder: Path | None = None) -> Path:
    """Validate and write `profile` as <folder or user dir>/<name>.yaml in one step (files.write_atomic): an
    interruption leaves either the old file or the new one, never a partial one, a symbolic link is written
    through, and the next save removes a temporary file that a killed one left."""
    check_name(name)
    data = {k: v for k, v in profile.items() if not k.startswith("_")}
    data["name"] = name
    validate_profile(data, f"profile {name}")
    folder = Path(folder) if folder is not None else user_profile_dir()
    target = folder / f"{name}.yaml"
    text = "# s2moe device profile (written by s2moe calibrate; schema in engine/profile_schema.py)\n"
    text += yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=120, allow_unicode=True)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot write profile {target}: {e.strerror}") from None
    files.write_atomic(target, text, "profile")
    return target


# -- constants for the engine -------------------------------------------------------------------------
def _constants(
    block: dict[str, Any], where: str, source: str, offloaded: bool = False, experts_in_host: bool = False
) -> CostConstants:
    validate_constants(block, where)

    def ms(key: str, default: float = 0.0) -> float:
        v = block.get(key)
        return default if v is None else float(v)

    fit = block.get("fit") or {}
    t_exp, t_tok, intercept = ms("t_exp_ms"), ms("t_tok_ms"), ms("intercept_ms")
    t_ar, c_draft = ms("t_ar_ms"), ms("c_draft_ms")
    if offloaded:
        # under a budget a plain step (what an accepted token saves) and a draft step cost what they
        # cost there: use the steps measured under the budget where the profile has them
        if block.get("t_ar_cold_ms"):
            t_ar = ms("t_ar_cold_ms")
        if block.get("c_draft_cold_ms") is not None:
            c_draft = ms("c_draft_cold_ms")
        cold = block.get("fit_cold") or {}
        if cold:
            fit = cold
            t_exp = float(cold.get("t_exp_ms") or 0.0)
            t_tok = float(cold.get("t_tok_ms") or 0.0)
            intercept = float(cold.get("intercept_ms") or 0.0)
            source += " (cold, under a budget)"
        elif block.get("t_exp_cold_ms") is not None:
            t_exp = ms("t_exp_cold_ms")
            source += " (cold T_exp)"
    elif experts_in_host and block.get("t_exp_copy_ms") is not None:
        # the experts a verification uses are copied to the GPU: what one more of them costs is its copy
        copy = block.get("fit_copy") or {}
        if copy:
            fit = copy
            t_tok = float(copy.get("t_tok_ms") or 0.0)
            intercept = float(copy.get("intercept_ms") or 0.0)
        t_exp = ms("t_exp_copy_ms")
        source += " (experts in host memory, copied)"
    return CostConstants(
        t_ar=t_ar / 1e3,
        c_draft=c_draft / 1e3,
        t_exp=t_exp / 1e3,
        t_tok=t_tok / 1e3,
        intercept=intercept / 1e3,
        source=source,
        r2=fit.get("r2") if isinstance(fit, dict) else None,
        mape=fit.get("mape") if isinstance(fit, dict) else None,
        n_samples=int(fit.get("n") or 0) if isinstance(fit, dict) else 0,
        # the draft step measured with the whole model in memory: what a draft that reads only resident
        # experts costs under a budget too
        c_draft_resident=ms("c_draft_ms") / 1e3,
    )


def storage_rates(profile: dict[str, Any], fingerprint: str) -> tuple[float, float] | None:
    """(depth 1, depth 8) GB/s of cold reads of the model's whole experts, as the profile measured them for
    that model (None: it did not; the device's rates were read in another model's expert sizes)."""
    block = model_block(profile, fingerprint) or {}
    qd1, qd8 = (block.get(key) for key in STORAGE_KEYS)
    return (qd1, qd8) if qd1 and qd8 else None


def model_block(profile: dict[str, Any], fingerprint: str) -> dict[str, Any] | None:
    models = profile.get("models") or {}
    return models.get(fingerprint) if isinstance(models, dict) else None


def cost_for_model(
    profile: dict[str, Any],
    fingerprint: str,
    model_name: str = "",
    *,
    offloaded: bool = False,
    experts_in_host: bool = False,
) -> CostConstants:
    """The profile's constants for this model, or its reference constants, or a clear error.

    offloaded: the model runs under a memory budget, so an extra expert costs a fetch: use the cold
    fit (or cold T_exp) where the profile has one. experts_in_host: the experts stay in host memory and the
    GPU copies those a verification uses (--cpu-moe with -ngl): use the copy cost where the profile has it."""
    name = profile.get("name", "?")
    models = profile.get("models") or {}
    if not isinstance(models, dict):
        raise ConfigError(f"profile {name}: field models must be a mapping of fingerprint → constants")
    if fingerprint in models:
        return _constants(
            models[fingerprint], f"profile {name}, model {fingerprint}", f"profile:{name}", offloaded, experts_in_host
        )
    if profile.get("reference") is not None:
        return _constants(
            profile["reference"],
            f"profile {name}, reference",
            f"profile:{name} (reference values)",
            offloaded,
            experts_in_host,
        )
    raise ConfigError(
        f"profile {name} was not calibrated for this model ({model_name or 'fingerprint'} {fingerprint}); "
        f"run `s2moe calibrate --model ... --name {name}`"
    )


def hot_experts_for_model(profile: dict[str, Any], fingerprint: str) -> list[tuple[int, int]]:
    block = model_block(profile, fingerprint) or {}
    return [tuple(p) for p in block.get("hot_experts") or []]


def tuned_condition(offloaded: bool) -> str:
    return "budget" if offloaded else "resident"


def tuned_settings(profile: dict[str, Any], fingerprint: str, *, offloaded: bool = False) -> dict[str, Any]:
    """The decoding settings `s2moe tune` chose for this model where it runs (resident or under a budget):
    {draft_topk, draft_max, threshold, reuse_strength, reuse_cap, lookup, memory_strength} (the last two only
    where tune searched them),
    or {} when it was not tuned there."""
    block = model_block(profile, fingerprint) or {}
    section = (block.get("tuned") or {}).get(tuned_condition(offloaded)) or {}
    settings = section.get("settings") or {}
    return {k: settings[k] for k in TUNED_KEYS if settings.get(k) is not None}


def with_tuned(
    profile: dict[str, Any], fingerprint: str, section: dict[str, Any], *, offloaded: bool
) -> dict[str, Any]:
    """A copy of the profile with `s2moe tune`'s section recorded for this model; the model's other
    condition (resident or budget) and everything else kept. ConfigError when the profile has no
    constants for the model (tuning uses them: calibrate first)."""
    import copy

    if model_block(profile, fingerprint) is None:
        raise ConfigError(
            f"profile {profile.get('name', '?')} has no constants for model {fingerprint}: run "
            f"`s2moe calibrate --model ... --name {profile.get('name', 'NAME')}` first"
        )
    out = copy.deepcopy({k: v for k, v in profile.items() if not k.startswith("_")})
    block = out["models"][fingerprint]
    tuned = dict(block.get("tuned") or {})
    tuned[tuned_condition(offloaded)] = section
    block["tuned"] = tuned
    return out
