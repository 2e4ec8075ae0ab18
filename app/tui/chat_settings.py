"""What the user picks in the chat: the decoding mode and the method's components, and where each value
comes from.

ChatSettings is plain data the screens, the settings dialog and the saved app state share; the session turns
it into the engine's GenerationConfig. The mode helpers name the modes the installed engine accepts and say
in a line what each does, for the mode selector, the command palette and the bench screen.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from ...engine.decoding.sampling import MIN_P, RANDOM_SEED, REPEAT_LAST_N, REPEAT_PENALTY, TOP_K, TOP_P

if TYPE_CHECKING:
    from .session import ModelSummary


MODE_HELP = {
    "ar": "plain decoding, one token per pass (the reference)",
    "s2moe": "S²-MoE: shared KV + routing-aware expansion (utility) + reuse-aware gating",
    "naive": "draft in an independent context with k_d experts (no shared KV; the paper's baseline)",
    "conf": "shared-KV self-draft that stops when the draft's confidence drops",
    "cascade": "shared-KV self-draft whose length adapts per request",
    "lookup": "prompt-lookup drafting: copy n-grams from the context, no draft model",
    "tree": "S²-MoE drafting a tree: best-first by utility, siblings priced by the experts they add",
    "tree-prob": "a draft tree expanded by draft probability alone (EAGLE-style; the tree baseline)",
    "ls": "layer-skipping self-draft: every other MoE layer's experts skipped (the paper's LS baseline)",
}


def mode_help(mode: str) -> str:
    return MODE_HELP.get(mode, "")


def engine_modes() -> tuple[str, ...]:
    """The decoding modes the installed engine accepts (the UI's mode selector is built from these)."""
    from ...engine import modes

    return tuple(modes.MODES)


def moe_modes() -> tuple[str, ...]:
    from ...engine import modes

    return tuple(getattr(modes, "MOE_MODES", tuple(m for m in modes.MODES if m != "ar")))


# What ChatSettings leaves open comes to without a tuned profile: GenerationConfig's defaults.
DEFAULTS = {"reuse_strength": 0.5, "draft_max": 8, "threshold": 1.0, "lookup": True, "memory_strength": 0.3}
# The settings a profile's tuning may fill in: left open (None) in ChatSettings unless the user sets them.
OPEN_KEYS = ("draft_topk", "draft_max", "threshold", "reuse_strength", "memory_strength", "lookup")
SHORT_NAMES = {
    "draft_topk": "k_d",
    "draft_max": "cap",
    "threshold": "threshold",
    "reuse_strength": "α",
    "memory_strength": "α_m",
    "lookup": "copies",
}
# Where a setting's value comes from, as the settings dialog and the settings bar name it.
FROM_FLAG, FROM_USER, FROM_PROFILE, FROM_DEFAULT = "flag", "yours", "profile", "default"


def value_text(value) -> str:
    """A setting's value in a few characters (on/off for a switch)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


@dataclass
class ChatSettings:
    """What the user switches from the chat: the mode and the method's components."""

    mode: str = "s2moe"
    utility: bool = True
    gating: bool = True
    # None: not set here — the active profile's tuned value (s2moe tune), else the default (DEFAULTS)
    # s2moe: draft the tokens that followed a repeated n-gram of the context where the utility rule says they pay
    lookup: bool | None = None
    reuse_strength: float | None = None  # α used when gating is on
    memory_strength: float | None = None  # α_m toward the experts in memory: under a budget, when gating is on
    draft_topk: int | None = (
        None  # None also: the model's default (see engine.decoding.generation_config.routing_defaults)
    )
    draft_max: int | None = None
    threshold: float | None = None
    n_predict: int = 128
    # llama.cpp's sampler chain, as generate's flags set it and with their defaults (app.options.SAMPLING_VALUES)
    temperature: float = 0.0
    top_k: int = TOP_K
    top_p: float = TOP_P
    min_p: float = MIN_P
    repeat_penalty: float = REPEAT_PENALTY
    repeat_last_n: int = REPEAT_LAST_N
    seed: int = 0

    def sampling_fields(self) -> dict:
        """The sampler settings, as GenerationConfig fields."""
        from ..options import SAMPLING_VALUES

        return {key: getattr(self, key) for key in SAMPLING_VALUES}

    def sampling_text(self) -> str:
        """The sampler settings in a few characters ("" for greedy with no penalty): temperature and seed,
        then only what differs from the defaults."""
        parts = []
        if self.temperature > 0:
            parts.append(f"T={self.temperature:g}")
            parts.append("seed " + ("random" if self.seed == RANDOM_SEED else str(self.seed)))
            for key, name, default in (("top_k", "top-k", TOP_K), ("top_p", "top-p", TOP_P), ("min_p", "min-p", MIN_P)):
                if getattr(self, key) != default:
                    parts.append(f"{name}={getattr(self, key):g}")
        if self.repeat_penalty != REPEAT_PENALTY:
            parts.append(
                f"rep={self.repeat_penalty:g}"
                + (f"/{self.repeat_last_n}" if self.repeat_last_n != REPEAT_LAST_N else "")
            )
        return " ".join(parts)

    def resolved(self, model: ModelSummary | None, tuned: dict | None = None) -> ChatSettings:
        """These settings with what they leave open filled in: from `tuned` (the active profile's tuned
        settings), else the defaults; k_d from the model's routing (left open while no model is loaded)."""
        tuned = tuned or {}
        s = replace(
            self, **{key: tuned.get(key, default) for key, default in DEFAULTS.items() if getattr(self, key) is None}
        )
        if s.draft_topk is None and "draft_topk" in tuned:
            s = replace(s, draft_topk=tuned["draft_topk"])
        if model is None or s.draft_topk is not None:
            return s
        from ...engine.decoding.generation_config import routing_defaults

        return replace(s, draft_topk=routing_defaults(model.n_expert, model.k).draft_topk)

    def sources(self, tuned: dict | None = None, flags: dict | None = None) -> dict[str, str]:
        """Where each value comes from: the command line (flags: the fields it set), the user (set in the app
        and remembered), the active profile's tuning (`tuned`), or the default."""
        tuned, flags = tuned or {}, flags or {}
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in flags and flags[f.name] == value:
                out[f.name] = FROM_FLAG
            elif f.name in OPEN_KEYS:
                out[f.name] = FROM_USER if value is not None else FROM_PROFILE if f.name in tuned else FROM_DEFAULT
            else:
                out[f.name] = FROM_USER if value != f.default else FROM_DEFAULT
        return out

    def overrides(self, tuned: dict | None) -> dict[str, tuple]:
        """The user's values that differ from what the active profile tuned: {key: (yours, the profile's)}."""
        tuned = tuned or {}
        return {
            key: (getattr(self, key), tuned[key])
            for key in OPEN_KEYS
            if key in tuned and getattr(self, key) is not None and getattr(self, key) != tuned[key]
        }

    def left_to_profile(self, keys=OPEN_KEYS) -> ChatSettings:
        """These settings with `keys` left open again: the active profile's tuned values (else the defaults)
        decide them."""
        return replace(self, **{key: None for key in keys})

    def describe(
        self,
        model: ModelSummary | None = None,
        tuned: dict | None = None,
        budgeted: bool = False,
        overrides: dict | None = None,
    ) -> str:
        """The settings in a line; budgeted: under a memory budget, where α_m acts (shown with gating);
        overrides (see overrides()): the user's values where the profile tuned others, each marked as such."""
        overrides = dict(overrides or {})

        def mark(key: str) -> str:
            if key not in overrides:
                return ""
            return f" (yours; profile {value_text(overrides.pop(key)[1])})"

        r = self.resolved(model, tuned)
        parts = [self.mode]
        if self.mode != "ar":
            parts.append(f"k_d={'auto' if r.draft_topk is None else r.draft_topk}" + mark("draft_topk"))
        if self.mode == "s2moe":
            parts.append("utility " + ("on" if self.utility else "off"))
            # gating changes which experts a token uses, so its answers can differ from plain decoding's
            parts.append(
                f"gating {r.reuse_strength:g} (lossy)" + mark("reuse_strength")
                if self.gating and r.reuse_strength
                else "gating off (lossless)"
            )
            if self.gating and budgeted:
                parts.append(f"memory {r.memory_strength:g}" + mark("memory_strength"))
            if not r.lookup:
                parts.append("copies off" + mark("lookup"))
        parts.append(f"n={self.n_predict}")
        if self.sampling_text():
            parts.append(self.sampling_text())
        # the user's values the line above does not show, where they differ from the profile's
        parts += [
            f"{SHORT_NAMES[key]} {value_text(mine)}{mark(key)}"
            for key, (mine, _) in list(overrides.items())
            if key in ("draft_max", "threshold") and self.mode != "ar"
        ]
        return " · ".join(parts)
