"""The cost model's fits: verification latency as a + T_exp·(distinct experts summed over layers) + T_tok·tokens,
and under a memory budget with experts resident and experts fetched apart, fitted by least squares with
non-negative slopes, and how well a fit of these counts can do at all.

On a bandwidth-bound device T_tok ≈ 0 and this is the paper's model; on a compute-bound CPU each token
costs compute even when it brings no new expert, and the fit says so. The measurements they fit are in
costmodel; the calibration and the benchmarks fit their own timings with the same functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

Floats: TypeAlias = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Fit:
    intercept: float
    t_exp: float
    t_tok: float
    r2: float
    mape: float
    n: int
    r2_ceiling: float | None = None  # see r2_ceiling()

    def predict(self, experts: npt.ArrayLike, tokens: npt.ArrayLike) -> Floats:
        return self.intercept + self.t_exp * np.asarray(experts) + self.t_tok * np.asarray(tokens)


def fit_verify_cost(experts: npt.ArrayLike, tokens: npt.ArrayLike, seconds: npt.ArrayLike) -> Fit:
    """Least squares of seconds on (1, experts, tokens) with non-negative slopes."""
    e = np.asarray(experts, float)
    s = np.asarray(tokens, float)
    y = np.asarray(seconds, float)
    if len(y) < 3:
        raise ValueError("need at least three measurements to fit the verification cost")

    def solve(cols: list[Floats]) -> Floats:
        X = np.column_stack([np.ones_like(y)] + cols)
        coef: Floats = np.linalg.lstsq(X, y, rcond=None)[0]
        return coef

    coef = solve([e, s])
    a, te, tt = coef
    if te < 0 or tt < 0:
        # A negative slope is noise or collinearity; drop it and refit with the other one.
        if te < 0 and tt < 0:
            a, te, tt = float(np.mean(y)), 0.0, 0.0
        elif te < 0:
            a, tt = solve([s])
            te = 0.0
        else:
            a, te = solve([e])
            tt = 0.0
        if te < 0 or tt < 0:
            a, te, tt = float(np.mean(y)), 0.0, 0.0
    if a < 0:
        # No step takes less than nothing: counts bunched far from zero (a short start-up measurement's: one
        # token's experts to a few more) extrapolate to a negative fixed cost and steepen the slopes to make up
        # for it. Fitted through the origin instead.
        a, te, tt = (float(c) for c in _nonneg_lstsq([e, s], y, intercept=False))
    r2, mape = _quality(y, a + te * e + tt * s)
    return Fit(float(a), float(te), float(tt), r2, mape, len(y), r2_ceiling(zip(e, s), y))


def r2_ceiling(counts: Iterable[Iterable[float]], seconds: npt.ArrayLike) -> float | None:
    """The highest R² any cost model of these counts can reach on these timings: each distinct tuple of
    counts predicted by the mean of the timings that share it. What that leaves unexplained is steps with
    the same counts taking different times (on a disk, its own spread from read to read), which no further
    term in a fit of the counts can remove. None unless at least half the timings share their counts with
    another: timings alone in their tuple would count as explained and make the ceiling meaningless."""
    y = np.asarray(seconds, float)
    groups: dict[tuple[float, ...], list[int]] = {}
    for i, key in enumerate(counts):
        groups.setdefault(tuple(float(k) for k in key), []).append(i)
    shared = sum(len(ix) for ix in groups.values() if len(ix) > 1)
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    if 2 * shared < len(y) or ss_tot <= 0:
        return None
    ss_within = sum(float(np.sum((y[ix] - y[ix].mean()) ** 2)) for ix in groups.values())
    return 1.0 - ss_within / ss_tot


def r2_text(r2: float, ceiling: float | None) -> str:
    """A fit's R², and beside it the most any model of its counts could reach, where the timings say."""
    if ceiling is None:
        return f"R² {r2:.3f}"
    return f"R² {r2:.3f} (≤ {ceiling:.3f} for any model of these counts)"


@dataclass(frozen=True)
class MissFit:
    """Verification cost under a memory budget: a + t_hit·(resident experts) + t_miss·(experts fetched
    from storage) + t_tok·tokens. t_hit is T_exp warm, t_miss is T_exp cold."""

    intercept: float
    t_hit: float
    t_miss: float
    t_tok: float
    r2: float
    mape: float
    n: int
    r2_ceiling: float | None = None  # see r2_ceiling()

    def predict(self, experts: npt.ArrayLike, misses: npt.ArrayLike, tokens: npt.ArrayLike) -> Floats:
        e, m = np.asarray(experts, float), np.asarray(misses, float)
        s = np.asarray(tokens, float)
        seconds: Floats = self.intercept + self.t_hit * (e - m) + self.t_miss * m + self.t_tok * s
        return seconds


def _nonneg_lstsq(cols: list[Floats], y: Floats, intercept: bool = True) -> Floats:
    """Least squares of y on (1, cols...) with non-negative slopes: a column whose slope comes out negative
    (noise or collinearity) is dropped and the rest refitted. Returns [intercept, slopes...]; without
    `intercept`, fitted through the origin and the intercept returned as 0."""
    active = list(range(len(cols)))
    first = 1 if intercept else 0  # where the slopes start among the coefficients
    while True:
        out = np.zeros(len(cols) + 1)
        if not active and not intercept:
            return out
        X = np.column_stack(([np.ones_like(y)] if intercept else []) + [cols[i] for i in active])
        coef = np.linalg.lstsq(X, y, rcond=None)[0]
        neg = [active[j] for j, c in enumerate(coef[first:]) if c < 0]
        if not neg:
            out[0] = coef[0] if intercept else 0.0
            for j, i in enumerate(active):
                out[i + 1] = coef[j + first]
            return out
        worst = min(neg, key=lambda i: coef[first + active.index(i)])
        active.remove(worst)


def _quality(y: Floats, pred: Floats) -> tuple[float, float]:
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    mape = float(np.mean(np.abs(y - pred) / np.maximum(np.abs(y), 1e-12)))
    return r2, mape


def fit_miss_cost(
    experts: npt.ArrayLike, misses: npt.ArrayLike, tokens: npt.ArrayLike, seconds: npt.ArrayLike
) -> MissFit:
    """Least squares of seconds on (1, resident experts, missed experts, tokens), slopes ≥ 0."""
    e, m, s, y = (np.asarray(v, float) for v in (experts, misses, tokens, seconds))
    if len(y) < 4:
        raise ValueError("need at least four measurements to fit the cost under a budget")
    a, t_hit, t_miss, t_tok = _nonneg_lstsq([e - m, m, s], y)
    fit = MissFit(float(a), float(t_hit), float(t_miss), float(t_tok), 0.0, 0.0, len(y))
    r2, mape = _quality(y, fit.predict(e, m, s))
    return MissFit(fit.intercept, fit.t_hit, fit.t_miss, fit.t_tok, r2, mape, len(y), r2_ceiling(zip(e, m, s), y))


def drift_tracked_fit(
    fit: MissFit,
    experts: npt.ArrayLike,
    misses: npt.ArrayLike,
    tokens: npt.ArrayLike,
    seconds: npt.ArrayLike,
    half_life: float = 100.0,
    prior: float = 20.0,
) -> dict[str, Any]:
    """The miss-aware fit with T_exp cold followed through the run: each verification priced at the rate per
    fetch that the fetches before it took, its other constants the fit's. That rate is the time the earlier
    verifications took beyond the fit's other terms over the fetches they made, each fetch's weight halving
    every `half_life` fetches after it, starting from the fit's T_exp cold as `prior` fetches' worth.
    Counted in fetches rather than verifications, a verification that fetched one expert says as little of the
    rate as one fetch does: a running mean of each verification's own rate lets those few-fetch ones, whose
    time beyond the other terms is mostly noise, swing it. A storage device's rate wanders over minutes, and
    one T_exp cold for a whole run charges the slow stretches at the fast ones' rate; how far this R² rises
    above the fit's shows how much of what the counts leave unexplained is that wander. Causal, so the rule
    could price with it."""
    m, y = np.asarray(misses, float), np.asarray(seconds, float)
    rest = fit.predict(experts, m, tokens) - fit.t_miss * m
    keep = 0.5 ** (1.0 / half_life)  # per fetch
    time_s, fetches = prior * fit.t_miss, prior
    rates = np.empty_like(y)
    for i in range(len(y)):
        rates[i] = max(0.0, time_s / fetches)
        if m[i] > 0:
            fade = keep ** m[i]
            time_s, fetches = fade * time_s + (y[i] - rest[i]), fade * fetches + m[i]
    r2, mape = _quality(y, rest + rates * m)
    return {
        "r2": r2,
        "mape": mape,
        "half_life_fetches": half_life,
        "t_exp_cold_range_s": [float(min(rates)), float(max(rates))],
    }


def fault_explained_fit(
    experts: npt.ArrayLike, faults: npt.ArrayLike, tokens: npt.ArrayLike, seconds: npt.ArrayLike
) -> dict[str, float]:
    """Diagnostic, not a predictor: seconds on (1, experts, storage page faults actually taken, tokens).
    The faults are known only after a verification ran; how far this fit's R² rises above the miss-aware
    one shows how much of the latency depends on which pages the kernel let go and had to read again,
    something a residency snapshot taken beforehand cannot see."""
    e, f, s, y = (np.asarray(v, float) for v in (experts, faults, tokens, seconds))
    if len(y) < 4:
        raise ValueError("need at least four measurements")
    a, t_exp, t_fault, t_tok = _nonneg_lstsq([e, f, s], y)
    r2, mape = _quality(y, a + t_exp * e + t_fault * f + t_tok * s)
    return {
        "intercept_s": float(a),
        "t_exp_s": float(t_exp),
        "t_fault_s": float(t_fault),
        "t_tok_s": float(t_tok),
        "r2": r2,
        "mape": mape,
        "faults_per_verification": float(f.mean()),
    }
