"""Cost constants for routing-aware expansion, and the start-up measurement that fits them.

Verification latency is modelled as a + T_exp·(distinct experts summed over layers) + T_tok·tokens.
On a bandwidth-bound device T_tok ≈ 0 and this is the paper's model; on a compute-bound CPU each token
costs compute even when it brings no new expert, and the fit says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .events import CostConstants


@dataclass(frozen=True)
class Fit:
    intercept: float
    t_exp: float
    t_tok: float
    r2: float
    mape: float
    n: int

    def predict(self, experts, tokens):
        return self.intercept + self.t_exp * np.asarray(experts) + self.t_tok * np.asarray(tokens)


def fit_verify_cost(experts, tokens, seconds) -> Fit:
    """Least squares of seconds on (1, experts, tokens) with non-negative slopes."""
    e = np.asarray(experts, float)
    s = np.asarray(tokens, float)
    y = np.asarray(seconds, float)
    if len(y) < 3:
        raise ValueError("need at least three measurements to fit the verification cost")

    def solve(cols):
        X = np.column_stack([np.ones_like(y)] + cols)
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
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
    pred = a + te * e + tt * s
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    mape = float(np.mean(np.abs(y - pred) / np.maximum(np.abs(y), 1e-12)))
    return Fit(float(a), float(te), float(tt), r2, mape, len(y))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_cost_constants(rt, k_draft: int, cap: int, *, seed: int = 0, repeats: int = 3, context: int = 32):
    """Time plain steps, draft steps and verification batches of varied size and reuse on `rt`.

    Leaves the KV cache empty. Returns (CostConstants, samples) where samples are (experts, tokens, s).
    """
    hook = rt.hook
    rng = np.random.default_rng(seed)
    n_vocab = rt.n_vocab
    rt.kv_clear()
    context = max(1, min(context, rt.n_ctx - cap - 4))
    prefix = rng.integers(0, n_vocab, size=context).tolist()
    hook.off()
    rt.decode(prefix, 0, "none")
    base = context

    def step(tokens, mode: str) -> tuple[float, float]:
        if mode == "draft":
            hook.draft(k_draft)
        else:
            hook.observe()
        dt = _timed(lambda: rt.decode(tokens, base, "all" if mode == "verify" else "last"))
        experts = float(hook.snapshot(len(tokens)).distinct_used(rt.info.n_expert).sum())
        rt.kv_remove_from(base)
        return dt, experts

    for _ in range(2):  # first decodes of a shape allocate graphs and fault pages in
        step([int(rng.integers(n_vocab))], "verify")
        step([int(rng.integers(n_vocab))], "draft")
        step(rng.integers(0, n_vocab, size=cap + 1).tolist(), "verify")

    ar = [step([int(rng.integers(n_vocab))], "verify")[0] for _ in range(4 * repeats)]
    draft = [step([int(rng.integers(n_vocab))], "draft")[0] for _ in range(4 * repeats)]

    samples = []
    sizes = sorted(set([1, 2, 3] + list(range(2, cap + 2, max(1, cap // 4))) + [cap + 1]))
    for s in sizes:
        for variant in ("random", "repeat", "mixed"):
            if variant == "random":
                toks = rng.integers(0, n_vocab, size=s).tolist()
            elif variant == "repeat":
                toks = [int(rng.integers(n_vocab))] * s
            else:
                pool = rng.integers(0, n_vocab, size=max(1, s // 2)).tolist()
                toks = [pool[i % len(pool)] for i in range(s)]
            times, experts = [], 0.0
            for _ in range(repeats):
                dt, experts = step(toks, "verify")
                times.append(dt)
            samples.append((experts, s, float(np.median(times))))
    rt.kv_clear()
    fit = fit_verify_cost([x[0] for x in samples], [x[1] for x in samples], [x[2] for x in samples])
    cost = CostConstants(
        t_ar=float(np.median(ar)),
        c_draft=float(np.median(draft)),
        t_exp=fit.t_exp,
        t_tok=fit.t_tok,
        intercept=fit.intercept,
        source="measured at start-up",
        r2=fit.r2,
        mape=fit.mape,
        n_samples=fit.n,
    )
    return cost, samples
