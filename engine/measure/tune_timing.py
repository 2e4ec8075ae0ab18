"""How tune times its candidates and compares their speeds: the Clock it reads (injected, so that tests decide
what a run takes), the Runner that times one generation from the end of its prefill, a candidate's running
Score, and the per-prompt comparisons (log_ratios of a candidate against the defaults, judged against plain
decoding).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..decoding.decoder import Decoder
from ..decoding.generation_config import GenerationConfig
from ..events import Finished, Iteration, Prefilled
from .speed import Judgement, LoadWatch, judge
from .tune_space import Settings


class Clock(Protocol):
    """What the search times with: seconds from any fixed origin."""

    def now(self) -> float: ...


class MonotonicClock:
    def now(self) -> float:
        import time

        return time.perf_counter()


@dataclass
class Score:
    tokens: int = 0
    seconds: float = 0.0
    runs: int = 0

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Runner:
    def __init__(self, decoder: Decoder, base: GenerationConfig, clock: Clock, should_stop: Callable[[], bool]):
        self.decoder, self.base, self.clock, self.should_stop = decoder, base, clock, should_stop
        self.slowest = 0.0

    def run(self, cfg: GenerationConfig, prompt: str) -> tuple[int, float]:
        """(tokens, decoding seconds) of one generation: from the end of the prefill to the last iteration.
        What the whole generation took, prefill included, sizes what the time budget has room for."""
        t_start = self.clock.now()
        t_first = t_last = None
        n = 0
        for ev in self.decoder.generate(prompt, cfg):
            if isinstance(ev, (Prefilled, Iteration)):
                t_last = self.clock.now()
                if t_first is None:
                    t_first = t_last
            elif isinstance(ev, Finished):
                n = ev.n_tokens
        seconds = (t_last - t_first) if t_first is not None and t_last is not None else 0.0
        self.slowest = max(self.slowest, self.clock.now() - t_start)
        return n, seconds


def log_ratios(a: dict[int, tuple[int, float]], b: dict[int, tuple[int, float]]) -> list[float]:
    """Per prompt measured for both: log(tok/s of a ÷ tok/s of b)."""
    out = []
    for p in sorted(set(a) & set(b)):
        (na, sa), (nb, sb) = a[p], b[p]
        if na and nb and sa > 0 and sb > 0:
            out.append(math.log((na / sa) / (nb / sb)))
    return out


def judged(
    runs: dict[Settings | str, dict[int, tuple[int, float]]], tuned: Settings, defaults: Settings, watch: LoadWatch
) -> Judgement:
    """The defaults' and the tuned settings' speeds against plain decoding's, prompt by prompt (speed.judge)."""

    def speeds(who: Settings | str) -> list[float | None]:
        out: list[float | None] = []
        for p in shown:
            n, s = runs[who].get(p, (0, 0.0))
            out.append(n / s if n and s > 0 else None)
        return out

    shown = sorted(set(runs["ar"]))
    named = {"ar": speeds("ar"), "the defaults": speeds(defaults)}
    if tuned != defaults:
        named["tuned"] = speeds(tuned)
    return judge(named, "ar", watch.stop())
