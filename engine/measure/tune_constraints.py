"""What bounds tune's search. Quality: every candidate that gates must meet PPL_RATIO_MAX and TOP1_MIN on the
teacher-forced checks of quality_checks (QualityChecks, run by BenchChecks), checked again on twice the text
where a verdict is too close to call. Time: what successive halving from so many candidates costs, how many the
time left affords, and whether the defaults' checks and one comparison still fit.

Apart from BenchChecks, which runs the checks, this is arithmetic on a check's figures and on seconds, which
tests exercise without a model; the search loop (tune.run_tune) asks it and acts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from ..decoding.decoder import Decoder
from ..errors import OPTION, ConfigError
from .quality_checks import CheckFigures, gating_quality, memory_gating_quality

PPL_RATIO_MAX = 1.02
TOP1_MIN = 0.9
QUALITY_TOKENS = 96


class QualityChecks(Protocol):
    """The teacher-forced checks of the quality constraint, each on some texts, returning bench's figures
    (tokens, ppl_ratio, top1_agreement, ..., as gating_quality): reuse gating alone on batches of `window`
    tokens; gating toward the experts in memory alone, one token a step; both together on batches."""

    def reuse(self, texts: list[str], alpha: float, cap: int, window: int) -> dict[str, Any]: ...

    def memory(self, texts: list[str], alpha: float) -> dict[str, Any]: ...

    def both(self, texts: list[str], alpha: float, cap: int, window: int, memory: float) -> dict[str, Any]: ...


@dataclass(frozen=True)
class BenchChecks:
    """bench's checks, on QUALITY_TOKENS tokens of each text, in the decoder's process (under its budget)."""

    decoder: Decoder

    def reuse(self, texts: list[str], alpha: float, cap: int, window: int) -> dict[str, Any]:
        return gating_quality(self.decoder, texts, alpha=alpha, cap=cap, window=window, max_tokens=QUALITY_TOKENS)

    def memory(self, texts: list[str], alpha: float) -> dict[str, Any]:
        return memory_gating_quality(self.decoder, texts, alpha=alpha, max_tokens=QUALITY_TOKENS)

    def both(self, texts: list[str], alpha: float, cap: int, window: int, memory: float) -> dict[str, Any]:
        return gating_quality(
            self.decoder, texts, alpha=alpha, cap=cap, window=window, max_tokens=QUALITY_TOKENS, memory=memory
        )


def figures_record(v: dict[str, Any]) -> dict[str, Any]:
    """A quality check's figures as the profile records them (quality_checks.CheckFigures' fields that it measured)."""
    figures = asdict(CheckFigures.of(v))
    digits = {"ppl_ratio": 5, "top1_agreement": 4, "mean_kl": 6, "top1_se": 5, "log_ppl_ratio_se": 5}
    return {k: (round(x, digits[k]) if k in digits else x) for k, x in figures.items() if x is not None}


def check_record(v: dict[str, Any]) -> dict[str, Any]:
    """A quality check in the profile's list of those made: its figures (None where it measured nothing), its
    verdict, and whether it was settled on twice the text."""
    return {
        "ppl_ratio": None,
        "top1_agreement": None,
        **figures_record(v),
        "ok": bool(v["ok"]),
        "extended": bool(v.get("extended")),
    }


def too_close_to_call(q: dict[str, Any]) -> bool:
    """Whether a check's top-1 agreement lies within two standard errors of TOP1_MIN, where which side it falls on
    is the check's own sampling noise: the check's batch-means error (bench's top1_se: tokens of a passage move
    together), never less than the binomial error over its tokens. The perplexity ratio is not asked: its error
    on these checks (about 0.01 over 720 tokens) is as large as the margin of the settings that pass (1.000–1.005
    against 1.02), so twice the text would not settle it either; its verdict is taken as measured."""
    n = int(q.get("tokens") or 0)
    if n == 0 or q.get("top1_agreement") is None:
        return False
    p = float(q["top1_agreement"])
    se = max(math.sqrt(max(p * (1.0 - p), 1.0 / n) / n), float(q.get("top1_se") or 0.0))
    return abs(p - TOP1_MIN) < 2.0 * se


def decided(check: Callable[[list[str]], dict[str, Any]], texts: list[str], more_texts: list[str]) -> dict[str, Any]:
    """check(texts), or where that is too close to call and more texts are at hand, check(more_texts): the
    verdict on twice the text (marked "extended"). The bound stays the same; only a verdict that the first
    texts cannot settle pays for more."""
    q = check(texts)
    if too_close_to_call(q) and len(more_texts) > len(texts):
        q = check(more_texts) | {"extended": True}
    return q


def within_bounds(q: dict[str, Any]) -> bool:
    """Whether a teacher-forced quality check (bench's) meets the constraint."""
    return bool(q.get("tokens")) and q["ppl_ratio"] <= PPL_RATIO_MAX and q["top1_agreement"] >= TOP1_MIN


def too_short(time_budget_s: float, why: str) -> ConfigError:
    return ConfigError(f"{OPTION} of {time_budget_s:g} s is too short: {why}", option="time_budget")


def check_time(needed: float, left: float, time_budget_s: float, t_run: float) -> None:
    if needed > left:
        raise too_short(
            time_budget_s,
            f"one generation takes about {t_run:.1f} s here and comparing two "
            f"candidates with the defaults needs about {needed:.0f} s more",
        )


# A check of a kind not timed yet is expected to take what the kind it runs like took: both biases together are
# checked on batches of tokens as reuse gating alone is, where the memory check runs one token a step.
CHECK_RUNS_LIKE = {"both": "reuse"}


def expected_check_s(took: dict[str, float], kind: str) -> float:
    """Seconds a quality check of `kind` is expected to take, from the slowest of each kind so far (`took`): its
    own kind's, else the kind it runs like, else the slowest of any."""
    if kind in took:
        return took[kind]
    like = CHECK_RUNS_LIKE.get(kind)
    return took[like] if like in took else max(took.values(), default=0.0)


def ensure_defaults_fit(
    checks_left_s: list[float], check_s: float, t_run: float, left: float, time_budget_s: float, elapsed: float
) -> None:
    """Raise where the defaults' remaining quality checks (the seconds each is expected to take) and one comparison
    of two candidates cannot fit in the time left: said as soon as a check has been timed (check_s), rather than
    once the whole budget is gone."""
    compare = sh_cost(2, t_run)
    needed = sum(checks_left_s) + compare
    if needed > left:
        n_left = len(checks_left_s)
        more = (
            f" and the defaults need {n_left} more (about {sum(checks_left_s):.0f} s) before any speed is timed"
            if n_left
            else ""
        )
        raise too_short(
            time_budget_s,
            f"a quality check takes about {check_s:.0f} s here{more}; comparing two "
            f"candidates then takes about {compare:.0f} s: that alone needs "
            f"{math.ceil((elapsed + needed) / 60)} min, a search more",
        )


def rungs(n: int) -> int:
    return max(1, math.ceil(math.log2(max(n, 1))) + 1)


def rung_runs(n_survivors: int, rung: int) -> int:
    return (n_survivors + 2) * (1 << rung)


def affordable(n_max: int, t_run: float, seconds: float) -> int:
    """How many candidates (at least two, at most n_max) successive halving can start from in `seconds`."""
    n = min(2, n_max)
    while n < n_max and sh_cost(min(2 * n, n_max), t_run) <= seconds:
        n = min(2 * n, n_max)
    return n


def sh_cost(n0: int, t_run: float) -> float:
    """Seconds successive halving from n0 candidates takes at t_run a run."""
    return sum(rung_runs(max(1, n0 >> r), r) for r in range(rungs(n0))) * t_run
