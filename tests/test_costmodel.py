"""Cost model fit and device-profile constants."""

from __future__ import annotations

import numpy as np
import pytest
from s2moe.engine.errors import ConfigError
from s2moe.engine.measure.cost_fits import fit_verify_cost
from s2moe.engine.measure.costmodel import measure_cost_constants
from s2moe.engine.profiles import cost_for_model, load_profile


def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    experts = rng.integers(8, 200, size=60)
    tokens = rng.integers(1, 10, size=60)
    seconds = 0.002 + 1.5e-4 * experts + 3e-3 * tokens + rng.normal(0, 1e-5, size=60)
    fit = fit_verify_cost(experts, tokens, seconds)
    assert fit.intercept == pytest.approx(0.002, abs=2e-4)
    assert fit.t_exp == pytest.approx(1.5e-4, rel=0.02)
    assert fit.t_tok == pytest.approx(3e-3, rel=0.02)
    assert fit.r2 > 0.99 and fit.mape < 0.01


def test_fit_never_returns_negative_slopes():
    experts = np.array([10, 20, 30, 40, 50])
    tokens = np.array([1, 2, 3, 4, 5])
    seconds = np.array([5.0, 4.0, 3.0, 2.0, 1.0])  # faster with more work: noise, not physics
    fit = fit_verify_cost(experts, tokens, seconds)
    assert fit.t_exp >= 0 and fit.t_tok >= 0


def test_start_up_measurement_leaves_the_cache_empty(decoders):
    rt = decoders["olmoe"].rt
    cost, samples = measure_cost_constants(rt, k_draft=2, cap=4, repeats=1)
    assert rt.kv_end() == 0
    assert cost.t_ar > 0 and cost.c_draft > 0 and cost.source == "measured at start-up"
    assert len(samples) >= 9 and all(s[0] > 0 for s in samples)
    sizes = {s[1] for s in samples}
    assert min(sizes) == 1 and max(sizes) == 5


def test_profile_constants_are_keyed_by_model_fingerprint(tmp_path):
    p = tmp_path / "dev.yaml"
    p.write_text(
        "name: dev\nmodels:\n  abc123:\n    t_ar_ms: 10\n    c_draft_ms: 7.5\n    t_exp_ms: 0.2\n    t_tok_ms: 1\n"
    )
    prof = load_profile(str(p))
    c = cost_for_model(prof, "abc123")
    assert c.t_ar == pytest.approx(0.010) and c.t_exp == pytest.approx(2e-4) and c.source == "profile:dev"
    with pytest.raises(ConfigError, match="not calibrated for this model"):
        cost_for_model(prof, "other")


@pytest.mark.parametrize(
    "body,needle",
    [
        ("models:\n  fp:\n    c_draft_ms: 1\n    t_exp_ms: 1\n", "missing field t_ar_ms"),
        ("models:\n  fp:\n    t_ar_ms: fast\n    c_draft_ms: 1\n    t_exp_ms: 1\n", "t_ar_ms"),
        ("models:\n  fp:\n    t_ar_ms: 1\n    c_draft_ms: -1\n    t_exp_ms: 1\n", "c_draft_ms"),
        ("- just\n- a list\n", "mapping"),
    ],
)
def test_bad_profiles_name_the_failing_field(tmp_path, body, needle):
    p = tmp_path / "bad.yaml"
    p.write_text(body)
    with pytest.raises(ConfigError, match=needle):
        cost_for_model(load_profile(str(p)), "fp")


def test_the_r2_ceiling_is_what_the_same_counts_timed_again_leave_unexplained():
    from s2moe.engine.measure.cost_fits import r2_ceiling, r2_text

    rng = np.random.default_rng(1)
    experts = np.repeat(rng.integers(8, 200, size=20), 3)  # 20 batches, each timed three times
    tokens = np.repeat(rng.integers(1, 10, size=20), 3)
    signal = 0.002 + 1.5e-4 * experts + 3e-3 * tokens
    seconds = signal + rng.normal(0, 2e-3, size=60)
    ceiling = r2_ceiling(zip(experts, tokens), seconds)
    means = np.array([seconds[i - i % 3 : i - i % 3 + 3].mean() for i in range(60)])
    expected = 1 - np.sum((seconds - means) ** 2) / np.sum((seconds - seconds.mean()) ** 2)
    assert ceiling == pytest.approx(expected) and 0.5 < ceiling < 0.99
    # the linear fit is one model of these counts: it cannot explain more than the group means do
    fit = fit_verify_cost(experts, tokens, seconds)
    assert fit.r2_ceiling == pytest.approx(ceiling) and fit.r2 <= ceiling
    assert "≤ " + f"{ceiling:.3f}" in r2_text(fit.r2, fit.r2_ceiling)
    # counts nobody timed twice say nothing of the spread: no ceiling, and the text says only R²
    assert r2_ceiling(zip(range(60), tokens), seconds) is None
    assert r2_text(0.5, None) == "R² 0.500"
    # under a budget the fetched experts are part of the counts
    from s2moe.engine.measure.cost_fits import fit_miss_cost

    misses = experts // 2
    assert fit_miss_cost(experts, misses, tokens, seconds).r2_ceiling == pytest.approx(ceiling)


def test_a_fit_of_counts_bunched_far_from_zero_has_no_negative_fixed_cost():
    # the shortest start-up plan's samples on the 8.2 GB preset: one token's experts to a few more
    experts, tokens = [128, 139, 133, 145], [1, 2, 2, 9]
    seconds = [0.7606, 0.8585, 0.7877, 0.9653]
    unconstrained = np.linalg.lstsq(np.column_stack([np.ones(4), experts, tokens]), seconds, rcond=None)[0]
    assert unconstrained[0] < 0  # what an ordinary fit makes of them
    fit = fit_verify_cost(experts, tokens, seconds)
    assert fit.intercept == 0.0 and fit.t_exp > 0 and fit.t_tok > 0
    # through the origin: a plain step's 128 experts and one token make up its time
    assert fit.predict(128, 1) == pytest.approx(0.76, rel=0.05)
    # a fit that has a fixed cost keeps it
    assert fit_verify_cost([10, 20, 30, 40], [1, 2, 1, 2], [1.0 + 0.1 * x for x in (10, 20, 30, 40)]).intercept > 0


def test_a_slow_step_shortens_the_measurement_to_fit_its_time():
    from s2moe.engine.measure.costmodel import VARIANTS, SamplePlan, batch_sizes, sample_plan

    every = tuple((s, v) for s in batch_sizes(8) for v in VARIANTS)
    assert sample_plan(0.001, 8, 20.0) == SamplePlan(3, 12, 2, every)  # a resident small model: all of it
    assert sample_plan(0.15, 8, 20.0) == SamplePlan(2, 8, 2, every)  # a repeat is 54 steps' worth
    assert sample_plan(0.2, 8, 20.0) == SamplePlan(1, 4, 2, every)
    # two seconds a step (gigabytes of experts from storage): the shortest plan, whose only batch of many
    # tokens repeats one token (a random one would read most of the model's experts)
    short = sample_plan(2.0, 8, 20.0)
    assert short == SamplePlan.shortest(8) and (short.repeats, short.steps, short.warm) == (1, 2, 1)
    assert max(n for n, v in short.shapes if v == "random") == 2 and (9, "repeat") in short.shapes
    assert short.repeated_context and not SamplePlan.full(8).repeated_context


def test_a_short_measurement_still_fits_experts_apart_from_tokens(decoders):
    from s2moe.engine.measure.costmodel import iter_cost_constants

    rt = decoders["olmoe"].rt
    gen = iter_cost_constants(rt, 2, 4, seconds=1e-6)  # too short for anything: the shortest plan
    fractions = []
    while True:
        try:
            fractions.append(next(gen))
        except StopIteration as e:
            cost, samples = e.value
            break
    assert fractions == sorted(fractions) and 0 < fractions[0] and fractions[-1] == pytest.approx(1.0)
    assert sorted(s[1] for s in samples) == [1, 2, 2, 5]
    # experts vary with the tokens fixed (one random token against two) and tokens with the experts fixed
    one, two_random, two_same, five_same = sorted(samples, key=lambda s: (s[1], -s[0]))
    assert two_random[0] > one[0] and five_same[1] > two_same[1]
    # a token repeated routes alike at every position (its context is one token repeated too): one token's
    # experts, whatever the batch's length — what keeps the shortest plan's reads to a few tokens' experts
    one_token = rt.info.n_expert_used * rt.info.n_layer
    assert one[0] == two_same[0] == five_same[0] == one_token
    assert cost.t_exp > 0 and cost.t_ar > 0 and rt.kv_end() == 0


def test_a_measurement_under_a_budget_is_said_when_slow_and_remembered(tiny_models, monkeypatch):
    from s2moe.engine.decoding import cost_constants
    from s2moe.engine.decoding.decoder import Decoder
    from s2moe.engine.decoding.generation_config import GenerationConfig
    from s2moe.engine.events import MeasuringCosts, Started

    monkeypatch.setattr(cost_constants, "SLOW_MEASURE_S", 0.0)
    # whether a fit is good enough to keep is the next test's; on a busy machine this one's fit may not be
    monkeypatch.setattr(cost_constants, "REMEMBER_MIN_R2", float("-inf"))
    cfg = GenerationConfig(mode="s2moe", n_predict=2, stop_at_eos=False)

    def run(remember_as):
        dec = Decoder(str(tiny_models["olmoe"]), n_ctx=256, n_threads=1)
        try:
            dec.forget_cost_constants(remember_as=remember_as)
            events = list(dec.generate("hello", cfg))
        finally:
            dec.close()
        started = next(e for e in events if isinstance(e, Started))
        return [e for e in events if isinstance(e, MeasuringCosts)], started.cost

    said, cost = run("budget 64 MiB")
    assert said and cost.source == "measured at start-up"
    assert [e.fraction for e in said] == sorted(e.fraction for e in said)
    again, recalled = run("budget 64 MiB")
    assert not again and "remembered" in recalled.source
    assert (recalled.t_ar, recalled.t_exp, recalled.t_tok) == (cost.t_ar, cost.t_exp, cost.t_tok)
    other, fresh = run("budget 96 MiB")  # another budget is measured for itself
    assert other and fresh.source == "measured at start-up"
    resident, _ = run(None)  # resident runs are measured each time, and said as well once slow
    assert resident


def test_a_poor_fit_under_a_budget_is_not_remembered(tiny_models, monkeypatch):
    """A measurement spoilt by the machine's noise is measured again by the next run rather than kept."""
    from dataclasses import replace

    from s2moe.engine.decoding import cost_constants
    from s2moe.engine.decoding.decoder import Decoder
    from s2moe.engine.decoding.generation_config import GenerationConfig
    from s2moe.engine.events import Started
    from s2moe.engine.measure import costmodel

    real = costmodel.iter_cost_constants

    def poor(*args, **kwargs):
        cost, samples = yield from real(*args, **kwargs)
        return replace(cost, r2=cost_constants.REMEMBER_MIN_R2 - 0.1), samples

    monkeypatch.setattr(cost_constants, "iter_cost_constants", poor)
    cfg = GenerationConfig(mode="s2moe", n_predict=2, stop_at_eos=False)
    for _ in range(2):
        dec = Decoder(str(tiny_models["olmoe"]), n_ctx=256, n_threads=1)
        try:
            dec.forget_cost_constants(remember_as="budget 64 MiB")
            started = next(e for e in list(dec.generate("hello", cfg)) if isinstance(e, Started))
        finally:
            dec.close()
        assert started.cost.source == "measured at start-up"  # measured both times: the first was not kept
