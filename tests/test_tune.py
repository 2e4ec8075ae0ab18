"""On-device tuning: the search on a tiny model timed by a clock that counts decoding iterations, its time
budget and stopping, the tuned section of a profile, and generate/bench/app taking tuned settings unless a
flag says otherwise."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from s2moe.app.cli import main
from s2moe.app.model_runs import generation_config, resolve_tuned
from s2moe.app.parser import build_parser
from s2moe.engine.errors import ConfigError
from s2moe.engine.events import CostConstants
from s2moe.engine.measure.prompts import load_prompts
from s2moe.engine.measure.tune import (
    QUALITY_SHARE,
    TuneDone,
    TuneMeasured,
    TuneMemoryQuality,
    TuneProgress,
    TuneQuality,
    TuneStarted,
    run_tune,
)
from s2moe.engine.measure.tune_constraints import BenchChecks, decided, expected_check_s, too_close_to_call
from s2moe.engine.measure.tune_space import Settings, candidate_pool, default_settings, search_space
from s2moe.engine.measure.tune_timing import Clock, MonotonicClock
from s2moe.engine.model_info import read_model_info
from s2moe.engine.profiles import load_profile, save_profile, tuned_settings, with_tuned

# Constants under which the utility rule drafts on the tiny model (a plain step dear, a draft step cheap), so
# that candidates differ in how many tokens an iteration commits.
DRAFTING = CostConstants(t_ar=0.01, c_draft=0.0005, t_exp=1e-6, t_tok=1e-5, intercept=0.0, source="test")


class IterationClock:
    """Every reading is one unit later: the search reads the clock once per decoding iteration, so a run's
    time is its iteration count and tok/s its tokens per iteration — deterministic, and what speculation
    is meant to raise."""

    def __init__(self) -> None:
        self.t = 0.0
        self.reads = 0

    def now(self) -> float:
        self.t += 1.0
        self.reads += 1
        return self.t


@pytest.fixture(scope="module")
def tiny(tiny_models):
    from s2moe.engine.decoding.decoder import Decoder

    dec = Decoder(str(tiny_models["olmoe"]), n_ctx=512, n_threads=1)
    yield dec
    dec.close()


@pytest.fixture(scope="module")
def prompts():
    return load_prompts("natural", 12)[1]


def _tune(dec, prompts, budget, **kw):
    clock = IterationClock()
    events = list(run_tune(dec, prompts, cost=DRAFTING, n_tokens=16, time_budget_s=budget, clock=clock, **kw))
    return events, clock


class SlowChecks:
    """bench's checks (QualityChecks), each taking `cost` units of the test's clock (or cost[kind]), as a check under
    a budget takes minutes: what they measure is the tiny model's, what they take is scripted."""

    def __init__(self, decoder, clock: IterationClock, cost: float | dict[str, float]) -> None:
        self.real, self.clock, self.cost = BenchChecks(decoder), clock, cost
        self.made: list[tuple] = []

    def _took(self, kind: str, q: dict, *key) -> dict:
        self.clock.t += self.cost[kind] if isinstance(self.cost, dict) else self.cost
        self.made.append(key)
        return q

    def reuse(self, texts, alpha, cap, window):
        return self._took("reuse", self.real.reuse(texts, alpha, cap, window), alpha, cap)

    def memory(self, texts, alpha):
        return self._took("memory", self.real.memory(texts, alpha), alpha)

    def both(self, texts, alpha, cap, window, memory):
        return self._took("both", self.real.both(texts, alpha, cap, window, memory), alpha, cap, memory)


def test_quality_checks_take_at_most_their_share_of_the_time_and_the_defaults_come_first(tiny, prompts):
    clock = IterationClock()
    checks = SlowChecks(tiny, clock, cost=400.0)
    events = list(run_tune(tiny, prompts, cost=DRAFTING, n_tokens=16, time_budget_s=3000, clock=clock, checks=checks))
    sec = events[-1].section
    defaults = default_settings(tiny)
    assert checks.made[0] == defaults.gating  # the defaults' check first, whatever the time
    started = [e for e in events if isinstance(e, TuneStarted)][0]
    # checks stop once the next would overrun their share: at most one check past half of the time left
    assert 0 < sec["search"]["quality_checks_s"] <= QUALITY_SHARE * 3000 + 400 + 10
    assert sec["search"]["unchecked"] > 0 and len(checks.made) < started.candidates
    assert sec["search"]["stopped_checking"] == "time"
    checked = {(e["reuse_strength"], e["reuse_cap"]) for e in sec["quality_checked"]}
    assert checked == set(checks.made)
    # a candidate whose check was not made is never run, and the search still ends within its budget
    measured = [e.settings for e in events if isinstance(e, TuneMeasured) and e.settings.reuse_strength > 0]
    assert measured and all(s.gating in checked for s in measured)
    assert sec["search"]["seconds"] <= 3000


def test_a_budget_the_defaults_checks_overrun_is_said_once_a_check_is_timed(tiny, prompts):
    clock = IterationClock()
    checks = SlowChecks(tiny, clock, cost=389.0)  # and one reading of the clock: 390
    events = []
    with pytest.raises(ConfigError) as e:
        for ev in run_tune(tiny, prompts, cost=DRAFTING, n_tokens=16, time_budget_s=400, clock=clock, checks=checks):
            events.append(ev)
    words = e.value.worded({"time_budget": "--time-budget"})
    assert words.startswith(
        "--time-budget of 400 s is too short: a quality check takes about 390 s here; "
        "comparing two candidates then takes about"
    )
    assert words.endswith("min, a search more")
    assert len(checks.made) == 1 and not any(isinstance(ev, TuneMeasured) for ev in events)


def test_a_check_not_yet_timed_is_expected_to_take_what_its_own_kind_or_the_kind_it_runs_like_took():
    assert expected_check_s({}, "memory") == 0.0
    assert expected_check_s({"reuse": 100.0}, "memory") == 100.0  # no check like it timed: the slowest of any
    took = {"reuse": 100.0, "memory": 400.0}
    assert expected_check_s(took, "both") == 100.0  # batches, as reuse's: not the one-token-a-step memory check
    assert expected_check_s(took, "memory") == 400.0 and expected_check_s({"memory": 400.0}, "both") == 400.0


def test_the_defaults_memory_check_taking_long_does_not_make_their_batched_check_look_as_long(tiny_models, prompts):
    from s2moe.engine.decoding.decoder import Decoder
    from s2moe.engine.offload import Pinning, offload_decoder

    dec = Decoder(str(tiny_models["olmoe"]), n_ctx=512, n_threads=1, use_extra_bufts=False)
    off = offload_decoder(dec, None, pinning=Pinning(base=False, hot=False))
    try:
        assert dec.knows_memory
        clock = IterationClock()
        # one token a step, the memory check takes four times the batched ones: the time left after it holds the
        # joint check and a comparison, not another check as long as the memory one
        checks = SlowChecks(dec, clock, cost={"reuse": 1000.0, "memory": 4000.0, "both": 1000.0})
        events = list(
            run_tune(dec, prompts, cost=DRAFTING, n_tokens=16, time_budget_s=9000, clock=clock, checks=checks)
        )
        defaults = default_settings(dec)
        assert checks.made[:3] == [defaults.gating, (defaults.memory,), (*defaults.gating, defaults.memory)]
        assert isinstance(events[-1], TuneDone) and events[-1].section["search"]["seconds"] <= 9000
    finally:
        off.close()
        dec.close()


def test_no_candidate_is_checked_once_those_that_passed_fill_the_halving(tiny, prompts):
    clock = IterationClock()
    checks = SlowChecks(tiny, clock, cost=1.0)  # cheap checks: time is not what stops them
    events = list(run_tune(tiny, prompts, cost=DRAFTING, n_tokens=16, time_budget_s=400, clock=clock, checks=checks))
    search = events[-1].section["search"]
    # the pool is twice what the halving affords (some fail their checks): here enough passed before its end
    assert search["stopped_checking"] == "enough" and search["quality_checks_s"] < 0.1 * 400
    run = {e.settings for e in events if isinstance(e, TuneMeasured)}
    assert all(s.reuse_strength == 0 or s.gating in {key[:2] for key in checks.made} for s in run)


def test_without_a_clock_the_search_times_with_the_monotonic_one(tiny, prompts, monkeypatch):
    """The real clock reads time.perf_counter (monotonic, fine-grained), and a search given no clock times with
    it: a budget nothing fits in is found too short by that clock's readings."""
    import time

    real: Clock = MonotonicClock()
    before = time.perf_counter()
    now = real.now()
    assert before <= now <= time.perf_counter()
    reads = []
    monkeypatch.setattr(MonotonicClock, "now", lambda self: reads.append(time.perf_counter()) or reads[-1])
    with pytest.raises(ConfigError, match="too short"):
        list(run_tune(tiny, prompts, cost=DRAFTING, n_tokens=16, time_budget_s=1e-3))
    assert len(reads) >= 3


def test_the_pool_starts_from_the_defaults_and_varies_each_setting(tiny):
    d = default_settings(tiny)
    assert (d.draft_topk, d.reuse_cap) == (1, 7)  # the tiny model routes 4 of 8
    space = search_space(8, 4, d)
    assert space["draft_topk"] == (1, 2) and max(space["reuse_cap"]) < 8
    pool = candidate_pool(space, d, 10)
    assert pool[0] == d and len(set(pool)) == len(pool) == 10
    keys = ("draft_topk", "draft_max", "threshold", "reuse_strength", "reuse_cap", "lookup")
    changed = {k for s in pool[1:7] for k in keys if getattr(s, k) != getattr(d, k)}
    assert len(changed) == 6  # the first variants change one setting each, a different one each time
    assert d.lookup and space["lookup"] == (True, False)
    # without gating |E*| changes nothing: no candidate differs from another only there
    off = [s for s in candidate_pool(space, d, 500) if s.reuse_strength == 0]
    assert {s.reuse_cap for s in off} == {d.reuse_cap}
    # the memory strength acts only where the decoder knows what is in memory (under a budget)
    assert not tiny.knows_memory and space["memory_strength"] == (d.memory_strength,) == (0.3,)
    budgeted = search_space(8, 4, d, knows_memory=True)
    assert budgeted["memory_strength"] == (0.0, 0.15, 0.3, 0.5)
    pool = candidate_pool(budgeted, d, 500)
    assert {s.memory_strength for s in pool} == set(budgeted["memory_strength"])
    assert {s.memory_strength for s in pool if s.reuse_strength == 0} == {d.memory_strength}  # gating off: no bias
    assert d.label() == d.label(memory_shown=False) and "memory α 0.3" in d.label(memory_shown=True)


def test_successive_halving_finds_the_candidate_that_commits_most_per_iteration(tiny, prompts):
    events, clock = _tune(tiny, prompts, 5000)
    assert isinstance(events[0], TuneStarted) and isinstance(events[-1], TuneDone)
    assert any(isinstance(e, TuneProgress) for e in events)
    # resident: nothing is in memory to gate toward, so its strength is neither searched nor checked
    assert events[0].space["memory_strength"] == (0.3,) and not any(isinstance(e, TuneMemoryQuality) for e in events)
    assert events[-1].section["memory_quality_checked"] == [] and "memory" not in events[-1].section["quality"]
    quality = {(q.reuse_strength, q.reuse_cap): q for q in events if isinstance(q, TuneQuality)}
    measured = [e for e in events if isinstance(e, TuneMeasured)]
    # nothing that fails the quality constraint is ever timed
    for m in measured:
        if m.settings.reuse_strength > 0 and m.settings != events[0].defaults:
            assert quality[m.settings.gating].ok
    done = events[-1]
    sec = done.section
    # plain decoding commits one token per iteration: exactly 1 on this clock
    assert sec["speed"]["ar_tok_s"] == 1.0
    # halving: each rung keeps half of the one before, and the last rung's best is the one compared
    log = [r for r in sec["log"] if Settings(**{k: r[k] for k in Settings.__dataclass_fields__}) != done.defaults]
    per_rung = [sum(1 for r in log if r["rung"] == n) for n in range(1, sec["search"]["rungs"] + 1)]
    assert per_rung[0] == sec["search"]["candidates"] - 1
    assert all(b == math.ceil(a / 2) for a, b in zip(per_rung, per_rung[1:]))
    last = [r for r in log if r["rung"] == sec["search"]["rungs"]]
    best = max(last, key=lambda r: r["tok_s"])
    assert {k: best[k] for k in Settings.__dataclass_fields__} == sec["speed"]["best_candidate"]
    # drafting pays on this clock: the tuned settings beat the defaults, measured in the same run
    assert done.tuned != done.defaults and sec["speed"]["separated"]
    # and against plain decoding too, prompt by prompt: both faster than ar on this clock
    defaults_vs_ar, tuned_vs_ar = sec["speed"]["versus_ar"]
    paired = 2 ** sec["search"]["rungs"] - 1  # ar runs beside the defaults on every prompt of every rung
    assert defaults_vs_ar.startswith("the defaults ")
    assert defaults_vs_ar.endswith(f"× ar ({paired} paired runs): faster")
    # the tuned settings survived every rung: beside ar on the same prompts
    assert tuned_vs_ar.startswith("tuned ") and tuned_vs_ar.endswith(f"× ar ({paired} paired runs): faster")
    assert sec["speed"]["machine"]["cpus"] >= 1 and "warning" in sec["speed"]
    assert sec["speed"]["tuned_tok_s"] > sec["speed"]["defaults_tok_s"] > 1.0
    assert sec["speed"]["gain"] == pytest.approx(sec["speed"]["tuned_tok_s"] / sec["speed"]["defaults_tok_s"], abs=1e-3)
    assert sec["settings"] == done.tuned.as_dict() and sec["defaults"] == done.defaults.as_dict()
    q = sec["quality"]
    assert q.get("lossless") or (q["ppl_ratio"] <= 1.02 and q["top1_agreement"] >= 0.9)
    assert sec["search"]["seconds"] <= 5000


@pytest.mark.parametrize("budget", [150, 400])
def test_the_search_ends_within_its_time_budget(tiny, prompts, budget):
    events, clock = _tune(tiny, prompts, budget)
    sec = events[-1].section
    assert sec["search"]["seconds"] <= budget and clock.t - 1 <= budget
    assert 0 < sec["search"]["quality_checks_s"] < sec["search"]["seconds"]
    assert sec["search"]["candidates"] < sec["search"]["pool"]  # the budget, not the pool, set how many ran


def test_a_budget_too_short_to_compare_anything_is_one_clear_error(tiny, prompts):
    with pytest.raises(ConfigError) as e:
        list(run_tune(tiny, prompts, cost=DRAFTING, n_tokens=16, time_budget_s=10, clock=IterationClock()))
    assert "too short" in e.value.worded({"time_budget": "--time-budget"})
    assert e.value.worded({"time_budget": "--time-budget"}).startswith("--time-budget of 10 s")


def test_a_check_too_close_to_its_bound_to_call_is_settled_on_twice_the_text():
    # top-1 over 360 tokens moves by ~0.016 (one standard error): 0.903 could be either side of 0.9
    assert too_close_to_call({"tokens": 360, "top1_agreement": 0.903})
    assert too_close_to_call({"tokens": 360, "top1_agreement": 0.894})
    assert not too_close_to_call({"tokens": 360, "top1_agreement": 0.94})
    assert not too_close_to_call({"tokens": 360, "top1_agreement": 0.85})
    assert not too_close_to_call({"tokens": 3600, "top1_agreement": 0.92})  # more text, a narrower band
    assert not too_close_to_call({"tokens": 0}) and not too_close_to_call({})
    # the check's own error where it is larger than the binomial one (tokens of a passage move together)
    assert too_close_to_call({"tokens": 3600, "top1_agreement": 0.92, "top1_se": 0.015})
    # a perplexity ratio near its bound is taken as measured: more text would not settle it (its error over 720
    # tokens is about its margin), and doubling every check would double their time
    assert not too_close_to_call({"tokens": 720, "top1_agreement": 0.95, "ppl_ratio": 1.015, "log_ppl_ratio_se": 0.01})
    first, more = ["a", "b"], ["a", "b", "c", "d"]
    calls = []

    def check(top1_by_texts):
        def run(texts):
            calls.append(list(texts))
            return {"tokens": 180 * len(texts), "top1_agreement": top1_by_texts[len(texts)], "ppl_ratio": 1.0}

        return run

    assert decided(check({2: 0.95}), first, more) == {"tokens": 360, "top1_agreement": 0.95, "ppl_ratio": 1.0}
    assert calls == [first]
    calls.clear()
    q = decided(check({2: 0.903, 4: 0.921}), first, more)
    assert calls == [first, more] and q["extended"] and q["tokens"] == 720 and q["top1_agreement"] == 0.921
    calls.clear()
    q = decided(check({2: 0.903}), first, first)  # nothing more to check on: the first verdict stands
    assert calls == [first] and "extended" not in q


def test_quality_checked_once_is_not_checked_again(tiny, prompts, xdg):
    from s2moe.app.cmd_tune import earlier_quality

    first, _ = _tune(tiny, prompts, 5000)
    checked = first[-1].section["quality_checked"]
    assert checked and not any(e["reused"] for e in checked)
    for e in (e for e in checked if e["tokens"]):
        # errors of the means, as bench computes them over stretches of the text: where gating moved a token or
        # a likelihood, they are there, and near what independent tokens would give (not a token's spread, 16x)
        p, n = e["top1_agreement"], e["tokens"]
        assert p == 1.0 or 0.25 < e["top1_se"] / math.sqrt(p * (1 - p) / n) < 4, e
        assert e["ppl_ratio"] == 1.0 or e["log_ppl_ratio_se"] > 0, e
    again, _ = _tune(tiny, prompts, 5000, known_quality=checked)
    reused = [e for e in again if isinstance(e, TuneQuality)]
    assert reused and all(q.reused for q in reused)
    assert [(q.reuse_strength, q.reuse_cap, q.ok) for q in reused] == [
        (e["reuse_strength"], e["reuse_cap"], e["ok"]) for e in checked
    ]
    # an earlier verdict too close to call on the first texts alone is settled on twice the text now
    close = [dict(e, top1_agreement=0.9, tokens=360, extended=False) for e in checked]
    settled, _ = _tune(tiny, prompts, 5000, known_quality=close)
    rechecked = [q for q in settled if isinstance(q, TuneQuality)]
    assert rechecked and not any(q.reused for q in rechecked)
    assert all(e["extended"] for e in settled[-1].section["quality_checked"])
    # another window (draft cap) is another measurement
    other = [dict(e, window=e["window"] + 1) for e in checked]
    fresh, _ = _tune(tiny, prompts, 5000, known_quality=other)
    assert not any(q.reused for q in fresh if isinstance(q, TuneQuality))
    # the command takes them from the profile, for the same prompt set only
    fp = tiny.info.fingerprint
    section = dict(first[-1].section, measured={"prompts": "natural"})
    prof = with_tuned(_profile(fp), fp, section, offloaded=True)
    assert earlier_quality(prof, fp, "natural") == checked and earlier_quality(prof, fp, "humaneval") == []


def test_stopping_yields_no_result(tiny, prompts):
    seen = []
    gen = run_tune(
        tiny,
        prompts,
        cost=DRAFTING,
        n_tokens=16,
        time_budget_s=5000,
        clock=IterationClock(),
        should_stop=lambda: len(seen) >= 1,
    )
    for ev in gen:
        if isinstance(ev, TuneMeasured):
            seen.append(ev)
        assert not isinstance(ev, TuneDone)
    assert seen and all(m.rung == 0 for m in seen)  # the first rung's results, then not one run more


# -- the profile's tuned section --------------------------------------------------------------------------
@pytest.fixture
def xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    return tmp_path / "cfg" / "s2moe" / "profiles"


def _profile(fp: str) -> dict:
    return {
        "schema": 1,
        "name": "dev",
        "kind": "measured",
        "device": {"name": "test cpu", "kind": "cpu"},
        "models": {
            fp: {
                "model": "m.gguf",
                "t_ar_ms": 10.0,
                "c_draft_ms": 0.5,
                "t_exp_ms": 0.001,
                "t_tok_ms": 0.01,
                "intercept_ms": 0.0,
            }
        },
    }


def _section(**settings) -> dict:
    s = {
        "draft_topk": 2,
        "draft_max": 12,
        "threshold": 0.5,
        "reuse_strength": 0.25,
        "reuse_cap": 6,
        "lookup": False,
        **settings,
    }
    return {
        "settings": s,
        "defaults": dict(s),
        "speed": {"tuned_tok_s": 3.0, "defaults_tok_s": 2.0, "gain": 1.5},
        "quality": {"ppl_ratio": 1.001, "top1_agreement": 0.99, "tokens": 100},
        "log": [{"rung": 1, **s, "tok_s": 3.0, "prompts": 1, "kept": True}],
    }


def test_the_tuned_section_round_trips_per_condition(xdg):
    fp = "0123456789abcdef"
    with_resident = with_tuned(_profile(fp), fp, _section(), offloaded=False)
    both = with_tuned(with_resident, fp, _section(draft_topk=1, reuse_strength=0.0), offloaded=True)
    path = save_profile(both, "dev")
    back = load_profile("dev")
    assert back["models"][fp]["tuned"]["resident"] == _section()
    assert tuned_settings(back, fp) == _section()["settings"]
    assert tuned_settings(back, fp, offloaded=True)["draft_topk"] == 1
    assert tuned_settings(back, "fedcba9876543210") == {}
    # tuned before tune searched copies: no lookup setting, so decoding keeps its default
    older = {k: v for k, v in _section()["settings"].items() if k != "lookup"}
    path = save_profile(with_tuned(_profile(fp), fp, {**_section(), "settings": older}, offloaded=False), "old")
    assert "lookup" not in tuned_settings(load_profile("old"), fp)
    # tuned under a budget with the memory strength searched: decoding there takes it
    save_profile(with_tuned(_profile(fp), fp, _section(memory_strength=0.15), offloaded=True), "mem")
    assert tuned_settings(load_profile("mem"), fp, offloaded=True)["memory_strength"] == 0.15
    assert "memory_strength" not in tuned_settings(load_profile("old"), fp)
    assert path.read_text().startswith("# s2moe device profile")


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"draft_max": 40}, "draft_max"),
        ({"draft_topk": 0}, "draft_topk"),
        ({"threshold": "high"}, "threshold"),
        ({"lookup": 1}, "lookup"),
        ({"memory_strength": -0.1}, "memory_strength"),
    ],
)
def test_a_bad_tuned_setting_is_named(xdg, settings, field):
    fp = "0123456789abcdef"
    prof = with_tuned(_profile(fp), fp, _section(**settings), offloaded=False)
    with pytest.raises(ConfigError, match=f"tuned.resident.settings: field {field}"):
        save_profile(prof, "dev")
    assert not (xdg / "dev.yaml").exists()


def test_the_summary_says_when_the_tuned_settings_turn_copies_off():
    from s2moe.app.cmd_tune import summary_lines

    section = {**_section(), "defaults": {**_section()["settings"], "lookup": True}}
    section["speed"]["verdict"] = "tuned"
    section["search"] = {
        "method": "successive halving",
        "candidates": 2,
        "pool": 2,
        "feasible": 2,
        "rungs": 1,
        "runs": 2,
        "seconds": 1.0,
        "time_budget_s": 60.0,
    }
    defaults, tuned = summary_lines(section, None)[:2]
    assert "copies off" in tuned and "copies" not in defaults
    # against plain decoding as well as the defaults, and a warning where the machine was busy
    assert not any(line.startswith(("against plain decoding", "warning")) for line in summary_lines(section, None))
    judged = {
        **section,
        "speed": {
            **section["speed"],
            "versus_ar": ["the defaults 0.96 ± 0.02× ar (7 paired runs): slower"],
            "warning": "other processes used 1.1 of 2 CPUs (cc1 1.1) — differences may "
            "be noise; rerun on a quiet machine",
        },
    }
    lines = summary_lines(judged, None)
    assert lines[3] == "against plain decoding: the defaults 0.96 ± 0.02× ar (7 paired runs): slower"
    assert lines[4].startswith("warning: other processes used 1.1 of 2 CPUs")
    assert not any("quality checks" in line for line in summary_lines(section, None))  # an earlier version's record
    for unchecked, stopped in ((0, None), (1, "time"), (1, "enough")):
        search = {**section["search"], "quality_checks_s": 20.0, "unchecked": unchecked, "stopped_checking": stopped}
        lines = summary_lines({**section, "search": search}, None)
        assert any(line.endswith("1 s of 60 s, 20 s of it the quality checks") for line in lines)
        # said only where time cut the checks short: unchecked because the halving was full loses nothing
        assert any(
            line.startswith("1 of 2 candidates were not run: the quality checks had used their share") for line in lines
        ) == (stopped == "time")
    assert "memory α" not in tuned  # tuned resident: α_m acts nowhere there
    budgeted = {
        **section,
        "settings": {**section["settings"], "memory_strength": 0.15},
        "measured": {"budget": "auto (496.5 MiB)"},
        "quality": {
            **section["quality"],
            "memory": {
                "memory_strength": 0.15,
                "ppl_ratio": 1.004,
                "top1_agreement": 0.95,
                "mean_kl": 0.003,
                "tokens": 384,
            },
            "both": {
                "memory_strength": 0.15,
                "ppl_ratio": 1.011,
                "top1_agreement": 0.912,
                "mean_kl": 0.006,
                "tokens": 360,
                "top1_se": 0.0143,
                "log_ppl_ratio_se": 0.008,
            },
        },
    }
    lines = summary_lines(budgeted, None)
    assert "memory α 0.15" in lines[1]
    # a record of an earlier version has no standard errors; one of this version gives them
    assert any(
        line.startswith("quality in memory: α_m 0.15: perplexity ratio 1.0040, top-1 agreement 0.950 over")
        for line in lines
    )
    assert any(
        line.startswith(
            "quality of both biases: α_m 0.15 with reuse gating: perplexity ratio 1.0110 ± 0.0081, "
            "top-1 agreement 0.912 ± 0.014 over 360 tokens"
        )
        for line in lines
    )


def test_tuning_needs_the_models_constants():
    with pytest.raises(ConfigError, match="s2moe calibrate"):
        with_tuned(_profile("0123456789abcdef"), "fedcba9876543210", _section(), offloaded=False)


# -- generate, bench and the app take tuned settings; flags override ----------------------------------------
def test_flags_override_tuned_settings_and_tuned_override_defaults(tiny, xdg):
    info = tiny.info
    save_profile(with_tuned(_profile(info.fingerprint), info.fingerprint, _section(), offloaded=False), "dev")
    decoder = tiny
    parser = build_parser()
    args = parser.parse_args(["generate", "-p", "x", "--profile", "dev"])
    cfg = generation_config(args, decoder)
    assert (cfg.draft_topk, cfg.draft_max, cfg.threshold, cfg.reuse_strength, cfg.reuse_cap) == (2, 12, 0.5, 0.25, 6)
    assert cfg.lookup is False  # tuned off
    args = parser.parse_args(
        [
            "generate",
            "-p",
            "x",
            "--profile",
            "dev",
            "--draft-max",
            "8",
            "--threshold",
            "1",
            "--reuse-strength",
            "0",
            "--draft-topk",
            "1",
            "--reuse-cap",
            "5",
        ]
    )
    cfg = generation_config(args, decoder)
    assert (cfg.draft_topk, cfg.draft_max, cfg.threshold, cfg.reuse_strength, cfg.reuse_cap) == (1, 8, 1.0, 0.0, 5)
    # the memory strength: the flag, else the tuned value of the condition decoding runs in, else 0.3
    save_profile(
        with_tuned(load_profile("dev"), info.fingerprint, _section(memory_strength=0.15), offloaded=True), "dev"
    )
    assert (
        resolve_tuned(
            parser.parse_args(["generate", "-p", "x"]),
            tuned_settings(load_profile("dev"), info.fingerprint, offloaded=True),
        )["memory_strength"]
        == 0.15
    )
    assert generation_config(args, decoder).memory_strength == 0.3  # resident: the resident tuning has none
    flagged = parser.parse_args(["generate", "-p", "x", "--memory-strength", "0.5"])
    assert resolve_tuned(flagged, {"memory_strength": 0.15})["memory_strength"] == 0.5
    # no profile: the model's defaults, as before tuning existed
    cfg = generation_config(parser.parse_args(["generate", "-p", "x"]), decoder).resolved(info)
    assert (cfg.draft_topk, cfg.draft_max, cfg.threshold, cfg.reuse_strength, cfg.reuse_cap) == (1, 8, 1.0, 0.5, 7)
    assert cfg.lookup is True
    assert generation_config(parser.parse_args(["generate", "-p", "x", "--no-lookup"]), decoder).lookup is False
    # bench resolves the same way
    bench = parser.parse_args(["bench", "--profile", "dev", "--draft-max", "4"])
    assert resolve_tuned(bench, _section()["settings"])["draft_max"] == 4
    assert resolve_tuned(bench, _section()["settings"])["threshold"] == 0.5


def test_generate_says_which_tuned_settings_it_decodes_with(tiny_models, xdg, capsys):
    model = str(tiny_models["olmoe"])
    info = read_model_info(model)
    save_profile(with_tuned(_profile(info.fingerprint), info.fingerprint, _section(), offloaded=False), "dev")
    assert main(["generate", "-m", model, "-p", "hello", "-n", "4", "--profile", "dev", "--draft-max", "4"]) == 0
    err = capsys.readouterr().err
    assert (
        "settings (profile dev's tuned ones where no flag is given): k_d 2, draft cap 4, threshold 0.5, "
        "α 0.25, |E*| 6, copies off"
    ) in err
    # no tuned section for the model: nothing to say
    save_profile(_profile(info.fingerprint), "plain")
    assert main(["generate", "-m", model, "-p", "hello", "-n", "4", "--profile", "plain"]) == 0
    assert "tuned ones" not in capsys.readouterr().err


def test_generate_takes_the_app_s_active_profile_unless_told_otherwise(tiny_models, xdg, capsys):
    from s2moe.app.tui.state import remember_profile

    model = str(tiny_models["olmoe"])
    info = read_model_info(model)
    save_profile(with_tuned(_profile(info.fingerprint), info.fingerprint, _section(), offloaded=False), "dev")
    argv = ["generate", "-m", model, "-p", "hello", "-n", "4", "--draft-max", "4"]
    # no active profile: nothing to say, the constants measured at start-up
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "profile" not in err.split("cost constants")[0] and "cost constants (measured at start-up)" in err
    remember_profile("dev")  # as the app's Profiles screen does
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        "profile dev: the app's active one (--profile none: no profile, the constants measured at start-up)"
    )
    assert any(line.startswith("settings (profile dev's tuned ones") for line in err)
    assert any(line.startswith("cost constants (profile:dev)") for line in err)
    # --profile none: as before there was an app, and not a word about it
    assert main(argv + ["--profile", "none"]) == 0
    err = capsys.readouterr().err
    assert "profile dev" not in err and "cost constants (measured at start-up)" in err
    # --json says nothing on stderr of the profile, and still decodes with it
    assert main(argv + ["--json"]) == 0
    said = capsys.readouterr()
    assert "profile" not in said.err and json.loads(said.out)["n_tokens"] == 4
    # an active profile without this model's constants is not used, and that is said
    save_profile(_profile("0123456789abcdef"), "other")
    remember_profile("other")
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert (
        "profile: none — the app's active profile other has no constants for olmoe.gguf, so they are measured "
        "at start-up"
    ) in err and "cost constants (measured at start-up)" in err


def test_the_app_session_takes_tuned_settings(tiny_models, xdg):
    from s2moe.app.tui.chat_settings import DEFAULTS, ChatSettings
    from s2moe.app.tui.session import EngineSession
    from s2moe.engine.decoding.generation_config import GenerationConfig

    assert all(getattr(GenerationConfig(), k) == v for k, v in DEFAULTS.items())

    info = read_model_info(tiny_models["olmoe"])
    save_profile(with_tuned(_profile(info.fingerprint), info.fingerprint, _section(), offloaded=False), "dev")
    session = EngineSession(str(tiny_models["olmoe"]), profile="dev", n_threads=1)
    try:
        session.load()
        cfg = session.config(ChatSettings())
        assert (cfg.draft_topk, cfg.draft_max, cfg.threshold, cfg.reuse_strength, cfg.lookup) == (
            2,
            12,
            0.5,
            0.25,
            False,
        )
        assert "copies off" in ChatSettings().describe(session.model, session.tuned())
        assert session.config(ChatSettings(lookup=True)).lookup is True
        cfg = session.config(ChatSettings(draft_max=4, reuse_strength=1.0, threshold=2.0, draft_topk=1))
        assert (cfg.draft_topk, cfg.draft_max, cfg.threshold, cfg.reuse_strength) == (1, 4, 2.0, 1.0)
        cfg = session.config(ChatSettings(gating=False))
        assert cfg.reuse_strength == 0.0 and cfg.reuse_cap == 6
        assert session.config(ChatSettings()).memory_strength == 0.3
        assert session.config(ChatSettings(memory_strength=0.1)).memory_strength == 0.1
        assert "memory" not in ChatSettings().describe(session.model, session.tuned())
        assert "gating 0.25 (lossy) · memory 0.3" in ChatSettings().describe(
            session.model, session.tuned(), budgeted=True
        )
        session.profile_name = None
        cfg = session.config(ChatSettings())
        assert (cfg.draft_max, cfg.threshold, cfg.reuse_strength, cfg.reuse_cap, cfg.lookup) == (
            8,
            1.0,
            0.5,
            None,
            True,
        )
    finally:
        session.close()


# -- the command ----------------------------------------------------------------------------------------------
def test_cli_tune_writes_the_profile_and_refuses_bad_input(tiny_models, xdg, capsys, tmp_path):
    model = str(tiny_models["olmoe"])
    assert main(["tune", "-m", model, "--profile", "dev", "--time-budget", "0"]) == 2
    assert "--time-budget" in capsys.readouterr().err
    assert main(["tune", "-m", model, "--profile", "dev"]) == 2
    assert "no profile named 'dev'" in capsys.readouterr().err
    info = read_model_info(model)
    save_profile(_profile("fedcba9876543210"), "dev")
    assert main(["tune", "-m", model, "--profile", "dev"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "s2moe calibrate" in err
    assert main(["tune", "-m", str(tiny_models["llama"]), "--profile", "dev"]) == 2
    assert "dense" in capsys.readouterr().err
    prof = _profile(info.fingerprint)
    prof["models"]["fedcba9876543210"] = _profile("x")["models"]["x"]
    save_profile(prof, "dev")
    before = (xdg / "dev.yaml").read_text()
    assert (
        main(
            [
                "tune",
                "-m",
                model,
                "--profile",
                "dev",
                "--prompts",
                "natural",
                "--n-prompts",
                "4",
                "-n",
                "8",
                "--time-budget",
                "0.5",
                "-t",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "defaults:" in out and "tuned:" in out and f"profile written: {xdg / 'dev.yaml'}" in out
    data = yaml.safe_load((xdg / "dev.yaml").read_text())
    assert (xdg / "dev.yaml").read_text() != before
    section = data["models"][info.fingerprint]["tuned"]["resident"]
    assert section["search"]["method"] == "successive halving" and section["log"]
    assert section["speed"]["defaults_tok_s"] > 0 and section["measured"]["by"] == "s2moe tune"
    assert "fedcba9876543210" in data["models"]  # the other model's block is kept
    assert not list(xdg.glob(".*.tmp"))
    assert "copy_cache_generations" not in section["measured"]
    # with the generations a copy cache keeps: measured as a session that has them, and the cache left as it was
    cache = tmp_path / "copies.json"
    assert (
        main(["generate", "-m", model, "-p", "def add(a, b):", "-n", "8", "-t", "1", "--copy-cache", str(cache)]) == 0
    )
    kept = cache.read_text()
    assert (
        main(
            [
                "tune",
                "-m",
                model,
                "--profile",
                "dev",
                "--prompts",
                "natural",
                "--n-prompts",
                "4",
                "-n",
                "8",
                "--time-budget",
                "0.5",
                "-t",
                "1",
                "--copy-cache",
                str(cache),
            ]
        )
        == 0
    )
    assert "s2moe also copies from the 1 earlier generation kept in" in capsys.readouterr().err
    assert cache.read_text() == kept
    data = yaml.safe_load((xdg / "dev.yaml").read_text())
    assert data["models"][info.fingerprint]["tuned"]["resident"]["measured"]["copy_cache_generations"] == 1
    broken = tmp_path / "broken.json"
    broken.write_text("[]")
    assert main(["tune", "-m", model, "--profile", "dev", "--time-budget", "0.5", "--copy-cache", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "copy cache" in err


@pytest.mark.parametrize("moment", ["before", "after"])
def test_ctrl_c_as_tune_renames_the_profile_says_whether_it_was_written(tiny_models, xdg, capsys, monkeypatch, moment):
    """A real SIGINT raised just before or just after the rename that puts the new profile in place: either way
    the write, once begun, completes, and the run says so beside "interrupted" (exit code 130)."""
    import os
    import signal

    import s2moe.engine.measure.tune as tune

    model = str(tiny_models["olmoe"])
    info = read_model_info(model)
    save_profile(_profile(info.fingerprint), "dev")
    section = {
        **_section(),
        "search": {
            "method": "successive halving",
            "candidates": 2,
            "pool": 2,
            "feasible": 2,
            "rungs": 1,
            "runs": 2,
            "seconds": 1.0,
            "time_budget_s": 60.0,
        },
    }
    section["speed"]["verdict"] = "tuned"

    def searched(decoder, prompts, **kw):
        settings = Settings(**section["settings"])
        yield TuneDone(section, settings, settings)

    real_replace = os.replace

    def replace_signalled(src, dst):
        if str(dst).endswith("dev.yaml") and moment == "before":
            signal.raise_signal(signal.SIGINT)
        real_replace(src, dst)
        if str(dst).endswith("dev.yaml") and moment == "after":
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(tune, "run_tune", searched)
    monkeypatch.setattr(os, "replace", replace_signalled)
    assert main(["tune", "-m", model, "--profile", "dev", "--prompts", "natural", "--n-prompts", "1", "-t", "1"]) == 130
    err = capsys.readouterr().err.splitlines()
    assert err[-2:] == [f"profile written: {xdg / 'dev.yaml'}", "interrupted"], err
    assert load_profile("dev")["models"][info.fingerprint]["tuned"]["resident"]["settings"] == section["settings"]
    # a Ctrl-C before the write begins: nothing written, and said
    import s2moe.engine.profiles as profiles

    before = (xdg / "dev.yaml").read_bytes()
    real_with_tuned = profiles.with_tuned

    def with_tuned_signalled(*args, **kw):
        signal.raise_signal(signal.SIGINT)
        return real_with_tuned(*args, **kw)

    monkeypatch.setattr(profiles, "with_tuned", with_tuned_signalled)
    assert main(["tune", "-m", model, "--profile", "dev", "--prompts", "natural", "--n-prompts", "1", "-t", "1"]) == 130
    assert capsys.readouterr().err.splitlines()[-2:] == ["profile dev left as it was", "interrupted"]
    assert (xdg / "dev.yaml").read_bytes() == before
