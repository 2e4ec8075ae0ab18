"""On-device tuning: search the decoding settings that decide speed on this device, model, budget and workload.

run_tune() is a generator of typed events; `s2moe tune` and the app's calibration wizard both consume it:

    TuneStarted(candidates, defaults, time_budget_s)
    TuneQuality(reuse_strength, reuse_cap, figures, ok)                  # one per gating setting
    TuneMemoryQuality(memory_strength, figures, ok)                      # under a budget, one each
    TuneJointQuality(reuse_strength, reuse_cap, memory_strength, figures, ok)
                                                             # under a budget, one per pair and α_m that pass alone
                                                             # figures: quality_checks.CheckFigures, with their errors
    TuneProgress(done, total, phase)                                                 # any number
    TuneMeasured(index, settings, rung, tok_per_s, n_prompts)                       # a candidate's running score
    TuneDone(section)                                                                # the profile's tuned section

What it searches: k_d (experts per draft step), the draft cap, the utility threshold, the reuse strength α,
the preferred-expert cap |E*|, whether s2moe copies from the context (where they rarely pay, their probes
cost a little; on text that repeats itself they are most of the gain), and under a memory budget the strength
of gating toward the experts in memory α_m. The objective is decoding tokens/s; the constraint is the quality
of reuse gating measured teacher-forced as `s2moe bench` measures it (quality_checks.gating_quality): perplexity
ratio ≤ PPL_RATIO_MAX and top-1 agreement ≥ TOP1_MIN; α_m meets the same bounds on its own check, one token a
step under the budget (quality_checks.memory_gating_quality), which is what a plain step meets. A drafted batch's
verification meets both biases at once, so under a budget each pair (α, |E*|) and α_m that pass alone are
checked together on the same batches, in the budget's process, and must pass that too: each bias alone near the
bounds says little of the two together. α = 0 is lossless and always allowed (it turns both off).

How: successive halving. The quality constraint depends on (α, |E*|) and α_m only, so it is checked once per
pair, once per α_m and once per combination before any speed is measured, and the settings that fail it never
run. A check whose top-1 agreement lands within two standard errors of its bound (too_close_to_call) is done
again on twice the text, and that verdict stands. Under a budget the checks cost minutes (each decodes its
texts in the budget's process), so they get at most QUALITY_SHARE of the time: the defaults' checks always,
then each candidate's in the pool's order while that share lasts, and only while those that passed do not
already fill what the halving can afford; a candidate left unchecked is not run.
The candidates (the model's defaults, every one-setting change of them, then random combinations, as many as the
time budget allows) each decode one prompt; the better half goes on to twice as many new prompts, and so on until
one is left. Why: a speed measurement is noisy and costs a whole generation, and most settings are plainly worse
after one prompt (a k_d that makes drafting too dear, a threshold that stops it paying); halving spends the time on
the contenders instead of measuring every candidate equally (a grid) and, unlike a model-based search (Bayesian
optimisation), needs no surrogate over seven mixed discrete settings whose response on a shared machine is noisier
than any such model's resolution. Each rung runs plain decoding (ar) and the defaults on the same prompts, all
interleaved per prompt in bench's balanced order, so that drifts of the machine hit every candidate alike; scores
are tokens over decoding seconds summed over a candidate's prompts.

The final comparison is the best survivor against the defaults, paired per prompt: while their per-prompt
speed ratios cannot tell them apart (the mean log ratio within two standard errors of zero), both run again
on further prompts, as long as time remains. The tuned settings are the best survivor only if it is at least
as fast as the defaults in that comparison; otherwise the defaults, and the result says so.

Time: every measurement is timed with an injected Clock (MonotonicClock in use; tests pass their own); a run
starts only if the time budget leaves room for it, judged from the slowest run so far.

Stopping: when should_stop() returns True the generator returns between two runs without TuneDone; Ctrl-C
(KeyboardInterrupt) propagates. The engine writes nothing: the caller saves TuneDone.section into the profile
(profiles.with_tuned, save_profile, both atomic).

This module holds the events and the search loop; what is searched (Settings, the space, the pool) is tune_space's,
the quality and time constraints are tune_constraints', the timing and speed comparisons tune_timing's.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from ..decoding.decoder import Decoder
from ..decoding.generation_config import GenerationConfig
from ..events import CostConstants
from .bench import balanced_order
from .quality_checks import CheckFigures
from .speed import LoadWatch, compare, separated
from .tune_constraints import (
    PPL_RATIO_MAX,
    TOP1_MIN,
    BenchChecks,
    QualityChecks,
    affordable,
    check_record,
    check_time,
    decided,
    ensure_defaults_fit,
    expected_check_s,
    figures_record,
    rung_runs,
    rungs,
    sh_cost,
    too_close_to_call,
    too_short,
    within_bounds,
)
from .tune_space import Settings, candidate_pool, default_settings, search_space
from .tune_timing import Clock, MonotonicClock, Runner, Score, judged, log_ratios

DEFAULT_TIME_BUDGET_S = 600.0
MAX_CANDIDATES = 32
QUALITY_TEXTS = 4
MAX_EXTRA_ROUNDS = 64  # further prompts for the final comparison while within noise
SH_SHARE = 0.75  # of the time left after the quality checks, for the halving
QUALITY_SHARE = 0.5  # of the time left before the quality checks, the most they may take


# -- events ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TuneStarted:
    candidates: int
    defaults: Settings
    time_budget_s: float
    space: dict[str, tuple[Any, ...]]


@dataclass(frozen=True)
class TuneQuality:
    reuse_strength: float
    reuse_cap: int
    figures: CheckFigures
    ok: bool
    reused: bool = False  # from an earlier run's record, not measured again


@dataclass(frozen=True)
class TuneMemoryQuality:
    memory_strength: float
    figures: CheckFigures
    ok: bool


@dataclass(frozen=True)
class TuneJointQuality:
    reuse_strength: float
    reuse_cap: int
    memory_strength: float
    figures: CheckFigures
    ok: bool


@dataclass(frozen=True)
class TuneProgress:
    done: int
    total: int
    phase: str


@dataclass(frozen=True)
class TuneMeasured:
    index: int  # the candidate's place in the pool (0: the defaults)
    settings: Settings
    rung: int  # -1: the final comparison
    tok_per_s: float  # its score so far: tokens over decoding seconds, all its prompts
    n_prompts: int


@dataclass(frozen=True)
class TuneDone:
    section: dict[str, Any]  # what profiles.with_tuned records for the model (see profiles' docstring)
    tuned: Settings
    defaults: Settings


TuneEvent = TuneStarted | TuneQuality | TuneMemoryQuality | TuneJointQuality | TuneProgress | TuneMeasured | TuneDone


def run_tune(
    decoder: Decoder,
    prompts: list[str],
    *,
    cost: CostConstants | None = None,
    n_tokens: int = 48,
    time_budget_s: float = DEFAULT_TIME_BUDGET_S,
    clock: Clock | None = None,
    should_stop: Callable[[], bool] | None = None,
    seed: int = 0,
    max_candidates: int = MAX_CANDIDATES,
    quality_texts: list[str] | None = None,
    context: dict[str, Any] | None = None,
    known_quality: list[dict[str, Any]] | None = None,
    checks: QualityChecks | None = None,
) -> Iterator[TuneEvent]:
    """Search the decoding settings of `decoder` (already set up for its budget by the caller) on `prompts`.

    cost: the cost constants generations will use with these settings (the profile's), None: measured at
    start-up as a generation without a profile does. context: recorded as is in the result (budget,
    prompt set, threads). known_quality: an earlier run's quality_checked entries for this model and
    prompt set; teacher-forced quality depends on neither device nor budget, so a pair checked with the
    same window is not checked again (under a budget a check costs minutes). checks: the quality checks
    (BenchChecks of the decoder unless given). See the module docstring for the search and the events."""
    clock = clock or MonotonicClock()
    checks = checks or BenchChecks(decoder)
    stop = should_stop or (lambda: False)
    if not prompts:
        raise ValueError("tuning needs at least one prompt")
    GenerationConfig(mode="s2moe").validate(decoder.info)  # a model nothing can draft on: one clear error
    t0 = clock.now()
    deadline = t0 + time_budget_s
    info = decoder.info
    base = GenerationConfig(n_predict=n_tokens, stop_at_eos=False, cost=cost)
    defaults = default_settings(decoder, base)
    knows_memory = decoder.knows_memory
    space = search_space(info.n_expert, info.n_expert_used, defaults, knows_memory)
    runner = Runner(decoder, base, clock, stop)
    ar_cfg = replace(base, mode="ar")

    # warm-up: every graph shape once, the start-up cost measurement (without a profile), nothing timed
    for cfg in (ar_cfg, defaults.config(base)):
        for _ in decoder.generate(prompts[0], replace(cfg, n_predict=8)):
            pass
    if stop():
        return
    # one timed run of the defaults sizes the pool to the time budget
    _, s_probe = runner.run(defaults.config(base), prompts[0])
    t_run = max(s_probe, 1e-9) * 1.2
    check_time(sh_cost(2, t_run), deadline - clock.now(), time_budget_s, t_run)
    # twice what the time affords before the quality checks, as some will fail them
    pool_all = candidate_pool(
        space,
        defaults,
        min(max_candidates, 2 * affordable(max_candidates, t_run, (deadline - clock.now()) * SH_SHARE)),
        seed,
    )

    # the quality constraint: each check once, the defaults' first and always, then those of the candidates in
    # the pool's order while the checks' share of the time lasts (the halving needs the rest)
    t_checks = clock.now()
    checks_deadline = t_checks + QUALITY_SHARE * (deadline - t_checks)
    texts = (quality_texts or prompts)[:QUALITY_TEXTS]
    more_texts = (quality_texts or prompts)[: 2 * QUALITY_TEXTS]
    window = defaults.draft_max + 1
    quality: dict[tuple[float, int], dict[str, Any]] = {}
    memory_quality: dict[float, dict[str, Any]] = {}
    joint_quality: dict[tuple[float, int, float], dict[str, Any]] = {}
    # each kind's checks by its key (see checks_of)
    made: dict[str, dict[Any, dict[str, Any]]] = {"reuse": quality, "memory": memory_quality, "both": joint_quality}
    yield TuneStarted(len(pool_all), defaults, time_budget_s, space)

    def both_biases(s: Settings) -> bool:
        return knows_memory and s.reuse_strength > 0 and s.memory > 0

    def checks_of(s: Settings) -> list[tuple[str, Any]]:
        """What s must pass, in the order the checks are made: each bias alone, then both together. Each as
        (kind, key): ("reuse", (α, |E*|)), ("memory", α_m), ("both", (α, |E*|, α_m))."""
        return (
            ([("reuse", s.gating)] if s.reuse_strength > 0 else [])
            + ([("memory", s.memory)] if knows_memory and s.memory > 0 else [])
            + ([("both", (*s.gating, s.memory))] if both_biases(s) else [])
        )

    def verdict(s: Settings) -> bool | None:
        """True: s passes every check it needs; False: it fails one; None: one it needs was not made."""
        for kind, key in checks_of(s):
            made_check = made[kind].get(key)
            if made_check is None:
                return None
            if not made_check["ok"]:
                return False
        return True

    # an earlier run's verdicts on reuse gating alone depend on neither device nor budget: taken as they stand
    earlier = {
        (float(e["reuse_strength"]), int(e["reuse_cap"])): e
        for e in known_quality or ()
        if e.get("window") == window and e.get("tokens") and e.get("ppl_ratio") is not None
    }
    for gating in sorted({s.gating for s in pool_all if s.reuse_strength > 0}):
        record = earlier.get(gating)
        if record is not None and (
            record.get("extended") or not too_close_to_call(record) or len(more_texts) <= len(texts)
        ):
            q = figures_record(record) | {"reused": True, "extended": bool(record.get("extended"))}
            quality[gating] = {**q, "ok": within_bounds(q)}
            yield TuneQuality(*gating, CheckFigures.of(q), quality[gating]["ok"], True)

    def make(kind: str, key: Any) -> tuple[dict[str, Any], TuneQuality | TuneMemoryQuality | TuneJointQuality]:
        if kind == "reuse":
            record = earlier.get(key)
            alpha, cap = key
            if record is not None:  # an earlier verdict too close to call on the first texts alone
                q = checks.reuse(more_texts, alpha, cap, window) | {"extended": True}
            else:
                q = decided(lambda t: checks.reuse(t, alpha, cap, window), texts, more_texts)
            return q, TuneQuality(alpha, cap, CheckFigures.of(q), within_bounds(q))
        if kind == "memory":
            q = decided(lambda t: checks.memory(t, key), texts, more_texts)
            return q, TuneMemoryQuality(key, CheckFigures.of(q), within_bounds(q))
        alpha, cap, strength = key
        q = decided(lambda t: checks.both(t, alpha, cap, window, strength), texts, more_texts)
        return q, TuneJointQuality(alpha, cap, strength, CheckFigures.of(q), within_bounds(q))

    checks_planned = len({c for s in pool_all for c in checks_of(s) if c[0] != "reuse" or c[1] not in quality})
    checks_made = 0
    took: dict[str, float] = {}  # the slowest check of each kind so far
    stopped_checking = None  # "time": the checks' share was spent; "enough": the halving could run no more
    for i, s in enumerate(pool_all):  # the defaults first
        if s != defaults and sum(verdict(c) is True for c in pool_all[:i]) >= affordable(
            len(pool_all), t_run, (deadline - clock.now() - max(took.values(), default=0.0)) * SH_SHARE
        ):
            stopped_checking = "enough"  # those before it fill the halving: it would not run if it passed
            break
        for kind, key in checks_of(s):
            if key in made[kind]:
                if made[kind][key]["ok"]:
                    continue
                break  # fails a check: it needs no more
            if s != defaults and clock.now() + expected_check_s(took, kind) > checks_deadline:
                stopped_checking = "time"
                break
            if stop():
                return
            started = clock.now()
            q, event = make(kind, key)
            took[kind] = max(took.get(kind, 0.0), clock.now() - started)
            made[kind][key] = {**q, "ok": event.ok}
            checks_made += 1
            yield event
            yield TuneProgress(checks_made, checks_planned, "quality")
            if not event.ok:
                break
            if s == defaults:  # a check is timed now: say at once if the defaults' own cannot fit
                left = [expected_check_s(took, c) for c, k in checks_of(defaults) if k not in made[c]]
                ensure_defaults_fit(left, took[kind], t_run, deadline - clock.now(), time_budget_s, clock.now() - t0)
        if stopped_checking:
            break
    checks_s = clock.now() - t_checks
    unchecked = sum(verdict(s) is None for s in pool_all)

    def within_quality(s: Settings) -> bool:
        return verdict(s) is True

    feasible = [s for s in pool_all if within_quality(s)]
    if defaults not in feasible:
        feasible = [defaults] + feasible  # measured as the reference; chosen only if feasible
    index_of = {s: i for i, s in enumerate(pool_all)}

    # how many candidates the time left affords: each rung costs about n0 runs (half the candidates on
    # twice the prompts), plus ar and the defaults on each of its prompts
    pool = feasible[: affordable(len(feasible), t_run, (deadline - clock.now()) * SH_SHARE)]  # the defaults first

    runs: dict[Settings | str, dict[int, tuple[int, float]]] = {"ar": {}}
    scores: dict[Settings | str, Score] = {"ar": Score()}
    log: list[dict[str, Any]] = []
    survivors = [s for s in pool if s != defaults]
    for s in pool:
        runs[s], scores[s] = {}, Score()
    runs.setdefault(defaults, {})
    scores.setdefault(defaults, Score())
    prompt_cursor = 0
    rung = 0
    done_runs = 0
    watch = LoadWatch()
    planned = sum(rung_runs(max(1, len(survivors) >> r), r) for r in range(rungs(len(survivors))))

    def measure(who: Settings | str, cfg: GenerationConfig, p: int) -> None:
        nonlocal done_runs
        n, s = runner.run(cfg, prompts[p % len(prompts)])
        runs[who][p] = (n, s)
        sc = scores[who]
        sc.tokens, sc.seconds, sc.runs = sc.tokens + n, sc.seconds + s, sc.runs + 1
        done_runs += 1

    def room(n_runs: int) -> bool:
        return clock.now() + n_runs * max(runner.slowest, s_probe) <= deadline

    stopped_for_time = False
    rungs_run = 0
    while survivors:
        n_prompts = 1 << rung
        order_base: list[Settings | str] = ["ar", defaults, *survivors]
        if not room(n_prompts * len(order_base)) or (rung > 0 and len(survivors) == 1):
            stopped_for_time = not (rung > 0 and len(survivors) == 1)
            break
        for _ in range(n_prompts):
            p = prompt_cursor
            prompt_cursor += 1
            for who in (order_base[i] for i in balanced_order(len(order_base), p)):
                if stop():
                    return
                measure(who, ar_cfg if isinstance(who, str) else who.config(base), p)  # the one str is "ar"
                yield TuneProgress(done_runs, max(planned, done_runs), f"rung {rung + 1}")
        rungs_run = rung + 1
        ranked = sorted(survivors, key=lambda s: scores[s].tok_per_s, reverse=True)
        keep = ranked[: max(1, (len(ranked) + 1) // 2)]
        for s in [defaults] + ranked:
            log.append(
                {
                    "rung": rung + 1,
                    **s.as_dict(),
                    "tok_s": round(scores[s].tok_per_s, 3),
                    "prompts": len(runs[s]),
                    "kept": s in keep or s == defaults,
                }
            )
            yield TuneMeasured(index_of.get(s, -1), s, rung, scores[s].tok_per_s, len(runs[s]))
        if len(survivors) == 1:
            break
        survivors = keep
        rung += 1

    if not rungs_run:
        raise too_short(
            time_budget_s,
            f"the quality checks took {clock.now() - t0:.0f} s and left no room for a "
            f"rung of runs of about {t_run:.1f} s",
        )
    # the final comparison: the best survivor against the defaults, repeated while within noise
    best = max(survivors, key=lambda s: scores[s].tok_per_s) if survivors and scores[survivors[0]].runs else defaults
    extra = 0
    if best != defaults:
        while not separated(log_ratios(runs[best], runs[defaults])) and extra < MAX_EXTRA_ROUNDS and room(2):
            p = prompt_cursor
            prompt_cursor += 1
            for who in (best, defaults) if p % 2 else (defaults, best):
                if stop():
                    return
                measure(who, who.config(base), p)
            extra += 1
            yield TuneProgress(done_runs, done_runs, "final comparison")
        for s in (defaults, best):
            log.append(
                {
                    "rung": "final",
                    **s.as_dict(),
                    "tok_s": round(scores[s].tok_per_s, 3),
                    "prompts": len(runs[s]),
                    "kept": True,
                }
            )
            yield TuneMeasured(index_of.get(s, -1), s, -1, scores[s].tok_per_s, len(runs[s]))
    ratios = log_ratios(runs[best], runs[defaults]) if best != defaults else []
    shared = sorted(set(runs[best]) & set(runs[defaults]))

    def paired_speed(who: Settings) -> float:
        n = sum(runs[who][p][0] for p in shared)
        s = sum(runs[who][p][1] for p in shared)
        return n / s if s > 0 else 0.0

    defaults_feasible = within_quality(defaults)
    if best != defaults and shared:
        best_tps, def_tps = paired_speed(best), paired_speed(defaults)
    else:
        best_tps = def_tps = scores[defaults].tok_per_s
    # a lead within the noise is no reason to leave the defaults
    tuned = (
        best
        if (best != defaults and ((best_tps > def_tps and separated(ratios)) or not defaults_feasible))
        else defaults
    )
    tuned_tps = best_tps if tuned == best else def_tps
    rq = quality.get(tuned.gating) if tuned.reuse_strength > 0 else None
    mq = memory_quality.get(tuned.memory) if knows_memory and tuned.memory > 0 else None
    jq = joint_quality.get((*tuned.gating, tuned.memory)) if both_biases(tuned) else None
    ar_tps = scores["ar"].tok_per_s
    judgement = judged(runs, tuned, defaults, watch)
    assert judgement.load is not None  # judged hands judge this search's LoadWatch reading
    elapsed = clock.now() - t0
    section = {
        "settings": tuned.as_dict(),
        "defaults": defaults.as_dict(),
        "speed": {
            "tuned_tok_s": round(tuned_tps, 4),
            "defaults_tok_s": round(def_tps, 4),
            "ar_tok_s": round(ar_tps, 4) if ar_tps else None,
            "gain": round(tuned_tps / def_tps, 4) if def_tps > 0 else None,
            "prompts_compared": len(shared) if best != defaults else len(runs[defaults]),
            "per_prompt_ratios": [round(math.exp(x), 4) for x in ratios],
            "separated": separated(ratios),
            "best_candidate": best.as_dict(),
            "best_tok_s": round(best_tps, 4),
            "verdict": _verdict(tuned, best, defaults, ratios, defaults_feasible),
            "versus_ar": [c.text() for c in judgement.versus_baseline],
            "machine": judgement.load.as_dict(),
            "warning": judgement.warning,
        },
        "quality": (figures_record(rq) if rq else {"lossless": True})
        | ({"memory": {"memory_strength": tuned.memory, **figures_record(mq)}} if mq else {})
        | ({"both": {"memory_strength": tuned.memory, **figures_record(jq)}} if jq and jq.get("tokens") else {}),
        "memory_quality_checked": [
            {"memory_strength": a, **check_record(v)} for a, v in sorted(memory_quality.items())
        ],
        "joint_quality_checked": [
            {"reuse_strength": a, "reuse_cap": c, "memory_strength": m, **check_record(v)}
            for (a, c, m), v in sorted(joint_quality.items())
        ],
        "quality_checked": [
            {"reuse_strength": a, "reuse_cap": c, "window": window, **check_record(v), "reused": bool(v.get("reused"))}
            for (a, c), v in sorted(quality.items())
        ],
        "constraint": {"ppl_ratio_max": PPL_RATIO_MAX, "top1_min": TOP1_MIN, "defaults_meet_it": defaults_feasible},
        "search": {
            "method": "successive halving",
            "candidates": len(pool),
            "pool": len(pool_all),
            "feasible": len(feasible),
            "rungs": rungs_run,
            "final_rounds": extra,
            "stopped_for_time": stopped_for_time,
            "n_tokens": n_tokens,
            "runs": done_runs,
            "seconds": round(elapsed, 3),
            "time_budget_s": float(time_budget_s),
            "quality_checks_s": round(checks_s, 3),
            "unchecked": unchecked,
            "stopped_checking": stopped_checking,
        },
        "log": log,
        "measured": {
            "at": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
            "by": "s2moe tune",
            **(context or {}),
        },
    }
    yield TuneDone(section, tuned, defaults)


def _verdict(tuned: Settings, best: Settings, defaults: Settings, ratios: list[float], defaults_ok: bool) -> str:
    if best == defaults:
        return "the defaults were the fastest candidate"
    c = compare("best", "defaults", [math.exp(x) for x in ratios])
    noise = "" if c.significant else ", within the noise of this machine (not significant)"
    if tuned == defaults:
        return f"the defaults are best: the fastest other candidate ran at {c.ratio_text} their speed{noise}"
    if not defaults_ok:
        return f"the defaults fail the quality constraint; the best candidate that meets it: {c.ratio_text}{noise}"
    return f"tuned {c.ratio_text} the defaults (geometric mean of per-prompt ratios){noise}"
