"""The settings tune searches and the values it tries: a candidate (Settings), the model's defaults as one, the
values searched for each setting on a given model (search_space), and the pool of candidates drawn from them.

What is searched is decided here; how the search spends its time on it is tune.run_tune's.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..decoding.decoder import Decoder
from ..decoding.generation_config import GenerationConfig

SETTING_KEYS = ("draft_topk", "draft_max", "threshold", "reuse_strength", "reuse_cap", "lookup", "memory_strength")
DRAFT_CAPS = (4, 8, 12)  # below a decoder's usual verification limit of 16
THRESHOLDS = (0.5, 0.75, 1.0, 1.5)
STRENGTHS = (0.0, 0.25, 0.5, 1.0)
MEMORY_STRENGTHS = (0.0, 0.15, 0.3, 0.5)  # searched only under a memory budget


@dataclass(frozen=True, order=True)
class Settings:
    draft_topk: int
    draft_max: int
    threshold: float
    reuse_strength: float
    reuse_cap: int
    lookup: bool = True  # s2moe copies from the context where its rule says they pay
    # gating toward the experts in memory: acts under a memory budget, with gating on
    memory_strength: float = GenerationConfig.memory_strength

    def config(self, base: GenerationConfig) -> GenerationConfig:
        return replace(base, mode="s2moe", utility=True, **asdict(self))

    def as_dict(self) -> dict[str, bool | int | float]:
        return {
            k: (v if isinstance(v, bool) else float(v) if isinstance(v, float) else int(v))
            for k, v in asdict(self).items()
        }

    def label(self, memory_shown: bool = False) -> str:
        """In words; memory_shown: with the memory strength (where it acts: under a budget)."""
        gating = f"α {self.reuse_strength:g} |E*| {self.reuse_cap}" if self.reuse_strength > 0 else "gating off"
        memory = f" · memory α {self.memory_strength:g}" if memory_shown and self.reuse_strength > 0 else ""
        copies = "" if self.lookup else " · copies off"
        return f"k_d {self.draft_topk} · cap {self.draft_max} · threshold {self.threshold:g} · {gating}{memory}{copies}"

    @property
    def gating(self) -> tuple[float, int]:
        """The part the quality constraint depends on (|E*| means nothing without gating)."""
        return (self.reuse_strength, self.reuse_cap if self.reuse_strength > 0 else 0)

    @property
    def memory(self) -> float:
        """The part the memory-gating quality constraint depends on (nothing is gated without gating)."""
        return self.memory_strength if self.reuse_strength > 0 else 0.0


def default_settings(decoder: Decoder, base: GenerationConfig | None = None) -> Settings:
    """What a generation with no flag and no tuned profile runs: the model's routing defaults."""
    cfg = (base or GenerationConfig()).resolved(decoder.info)
    # resolved() fills these from the model's routing defaults
    assert cfg.draft_topk is not None and cfg.draft_max is not None and cfg.reuse_cap is not None
    return Settings(
        cfg.draft_topk,
        cfg.draft_max,
        float(cfg.threshold),
        float(cfg.reuse_strength),
        cfg.reuse_cap,
        cfg.lookup,
        float(cfg.memory_strength),
    )


def search_space(n_expert: int, k: int, defaults: Settings, knows_memory: bool = False) -> dict[str, tuple[Any, ...]]:
    """The values searched for each setting on a model with n_expert experts, k per token; the memory
    strength only where the decoder knows what is in memory (under a budget): elsewhere it changes nothing."""
    topk = sorted({max(1, k // 8), max(1, k // 4), max(1, k // 2), defaults.draft_topk} & set(range(1, k)))
    caps = sorted({c for c in {max(k, 3 * k // 2), 2 * k, 3 * k, defaults.reuse_cap} if k <= c < n_expert})
    return {
        "draft_topk": tuple(topk),
        "draft_max": tuple(sorted(set(DRAFT_CAPS) | {defaults.draft_max})),
        "threshold": tuple(sorted(set(THRESHOLDS) | {defaults.threshold})),
        "reuse_strength": tuple(sorted(set(STRENGTHS) | {defaults.reuse_strength})),
        "reuse_cap": tuple(caps) or (defaults.reuse_cap,),
        "lookup": (True, False),
        "memory_strength": (
            tuple(sorted(set(MEMORY_STRENGTHS) | {defaults.memory_strength}))
            if knows_memory
            else (defaults.memory_strength,)
        ),
    }


def _canonical(s: Settings, defaults: Settings) -> Settings:
    # without gating neither |E*| nor the memory strength changes anything: one candidate, not one per value
    if s.reuse_strength == 0:
        return replace(s, reuse_cap=defaults.reuse_cap, memory_strength=defaults.memory_strength)
    return s


def candidate_pool(space: dict[str, tuple[Any, ...]], defaults: Settings, n: int, seed: int = 0) -> list[Settings]:
    """Up to n candidates: the defaults, every change of one setting from them (which setting matters), then
    random combinations (which settings matter together), without repeats."""
    out: list[Settings] = []
    seen: set[Settings] = set()

    def add(s: Settings) -> None:
        s = _canonical(s, defaults)
        if s not in seen and len(out) < n:
            seen.add(s)
            out.append(s)

    add(defaults)
    # one setting at a time, the settings taking turns: a pool cut short still varies each of them
    for i in range(max(len(v) for v in space.values())):
        for key in SETTING_KEYS:
            values = [v for v in space[key] if v != getattr(defaults, key)]
            if i < len(values):
                add(replace(defaults, **{key: values[i]}))
    rng = random.Random(seed)
    total = math.prod(len(v) for v in space.values())
    tries = 0
    while len(out) < min(n, total) and tries < 50 * n:
        tries += 1
        add(Settings(**{key: rng.choice(space[key]) for key in SETTING_KEYS}))
    return out
