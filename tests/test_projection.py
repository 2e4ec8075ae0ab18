"""The projection's replay on a hand-made trace whose answers are known, and `s2moe project` end to end."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from s2moe.app.cli import main
from s2moe.engine.errors import ConfigError
from s2moe.engine.events import ForcedDraft
from s2moe.engine.measure.cache_model import ExpertCache
from s2moe.engine.measure.projection import project
from s2moe.engine.measure.trace import Drafted, Trace, TraceHeader, TraceStep, write_trace
from s2moe.engine.profile_schema import validate_profile

FP = "0123456789abcdef"
# two layers of four experts, top-2; one expert per layer in a draft pass
R0 = np.array([[0, 1], [0, 1]])
R1 = np.array([[0, 1], [2, 3]])
R2 = np.array([[2, 3], [2, 3]])


def header(**kw) -> TraceHeader:
    base = dict(
        model="hand",
        fingerprint=FP,
        n_layer=2,
        n_expert=4,
        k=2,
        k_d=1,
        expert_bytes=1000.0,
        non_expert_bytes=0,
        draft_max=2,
        n_predict=6,
        mode="s2moe",
        threshold=1.0,
        reuse_strength=0.0,
        conf_p_min=0.5,
        temperature=0.0,
        prompt_tokens=3,
    )
    return TraceHeader(**{**base, **kw})


def step(rows, tokens, prob=0.9) -> TraceStep:
    """Both drafted tokens accepted; each drafted token's predicted experts are its own verification row."""
    rows = np.stack(rows)
    drafted = tuple(Drafted(t, prob, prob ** (i + 1), rows[i + 1]) for i, t in enumerate(tokens[:2]))
    return TraceStep(tuple(tokens), 2, drafted, rows[0], rows, rows, 0.0, 0.0, ForcedDraft(True, 2))


def hand_trace(**kw) -> Trace:
    steps = [step([R0, R1, R2], (5, 6, 7)), step([R0, R0, R0], (8, 9, 10))]
    return Trace(header(**kw), steps, n_tokens=6, seconds=1.0, stop="length", name="hand")


def profile(t_ar_ms=10.0, c_draft_ms=2.0, t_tok_ms=3.0, t_exp_ms=1.0, hot=None) -> dict:
    block = {
        "t_ar_ms": t_ar_ms,
        "c_draft_ms": c_draft_ms,
        "t_exp_ms": t_exp_ms,
        "t_tok_ms": t_tok_ms,
        "intercept_ms": 0.0,
        "fit": {"intercept_ms": 0.0, "t_exp_ms": t_exp_ms, "t_tok_ms": t_tok_ms},
        "fit_cold_misses": {"t_exp_warm_ms": 1.0, "t_exp_cold_ms": 5.0},
        "expert_bytes": 1000,
    }
    if hot:
        block["hot_experts"] = hot
    return {"name": "hand", "kind": "measured", "device": {"storage_bandwidth_gb_s": 1.0}, "models": {FP: block}}


def test_plain_decoding_costs_one_plain_step_per_token():
    p = project([hand_trace()], profile(), modes=["ar"])
    ar = p.modes["ar"]
    assert (ar.tokens, ar.iterations, ar.draft_passes, ar.fetched) == (6, 6, 0, 0)
    assert ar.seconds == pytest.approx(6 * 10e-3)
    assert ar.tok_per_s == pytest.approx(100.0)


def test_a_rule_that_keeps_everything_verifies_the_whole_chain():
    # conf at p_min 0.5 keeps every token of probability 0.9: two draft passes (the last token is not
    # routed), a verification of three tokens, three tokens committed, per iteration
    p = project([hand_trace()], profile(), modes=["conf"])
    c = p.modes["conf"]
    assert (c.tokens, c.iterations, c.drafted, c.accepted, c.draft_passes) == (6, 2, 4, 4, 4)
    # first verification: 8 distinct experts, 4 more than one token's; the second: none more
    assert c.t_verify == pytest.approx((10 + 2 * 3 + 4 * 1) * 1e-3 + (10 + 2 * 3) * 1e-3)
    assert c.t_draft == pytest.approx(4 * 2e-3)
    assert c.speedup == pytest.approx((6 / c.seconds) / 100.0)


def test_the_utility_rule_at_threshold_zero_keeps_everything_and_routes_every_token():
    p = project([hand_trace()], profile(), modes=["s2moe"], threshold=0.0)
    s = p.modes["s2moe"]
    assert (s.tokens, s.iterations, s.drafted, s.draft_passes) == (6, 2, 4, 6)


def test_constants_that_forbid_drafting_make_s2moe_plain_decoding():
    # a certain token saves T_AR 1 ms but costs C_draft 2 + T_tok 3 ms: the rule never drafts
    p = project([hand_trace()], profile(t_ar_ms=1.0), modes=["ar", "s2moe"])
    ar, s = p.modes["ar"], p.modes["s2moe"]
    assert (s.tokens, s.iterations, s.draft_passes, s.drafted) == (6, 6, 0, 0)
    assert s.seconds == pytest.approx(ar.seconds) and s.speedup == pytest.approx(1.0)


def test_a_cache_of_nothing_fetches_every_expert_every_time():
    # 1 MiB: below the plan's slack, so no room for an expert cache; nothing pinned
    p = project([hand_trace()], profile(), budget="1M", modes=["ar"])
    ar = p.modes["ar"]
    assert ar.fetched == 6 * 4  # four experts per token (two layers, top-2)
    assert ar.t_fetch == pytest.approx(24 * 4e-3)  # cold − warm: 5 − 1 ms


def test_a_cache_of_everything_fetches_each_expert_once():
    p = project([hand_trace()], profile(), budget="1G", modes=["ar", "conf"])
    assert p.modes["ar"].fetched == 8  # every expert of both layers, once
    assert p.modes["conf"].fetched == 8


def test_a_fetch_cost_from_a_fit_that_explains_little_gives_way_to_the_storage_bandwidth():
    weak = profile()
    weak["models"][FP]["fit_cold_misses"]["r2"] = 0.3
    p = project([hand_trace()], weak, budget="1M", modes=["ar"])
    assert p.modes["ar"].t_fetch == pytest.approx(24 * 1000 / 1e9)  # 1000-byte experts at 1 GB/s
    assert "R² 0.30" in p.basis
    weak["device"]["storage_bandwidth_qd8_gb_s"] = 2.0  # what the offloader's reads of a layer's experts get
    assert project([hand_trace()], weak, budget="1M", modes=["ar"]).modes["ar"].t_fetch == pytest.approx(24 * 500 / 1e9)
    # the rates the profile measured on this model's own experts win over the device's (another model's reads)
    weak["models"][FP].update(storage_bandwidth_gb_s=2.0, storage_bandwidth_qd8_gb_s=4.0)
    assert project([hand_trace()], weak, budget="1M", modes=["ar"]).modes["ar"].t_fetch == pytest.approx(24 * 250 / 1e9)
    weak["models"][FP]["fit_cold_misses"]["r2"] = 0.9
    assert project([hand_trace()], weak, budget="1M", modes=["ar"]).modes["ar"].t_fetch == pytest.approx(24 * 4e-3)


def test_a_fetch_costs_what_plain_decoding_under_the_budget_paid_for_one():
    """Where calibrate timed plain decoding under its budget, a fetch costs that decoding's mean step beyond the
    resident step over its fetches a token; it wins over a fit under the budget and over the storage bandwidth."""
    paid = profile()
    paid["models"][FP]["cache_fit"] = {
        "planned_experts": 10,
        "effective_experts": 5,
        "tokens": 80,
        "fetched_per_token": 4.0,
        "pinned": 0,
        "step_ms": 50.0,
    }
    p = project([hand_trace()], paid, budget="1M", modes=["ar"])
    assert p.modes["ar"].t_fetch == pytest.approx(24 * (50.0 - 10.0) / 4.0 * 1e-3)
    assert "10.00 ms, what plain decoding under the profile's budget paid per fetch" in p.basis
    # a decoding that fetched nothing prices nothing: the fit under the budget does (cold − warm)
    paid["models"][FP]["cache_fit"]["fetched_per_token"] = 0.0
    assert project([hand_trace()], paid, budget="1M", modes=["ar"]).modes["ar"].t_fetch == pytest.approx(24 * 4e-3)
    # a step no slower than the resident one: fetches paid nothing beyond it
    paid["models"][FP]["cache_fit"].update(fetched_per_token=4.0, step_ms=8.0)
    assert project([hand_trace()], paid, budget="1M", modes=["ar"]).modes["ar"].t_fetch == 0.0
    bad = profile()
    bad["models"][FP]["cache_fit"] = dict(paid["models"][FP]["cache_fit"], step_ms=0)
    with pytest.raises(ConfigError, match="step_ms must be a positive number"):
        validate_profile(bad)


def test_a_fetch_is_priced_on_the_disk_the_traces_run_read_when_asked():
    """The same device on another day: calibrate's price of a fetch scales with its depth-8 rate over the one
    bench read around the traces' budget."""
    ran = {"auto": False, "budget_bytes": 1 << 20, "hot_bytes": 0, "cache_bytes": 0, "pinned": []}
    read = dict(ran, storage={"qd1_gb_s": 0.5, "qd8_gb_s": 0.5, "readings": 6})
    prof = profile()
    prof["models"][FP].update(storage_bandwidth_gb_s=1.0, storage_bandwidth_qd8_gb_s=2.0)
    as_calibrated = project([hand_trace().with_budget(read)], prof, budget="1M", modes=["ar"])
    assert as_calibrated.modes["ar"].t_fetch == pytest.approx(24 * 4e-3)  # cold − warm, as calibrate read the disk
    slower = project([hand_trace().with_budget(read)], prof, budget="1M", modes=["ar"], disk="trace")
    assert slower.modes["ar"].t_fetch == pytest.approx(24 * 4e-3 * 2.0 / 0.5)
    assert slower.modes["ar"].tok_per_s < as_calibrated.modes["ar"].tok_per_s
    assert "0.50 GB/s at depth 8 against the profile's 2.00 (×4.00)" in slower.basis
    # several traces: the median of their readings
    faster = hand_trace().with_budget(dict(read, storage={"qd1_gb_s": 1.0, "qd8_gb_s": 4.0, "readings": 6}))
    both = project([hand_trace().with_budget(read), faster, faster], prof, budget="1M", modes=["ar"], disk="trace")
    assert both.modes["ar"].t_fetch == pytest.approx(3 * 24 * 4e-3 * 2.0 / 4.0)
    with pytest.raises(ConfigError, match="carries no reading of its disk"):
        project([hand_trace().with_budget(ran)], prof, budget="1M", modes=["ar"], disk="trace")
    # a profile of another model (its reference constants) is another device: the traces' disk says nothing
    other = dict(prof, models={}, reference={**prof["models"][FP], "t_exp_cold_ms": 5.0})
    with pytest.raises(ConfigError, match="not calibrated for model hand"):
        project([hand_trace().with_budget(read)], other, budget="1M", modes=["ar"], disk="trace")
    with pytest.raises(ConfigError, match="unknown disk"):
        project([hand_trace().with_budget(read)], prof, budget="1M", modes=["ar"], disk="today")


def test_pinned_hot_experts_are_never_fetched():
    hot = [[0, 0], [0, 1], [1, 0], [1, 1]]
    p = project([hand_trace()], profile(hot=hot), budget="1G", modes=["ar"])
    assert p.modes["ar"].fetched == 4  # experts 2 and 3 of each layer
    assert "4 hot experts pinned" in p.budget


def test_the_lru_evicts_the_least_recently_used():
    cache = ExpertCache(4, capacity=2)
    one = lambda layer, e: np.array([[e, -1]] if layer == 0 else [[-1, -1], [e, -1]])  # noqa: E731
    assert cache.access(one(0, 0)) == 1
    assert cache.access(one(0, 1)) == 1
    assert cache.access(one(0, 0)) == 0  # 0 is now the most recent
    assert cache.access(one(0, 2)) == 1  # evicts 1
    assert cache.access(one(0, 0)) == 0
    assert cache.access(one(0, 1)) == 1
    assert cache.access(one(1, 0)) == 1  # another layer, another expert


def test_project_cli_prints_a_labelled_table_and_json(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "config"
    (cfg / "s2moe" / "profiles").mkdir(parents=True)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(cfg))
    import yaml

    (cfg / "s2moe" / "profiles" / "hand.yaml").write_text(yaml.safe_dump(profile()))
    write_trace(tmp_path / "a.jsonl", hand_trace())
    assert main(["project", str(tmp_path), "--profile", "hand"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PROJECTION (not a measurement)") and "s2moe" in out and "cascade" in out
    assert all(len(line) <= 80 for line in out.splitlines()[2:])
    assert main(["project", str(tmp_path / "a.jsonl"), "--profile", "hand", "--modes", "ar", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["modes"]["ar"]["tok_per_s"] == pytest.approx(100.0)
    assert main(["project", str(tmp_path / "a.jsonl"), "--profile", "hand", "--modes", "naive"]) == 2
    capsys.readouterr()
    # a trace generate recorded carries no reading of the disk to price fetches on
    assert main(["project", str(tmp_path / "a.jsonl"), "--profile", "hand", "--disk", "trace"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "carries no reading of its disk" in err


def test_measured_rows_are_those_of_the_budget_projected(tmp_path):
    from s2moe.app.cmd_project import measured_rows

    rows = [
        {"mode": "ar", "budget": b, "tok_per_s": v}
        for b, v in [("none", 100.0), ("350.0 MiB", 13.0), ("auto (483.0 MiB)", 30.0), ("1.0 GiB", 50.0)]
    ]
    rows.append({"mode": "llama.cpp", "budget": "350.0 MiB", "tok_per_s": 1.0})
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"results": rows}))
    assert [measured_rows(str(path), b) for b in (None, "350M", "auto", "1G", "200M")] == [
        {"ar": 100.0},
        {"ar": 13.0},
        {"ar": 30.0},
        {"ar": 50.0},
        {},
    ]


def test_the_bench_screen_projects_its_traces_onto_a_profile_by_keyboard(tiny_models, tmp_path, monkeypatch):
    """Bench on a tiny model records a trace per prompt; Ctrl+F projects them; arrows pick the profile, b the budget."""
    import asyncio
    import time

    from s2moe.app.tui.app import S2MoEApp
    from s2moe.app.tui.projection import ProjectionPlot, ProjectionScreen

    async def wait_for(pilot, cond, timeout, what):
        t0 = time.monotonic()
        while not cond():
            assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
            await pilot.pause(0.05)

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # the shipped profiles only

    async def go():
        app = S2MoEApp(str(tiny_models["olmoe"]), n_threads=1, n_ctx=256)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.session.model is not None, 60, "model")
            await pilot.press("f5")
            bench = app.screen
            bench.query_one("#bench-prompts").text = "hello there\nonce upon a time"
            bench.query_one("#bench-n").value = "8"
            bench.query_one("#bench-repeats").value = "2"
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: bench.done is not None and not bench.running, 180, "bench")
            assert len(bench.traces) == 2
            await pilot.press("ctrl+f")
            await wait_for(pilot, lambda: isinstance(app.screen, ProjectionScreen), 10, "projection screen")
            screen = app.screen
            profiles = list(screen.profiles)
            # a profile with constants for any model: the projection shows every mode
            await wait_for(pilot, lambda: screen.current is not None, 10, "a profile")
            for _ in range(profiles.index("jetson-orin-16gb") - profiles.index(screen.current)):
                await pilot.press("down")
            await pilot.pause()
            assert screen.current == "jetson-orin-16gb"
            table = str(screen.query_one("#projection-table").render())
            assert all(m in table for m in ("ar", "s2moe", "conf", "cascade")) and "all resident" in table
            assert "beyond the constants: none" in table  # a reference profile has no workload terms
            await pilot.press("b")
            await pilot.pause()
            assert screen.budget == "auto" and "cache of" in str(screen.query_one("#projection-table").render())
            title = str(screen.query_one("#projection-title").render())
            assert "PROJECTION" in title and "× 2 repeats" in title  # replayed as the bench ran them
            assert screen.query_one(ProjectionPlot).plt is not None
            await pilot.press("escape")
            await pilot.pause()
            assert app.screen is bench

    asyncio.run(go())


def test_belady_s_rule_evicts_what_is_read_furthest_ahead():
    """The textbook sequence: with room for two, LRU misses every read; evicting the expert read furthest ahead
    misses six of eight."""
    from s2moe.engine.measure.cache_model import CachePlan, with_cache

    reads = [np.array([[e]]) for e in (0, 1, 2, 0, 1, 3, 0, 1)]  # one layer, one expert per read

    def misses(cache):
        return [cache.access(r) for r in reads]

    plan = CachePlan(2, (), "two")
    assert with_cache(misses, plan, 8, "lru") == [1] * 8
    assert with_cache(misses, plan, 8, "opt") == [1, 1, 1, 0, 1, 1, 0, 1]
    with pytest.raises(ValueError, match="reads to come"):
        ExpertCache(8, 2, policy="opt")


def test_no_eviction_order_fetches_less_than_belady_s():
    from s2moe.engine.measure.cache_model import CachePlan, with_cache

    rng = np.random.default_rng(7)
    for trial in range(20):
        reads = [rng.integers(-1, 16, size=(int(rng.integers(1, 4)), 3, 2)) for _ in range(40)]
        plan = CachePlan(int(rng.integers(1, 12)), ((0, 1), (2, 3)), "random")
        fetched = {
            policy: with_cache(lambda c, reads=reads: sum(c.access(r) for r in reads), plan, 16, policy)
            for policy in ("lru", "fifo", "opt")
        }
        assert fetched["opt"] <= min(fetched["lru"], fetched["fifo"]), (trial, fetched)
    # a layer's own experts stay while it reads them, even beyond the cache's size: the next layer evicts them
    cache = ExpertCache(4, capacity=1)
    assert cache.access(np.array([[0, 1]])) == 2 and list(cache.held) == [0, 1]
    assert cache.access(np.array([[2, -1]])) == 1 and list(cache.held) == [2]


def test_the_oracle_drafts_exactly_what_the_target_accepts():
    """Step one's target accepts one of its two drafted tokens, step two's both; the third step has no room left
    to draft. The oracle verifies one, then two, then none: nothing it drafts is rejected."""
    from dataclasses import replace

    first = replace(step([R0, R1, R2], (5, 6)), accepted=1)
    tr = replace(hand_trace(), steps=[first, step([R0, R0, R0], (8, 9, 10)), step([R2, R2, R2], (11, 12, 13))])
    o = project([tr], profile(), modes=["oracle"]).modes["oracle"]
    assert (o.tokens, o.iterations, o.drafted, o.accepted) == (6, 3, 3, 3)
    assert o.draft_passes == 1 + 2  # the pending token's pass, and one for each drafted token but the last
    conf = project([tr], profile(), modes=["conf"]).modes["conf"]
    assert conf.drafted > conf.accepted  # a rule that cannot see ahead verifies what the target rejects


def test_the_oracle_copies_as_s2moe_does_and_cuts_each_copy_where_the_target_rejects_it():
    """s2moe drafts copies from the context where it finds them: the oracle, the best any stopping rule could do
    with s2moe's drafter, copies wherever the first copied token would be accepted, only as far as the target
    accepts, and drafts from the recorded chain elsewhere (here plain steps, which draft nothing). After the
    prompt 5 6 7 5 the generation 6 7 8 9 10 11 repeats "5 6 7": s2moe copies "7 5" after "5 6", of which the
    target accepts "7"; the oracle copies "7" alone. Without copies the oracle drafts nothing here."""
    generated = [6, 7, 8, 9, 10, 11]
    steps = [TraceStep((t,), 0, (), None, R0[None], R0[None], 0.0, 0.0) for t in generated]
    tr = Trace(
        header(draft_max=3, n_predict=len(generated), prompt_tokens=4, prompt=(5, 6, 7, 5)),
        steps,
        n_tokens=len(generated),
        seconds=1.0,
        name="repeats",
    )
    p = project([tr], profile(c_draft_ms=50.0, t_tok_ms=2.5), modes=["s2moe", "oracle"])
    s, o = p.modes["s2moe"], p.modes["oracle"]
    assert (s.copied, s.copies_accepted) == (2, 1)
    assert (o.copied, o.copies_accepted) == (1, 1)
    assert o.drafted == o.accepted and o.tokens == s.tokens
    plain = project([tr], profile(c_draft_ms=50.0, t_tok_ms=2.5), modes=["oracle"], lookup=False).modes["oracle"]
    assert plain.copied == plain.drafted == 0 and plain.iterations == len(generated)


def test_perfect_drafts_verify_the_committed_tokens_a_batch_at_a_time_for_free():
    """Draft cap 2: the six committed tokens in two batches of three, no draft pass, nothing rejected; a
    batch costs a verification of its rows."""
    from dataclasses import replace

    first = replace(step([R0, R1, R2], (5, 6)), accepted=1)  # the recorded drafter's second token was rejected
    tr = replace(hand_trace(), steps=[first, step([R2, R0, R0], (8, 9, 10)), step([R0, R0, R0], (11, 12, 13))])
    p = project([tr], profile(), modes=["ar", "perfect"])
    f = p.modes["perfect"]
    assert (f.tokens, f.iterations, f.drafted, f.accepted, f.draft_passes) == (6, 2, 4, 4, 0)
    # the tokens' rows: R0 R1 (step one: pending and its accepted draft), R2 R0 R0 (step two), R0 (step three);
    # batches R0 R1 R2 (4 experts beyond one token's) and R0 R0 R0 (none)
    assert f.t_verify == pytest.approx((10 + 2 * 3 + 4 * 1) * 1e-3 + (10 + 2 * 3) * 1e-3)
    assert f.speedup == pytest.approx(60e-3 / f.seconds)


def test_a_trace_projected_at_the_budget_it_ran_under_brings_that_run_s_plan():
    ran = {"auto": False, "budget_bytes": 1 << 20, "hot_bytes": 2000, "cache_bytes": 3000, "pinned": [[0, 0], [1, 0]]}
    tr = hand_trace().with_budget(ran)
    p = project([tr], profile(), budget="1M", modes=["ar"])
    assert p.budget.startswith("1.0 MiB as recorded") and "2 hot experts pinned, cache of 3 experts" in p.budget
    # another size: the plan is modelled on that run's (here its budget was all slack: no room, nothing pinned)
    assert project([tr], profile(), budget="2M", modes=["ar"]).modes["ar"].fetched == 6 * 4


def test_another_budget_leaves_the_recorded_run_s_process_what_it_held():
    """A budget other than the recorded one gives the experts what that run's process would leave of it: the
    recorded room, plus the budget's growth less the slack's. Below the process and one layer's experts the
    process would not run, and the projection says so as decoding would."""
    from s2moe.engine.offload.budget import plan_slack

    b1 = 100 << 20
    ran = {"auto": False, "budget_bytes": b1, "hot_bytes": 0, "cache_bytes": 2000, "pinned": []}
    tr = hand_trace().with_budget(ran)
    assert "cache of 2 experts" in project([tr], profile(), budget=str(b1), modes=["ar"]).budget
    wider = project([tr], profile(), budget=str(b1 + 4000), modes=["ar"])
    grown = 2000 + 4000 - (plan_slack(b1 + 4000) - plan_slack(b1))
    assert f"cache of {grown // 1000} experts" in wider.budget and "as the recorded run did" in wider.budget
    assert wider.modes["ar"].fetched < project([tr], profile(), budget=str(b1), modes=["ar"]).modes["ar"].fetched
    # a cache smaller than a layer's k experts: decoding stages every layer there, which the price may not know
    assert "in stages" not in wider.budget
    assert "do not fit the cache" in project([tr], profile(), budget=str(b1 - 1000), modes=["ar"]).budget
    staged = profile()
    staged["models"][FP]["cache_fit"] = {
        "planned_experts": 1,
        "effective_experts": 1,
        "tokens": 8,
        "fetched_per_token": 1.0,
        "pinned": 0,
    }
    assert "do not fit" not in project([tr], staged, budget=str(b1 - 1000), modes=["ar"]).budget  # priced so
    with pytest.raises(ConfigError, match="give at least"):
        project([tr], profile(), budget=str(b1 - plan_slack(b1) - 1), modes=["ar"])
    # a trace recorded without a budget: what the profile's calibration under one held (its plan's pinned and
    # cached experts at its budget), else the process counts as nothing and the projection says so
    calibrated = profile()
    calibrated["models"][FP]["measured"] = {"budget_bytes": b1}
    calibrated["models"][FP]["cache_fit"] = {
        "planned_experts": 2,
        "effective_experts": 2,
        "tokens": 8,
        "fetched_per_token": 1.0,
        "pinned": 0,
    }
    assert project([hand_trace()], calibrated, budget=str(b1 + 4000), modes=["ar"]).budget == wider.budget.replace(
        "the recorded run", "the calibrated run"
    )
    assert "own memory not counted" in project([hand_trace()], profile(), budget=str(b1), modes=["ar"]).budget


def test_the_cache_model_is_checked_against_the_recording_s_own_fetches():
    """A trace recorded under a budget counts the experts its run fetched; the projection puts the same run's
    reads through the simulated cache beside that count, for each eviction policy."""
    from dataclasses import replace

    tr = hand_trace()
    # the recording's own count: a cache of nothing fetches every expert of every pass and verification
    steps = [
        replace(s, verify_misses=4 * 2 + (4 if i == 0 else 0), draft_misses=6 if i == 0 else 3)
        for i, s in enumerate(tr.steps)
    ]
    tr = replace(tr, steps=steps)
    p = project([tr], profile(), budget="1M", modes=["ar"])
    recorded = sum(s.verify_misses + s.draft_misses for s in steps)
    # passes: pending + two drafted tokens, each one expert in each of two layers; verification: the union
    simulated = 3 * 2 + 8 + 3 * 2 + 4
    assert p.cache_fit == {"lru": (recorded, simulated), "fifo": (recorded, simulated)}
    assert project([hand_trace()], profile(), budget="1M", modes=["ar"]).cache_fit == {}


def test_what_the_constants_leave_out_is_recovered_from_the_recording_s_timings():
    """Passes timed as the profile predicts plus 2 µs per row for each token of context past the calibration's,
    draft passes plus 0.1 ms of host time, the loop 0.05 ms per verified row: all three come back."""
    from dataclasses import replace

    from s2moe.engine.measure.replay_costs import CALIBRATION_CONTEXT, device_costs, recording_terms

    tr = hand_trace(prompt_tokens=101)
    costs = device_costs(profile(), tr.header, offloaded=False)
    per_row, host, loop = 2e-6, 1e-4, 5e-5
    steps, ctx = [], 100
    # a third iteration like the second, one whose loop took a second: the median does not move
    for s, extra, slow in zip(tr.steps + [tr.steps[1]] * 2, (4, 0, 0, 0), (loop, loop, 1.0, loop)):
        beyond = ctx - CALIBRATION_CONTEXT
        verify = costs.t_ar + 2 * costs.t_tok + extra * costs.t_exp + 3 * per_row * beyond
        draft = 3 * (costs.c_draft + host + per_row * beyond)
        steps.append(replace(s, t_verify=verify, t_draft=draft, t_host=3 * slow))
        ctx += 3
    terms = recording_terms([replace(tr, steps=steps)], costs)
    assert terms.ctx_step == terms.ctx_row == pytest.approx(per_row, rel=1e-6)
    assert terms.host_draft == pytest.approx(host, rel=1e-6)
    assert terms.host_row == pytest.approx(loop)
    assert "in-sample" in terms.how


# -- the profile's workload terms ----------------------------------------------------------------------------
WORKLOAD = {
    "context_tokens": 2,
    "t_plain_ms": 4.0,
    "ctx_plain_us": 1000.0,
    "t_draft_ms": 1.5,
    "ctx_draft_us": 500.0,
    "ctx_step_us": 2000.0,
    "ctx_row_us": 100.0,
    "host_draft_ms": 0.25,
    "host_row_ms": 0.5,
    "contexts": [2, 4],
    "observed_ms": [1.0, 2.0],
    "draft_ms": [1.5, 2.5],
    "verify_ms": [3.0, 4.0],
    "verify_rows": 3,
    "iterations": 10,
    "plain_iterations": 20,
}


def with_workload(prof: dict, **changes) -> dict:
    prof["models"][FP]["workload"] = {**WORKLOAD, **changes}
    return prof


def test_the_profile_s_workload_terms_are_charged_and_no_trace_timing_is_read():
    """The hand trace's prompt leaves 2 tokens of context before the first step; the terms are relative to 2.
    Its recorded timings are wild: with the profile's terms, none of them reaches the projection."""
    from dataclasses import replace

    tr = hand_trace()
    tr = replace(tr, steps=[replace(s, t_draft=9.0, t_verify=9.0, t_host=9.0) for s in tr.steps])
    p = project([tr], with_workload(profile()), modes=["ar", "conf"])
    assert "measured by calibrate" in p.terms and "measured by calibrate" in p.basis
    ar = p.modes["ar"]
    # six plain iterations at 0..5 tokens beyond the profile's context: 4 ms + 1 ms per token, loop included
    assert ar.t_verify == pytest.approx(6 * 4e-3 + (0 + 1 + 2 + 3 + 4 + 5) * 1e-3)
    assert ar.t_host == 0.0 and ar.t_draft == 0.0
    c = p.modes["conf"]
    # two iterations (at 0 and 3 tokens beyond), two draft passes each: the engine's pass 1.5 ms + host 0.25 ms
    # + 0.5 ms per token beyond; verifications of three rows: T_AR + 2·T_tok (+ 4 experts the first time) + the
    # first row's 2 ms and each further row's 0.1 ms per token beyond; the loop 0.5 ms per verified row
    assert c.t_draft == pytest.approx(2 * (1.5 + 0.25) * 1e-3 + 2 * (1.5 + 0.25 + 0.5 * 3) * 1e-3)
    assert c.t_verify == pytest.approx((10 + 6 + 4) * 1e-3 + (10 + 6) * 1e-3 + (2.0 + 2 * 0.1) * 3 * 1e-3)
    assert c.t_host == pytest.approx(2 * 3 * 0.5e-3)


def test_under_a_budget_a_plain_step_records_routing_and_pays_the_verification_s_terms():
    p = project([hand_trace()], with_workload(profile()), budget="1G", modes=["ar"])
    ar = p.modes["ar"]
    assert ar.t_verify == pytest.approx(6 * 10e-3 + 2.0 * (0 + 1 + 2 + 3 + 4 + 5) * 1e-3)
    assert ar.t_host == pytest.approx(6 * 0.5e-3)


def test_profiles_without_workload_terms_still_project_and_say_how():
    """A calibrated profile from before calibrate measured the terms: fitted from the traces, as before, and said
    so; a reference profile: the constants alone; --terms picks explicitly."""
    from s2moe.engine.profiles import load_profile

    old = project([hand_trace()], profile(), modes=["ar"])
    assert "no workload terms" in old.basis and "calibrate again" in old.basis and "in-sample" in old.terms
    assert old.modes["ar"].tok_per_s == pytest.approx(100.0)
    ref = project([hand_trace()], load_profile("jetson-orin-16gb"), modes=["ar", "s2moe"])
    assert ref.terms == "none" and "constants only" in ref.basis and ref.modes["s2moe"].tok_per_s > 0
    fitted = project([hand_trace()], with_workload(profile()), modes=["ar"], terms="trace")
    assert "in-sample" in fitted.terms and fitted.modes["ar"].tok_per_s == pytest.approx(100.0)
    bare = project([hand_trace()], with_workload(profile()), modes=["ar"], terms="none")
    assert bare.modes["ar"].tok_per_s == pytest.approx(100.0) and "--terms none" in bare.basis
    with pytest.raises(ConfigError, match="calibrated for their model"):
        project([hand_trace()], load_profile("jetson-orin-16gb"), terms="trace")


def test_workload_terms_round_trip_and_bad_ones_are_one_line(tmp_path, capsys, monkeypatch):
    import yaml
    from s2moe.engine.profiles import load_profile, save_profile

    cfg = tmp_path / "config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(cfg))
    save_profile(with_workload(profile()), "terms")
    assert load_profile("terms")["models"][FP]["workload"] == WORKLOAD
    write_trace(tmp_path / "a.jsonl", hand_trace())
    assert main(["project", str(tmp_path / "a.jsonl"), "--profile", "terms", "--modes", "ar", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["modes"]["ar"]["t_verify_s"] == pytest.approx(39e-3)
    folder = cfg / "s2moe" / "profiles"
    bad = {
        "host_row_ms": -0.1,
        "t_plain_ms": 0,
        "ctx_step_us": "fast",
        "context_tokens": 2.5,
        "contexts": "32,128",
        "verify_ms": [3.0],
        "draft_ms": [1.0, -1.0],
    }
    for key, value in bad.items():
        (folder / "bad.yaml").write_text(yaml.safe_dump(with_workload(profile(), **{key: value})))
        assert main(["project", str(tmp_path / "a.jsonl"), "--profile", "bad"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "workload" in err and key in err, (key, err)
    missing = with_workload(profile())
    del missing["models"][FP]["workload"]["host_draft_ms"]
    (folder / "bad.yaml").write_text(yaml.safe_dump(missing))
    assert main(["project", str(tmp_path / "a.jsonl"), "--profile", "bad"]) == 2
    assert "missing field host_draft_ms" in capsys.readouterr().err


def test_calibrate_measures_the_workload_terms_in_the_engine(tiny_models, tmp_path, monkeypatch):
    """On a tiny model: the terms are written into the profile's block, valid, and a projection of a trace of
    that model charges them."""
    from s2moe.engine.decoding.decoder import Decoder
    from s2moe.engine.decoding.generation_config import GenerationConfig
    from s2moe.engine.measure.calibrate import run_calibration
    from s2moe.engine.measure.calibration_events import CalibrationDone
    from s2moe.engine.measure.trace import TraceRecorder
    from s2moe.engine.profile_schema import validate_profile

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    model = str(tiny_models["olmoe"])
    done = [
        e
        for e in run_calibration(model, prompts=["hello there", "once upon a time"], n_threads=1, repeats=1, save=False)
        if isinstance(e, CalibrationDone)
    ][0]
    validate_profile(done.profile)
    (block,) = done.profile["models"].values()
    w = block["workload"]
    assert w["context_tokens"] == 32 and w["contexts"] == [32, 128, 256, 384]
    assert w["t_plain_ms"] > 0 and w["t_draft_ms"] > 0 and w["plain_iterations"] > 300 and w["iterations"] >= 3
    assert all(
        w[k] >= 0 for k in ("ctx_plain_us", "ctx_draft_us", "ctx_step_us", "ctx_row_us", "host_draft_ms", "host_row_ms")
    )
    dec = Decoder(model, n_ctx=256, n_threads=1, max_draft=4)
    try:
        rec = TraceRecorder(dec.info)
        for ev in dec.generate(
            "hello there",
            GenerationConfig(
                mode="s2moe", n_predict=8, draft_max=4, trace=True, cost=block_cost(done.profile, dec.info.fingerprint)
            ),
        ):
            rec.add(ev)
    finally:
        dec.close()
    p = project([rec.trace], done.profile, modes=["ar"])
    assert "measured by calibrate" in p.terms
    ar = p.modes["ar"]
    beyond = [rec.trace.header.prompt_tokens - 1 + i - 32 for i in range(ar.iterations)]
    assert ar.t_verify == pytest.approx(sum(w["t_plain_ms"] / 1e3 + w["ctx_plain_us"] / 1e6 * b for b in beyond))


def block_cost(prof: dict, fp: str):
    from s2moe.engine.profiles import cost_for_model

    return cost_for_model(prof, fp)


def test_a_calibrated_cache_size_scales_the_plan_s_cache():
    """calibrate --budget records the LRU cache that fetches what plain decoding counted; --cache-size calibrated
    scales the plan by it (here to nothing: every expert fetched), the default keeps the plan."""
    from s2moe.engine.measure.cache_model import CachePlan, capacity_fetching

    prof = profile()
    prof["models"][FP]["cache_fit"] = {
        "planned_experts": 10,
        "effective_experts": 0,
        "tokens": 5,
        "fetched_per_token": 4.0,
        "pinned": 0,
    }
    scaled = project([hand_trace()], prof, budget="1G", modes=["ar"], cache_size="calibrated")
    assert scaled.modes["ar"].fetched == 24 and "in effect 0" in scaled.budget
    assert project([hand_trace()], prof, budget="1G", modes=["ar"]).modes["ar"].fetched == 8
    # one layer, top-1: experts 0 and 1 in turn; two slots hold both, one slot misses every time
    ids = [np.array([[i % 2]]) for i in range(10)]
    plan = CachePlan(0, (), "")
    assert capacity_fetching(ids, 0, plan, 4, warm=2) == 2
    assert capacity_fetching(ids, 8, plan, 4, warm=2) == 0
    prof["models"][FP]["cache_fit"]["effective_experts"] = -1
    with pytest.raises(ConfigError, match="cache_fit"):
        validate_profile(prof)


def test_drafts_from_resident_experts_fetch_nothing_and_are_priced_as_in_memory():
    """A trace whose drafts read only experts in memory charges its draft passes no fetch and puts nothing
    through the simulated cache for them; the router's drafts, on the same recording, fetch theirs. The
    utility rule prices a resident draft at the draft step measured in memory, as the decoder does."""
    router = project([hand_trace()], profile(), budget="1M", modes=["conf"]).modes["conf"]
    resident = project([hand_trace(draft_experts="resident")], profile(), budget="1M", modes=["conf"]).modes["conf"]
    # a cache of nothing: four passes of one expert in each of two layers, then the verifications' unions
    assert router.fetched == 4 * 2 + 8 + 4
    assert resident.fetched == 8 + 4 and resident.draft_passes == router.draft_passes == 4
    assert resident.t_fetch == pytest.approx(router.t_fetch - 8 * 4e-3)
    cold = profile()
    cold["models"][FP]["c_draft_cold_ms"] = 50.0
    # a certain token saves T_AR 10 ms: against a cold draft step of 50 ms that is worth 0.19, against the
    # draft step in memory (2 ms) 2.0
    drafted = {
        which: project([hand_trace(draft_experts=which)], cold, budget="1G", modes=["s2moe"], threshold=0.5)
        .modes["s2moe"]
        .drafted
        for which in ("router", "resident")
    }
    assert drafted["router"] == 0 and drafted["resident"] > 0


def test_traces_of_both_kinds_of_draft_are_not_projected_together():
    with pytest.raises(ConfigError, match="one kind of draft at a time"):
        project([hand_trace(), hand_trace(draft_experts="resident")], profile(), modes=["ar"])


def test_projected_copies_are_the_copies_decoding_makes(decoders, arch):
    """A traced generation replayed as s2moe makes the copies from the context s2moe's own decoding made on
    that prompt: the same iterations, tokens copied and tokens accepted. The constants make a draft pass too dear
    and a copied row cheap, T_exp 0 so that the experts a row adds do not enter the decisions. Decoding prices
    copies by its wall clock once three copies were rejected whole, the replay by its projected one: the
    generations end where decoding's third such copy is verified. Decoding copies from the context only here:
    this decoder's earlier generations are other tests', which the replay of one trace cannot know."""
    from dataclasses import replace

    from s2moe.engine.decoding.decoder import run
    from s2moe.engine.decoding.generation_config import GenerationConfig
    from s2moe.engine.events import CostConstants, Iteration
    from s2moe.engine.measure.trace import TraceRecorder
    from test_engine_decoding import REPEATING

    d = decoders[arch]
    cfg = GenerationConfig(mode="s2moe", n_predict=48, reuse_strength=0.0, stop_at_eos=False, lookup_session=False)
    runs = iter(range(1000))

    def iterations(cfg):
        # constants of their own name: a rule of its own, which no generation before taught (as the replay's)
        c = CostConstants(t_ar=1.0, c_draft=0.9, t_exp=0.0, t_tok=0.2, intercept=0.0, source=f"replayed {next(runs)}")
        return [e for e in run(d, REPEATING, replace(cfg, cost=c)) if isinstance(e, Iteration)]

    its = iterations(cfg)
    rejected = [i for i, e in enumerate(its) if e.drafted and not e.accepted]
    if len(rejected) >= 3:
        cfg = replace(cfg, n_predict=sum(len(e.committed) for e in its[: rejected[2] + 1]))
        its = iterations(cfg)
    rec = TraceRecorder(d.info)
    for ev in d.generate(REPEATING, replace(cfg, trace=True, cost=CostConstants(1.0, 0.9, 0.0, 0.2, 0.0, "traced"))):
        rec.add(ev)
    prof = {
        "name": "copies",
        "kind": "measured",
        "device": {},
        "models": {
            d.info.fingerprint: {
                "t_ar_ms": 1000.0,
                "c_draft_ms": 900.0,
                "t_exp_ms": 0.0,
                "t_tok_ms": 200.0,
                "intercept_ms": 0.0,
                "expert_bytes": 1000,
            }
        },
    }
    copies = project([rec.trace], prof, modes=["s2moe"], terms="none").modes["s2moe"]
    assert copies.copied_session == 0
    assert copies.copied == sum(len(e.drafted) for e in its) > 0
    assert copies.copies_accepted == sum(len(e.accepted) for e in its)
    assert copies.iterations == len(its) and copies.tokens == cfg.n_predict
    assert copies.draft_passes == 0
    # without copies s2moe does not draft at all here, as decoding with --no-lookup
    off = project([rec.trace], prof, modes=["s2moe"], terms="none", lookup=False).modes["s2moe"]
    assert off.drafted == 0 and off.iterations == cfg.n_predict
    assert not any(e.drafted for e in iterations(replace(cfg, lookup=False)))


def test_copies_are_priced_by_the_projected_clock_once_three_were_rejected_whole():
    """The prompt and the generation repeat "1 2", never with the same token after it: three copies after that
    bigram are rejected whole (the acceptance learned for bigrams falls, so a fourth is declined). Then a trigram
    repeats, whose copy the constants would take (T_AR 10 ms saved, a row 2.5 ms). On a device whose plain
    step the profile measured at 2 ms, the three rejected copies timed on the replay's clock price a row at
    about 7 ms and a token saved at 2: no copy can pay, and the trigram is not copied. Where a plain step costs
    the constants' 10 ms, the timed prices agree with the constants and it is."""
    prompt = (1, 2, 9, 5)
    generated = [20, 1, 2, 21, 22, 1, 2, 23, 24, 1, 2, 25, 26, 24, 1, 2, 25, 27, 28, 29]
    steps = [TraceStep((t,), 0, (), None, R0[None], R0[None], 0.0, 0.0) for t in generated]
    tr = Trace(
        header(draft_max=3, n_predict=len(generated), prompt_tokens=len(prompt), prompt=prompt),
        steps,
        n_tokens=len(generated),
        seconds=1.0,
        name="copies",
    )
    quiet = dict(
        ctx_plain_us=0.0, ctx_step_us=0.0, ctx_row_us=0.0, ctx_draft_us=0.0, host_draft_ms=0.0, host_row_ms=0.0
    )
    cheap_plain = with_workload(profile(c_draft_ms=50.0, t_tok_ms=2.5), t_plain_ms=2.0, **quiet)
    s = project([tr], cheap_plain, modes=["s2moe"]).modes["s2moe"]
    assert (s.copied, s.copies_accepted, s.iterations, s.draft_passes) == (2 + 1 + 1, 0, len(generated), 0)
    s = project([tr], profile(c_draft_ms=50.0, t_tok_ms=2.5), modes=["s2moe"], terms="none").modes["s2moe"]
    assert (s.copied, s.copies_accepted, s.iterations) == (2 + 1 + 1 + 2, 1, len(generated) - 1)
    # replayed twice over (bench --repeats): the second pass starts from what the first taught the rule, which
    # by then prices copies as not paying, so it copies nothing; ar's tokens and time simply double
    twice = project([tr], cheap_plain, modes=["ar", "s2moe"], repeats=2)
    once = project([tr], cheap_plain, modes=["ar", "s2moe"])
    assert (twice.repeats, twice.modes["s2moe"].copied, twice.modes["s2moe"].tokens) == (2, 4, 2 * len(generated))
    assert twice.modes["ar"].seconds == pytest.approx(2 * once.modes["ar"].seconds)
    with pytest.raises(ConfigError, match="repeats"):
        project([tr], cheap_plain, repeats=0)
    # traces from before they held their prompts: s2moe without copies, and said so
    old = project([replace(tr, header=replace(tr.header, prompt=None))], cheap_plain, modes=["s2moe"])
    assert old.modes["s2moe"].copied == 0 and "without copies" in old.basis


def test_copies_are_hoped_for_where_the_replayed_plain_steps_fetch_what_they_read():
    """Decoding tells its copy planner what each plain step fetched of the experts it read
    (LookupOrSelfDrafter.feedback): where plain steps fetch most of them, it raises its estimates of a copy's
    acceptance by their uncertainty and prices a copied token at the plain step as timed (CopyLearner). The replay
    tells it the same. The generation repeats its prompt after "1 2"; with a copied row at 8 ms against a 10 ms
    plain step a copy pays only on those hopes: it is made where the recorded run's cache held nothing, and not
    where it held every expert (plain steps then fetch nothing)."""
    prompt = (1, 2, 3, 4, 5, 6)
    generated = [9, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12]
    steps = [TraceStep((t,), 0, (), None, R0[None], R0[None], 0.0, 0.0) for t in generated]
    tr = Trace(
        header(draft_max=4, n_predict=len(generated), prompt_tokens=len(prompt), prompt=prompt),
        steps,
        n_tokens=len(generated),
        seconds=1.0,
        name="budget",
    )

    def s2moe(cache_bytes):
        ran = {"auto": False, "budget_bytes": 1 << 20, "hot_bytes": 0, "cache_bytes": cache_bytes, "pinned": []}
        return project([tr.with_budget(ran)], profile(t_tok_ms=8.0), budget="1M", modes=["s2moe"], terms="none").modes[
            "s2moe"
        ]

    empty, everything = s2moe(0), s2moe(8000)
    assert (empty.copied, empty.copies_accepted, empty.iterations) == (4, 4, len(generated) - 4)
    assert (everything.copied, everything.iterations) == (0, len(generated))


def test_project_cli_says_what_s2moe_copied_and_leaves_copies_out_when_asked(tmp_path, capsys, monkeypatch):
    import yaml

    cfg = tmp_path / "config"
    (cfg / "s2moe" / "profiles").mkdir(parents=True)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(cfg))
    (cfg / "s2moe" / "profiles" / "hand.yaml").write_text(yaml.safe_dump(profile(c_draft_ms=50.0, t_tok_ms=2.5)))
    # the generation (5 6 7 8 9 10) repeats the prompt's "5 6 7" and goes on otherwise: after "5 6" the copy
    # "7 5" is right for its first token
    tr = hand_trace(prompt=(5, 6, 7, 5), prompt_tokens=4)
    write_trace(tmp_path / "t.jsonl", tr)
    assert main(["project", str(tmp_path / "t.jsonl"), "--profile", "hand", "--modes", "ar,s2moe"]) == 0
    out = capsys.readouterr().out
    assert "s2moe copied 2 tokens from the context (1 accepted) of the 2 it drafted" in out
    assert (
        main(
            ["project", str(tmp_path / "t.jsonl"), "--profile", "hand", "--modes", "ar,s2moe", "--no-lookup", "--json"]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["modes"]["s2moe"]["copied"] == 0
    (tmp_path / "s").mkdir()
    for i, t in enumerate(session_traces()):
        write_trace(tmp_path / "s" / f"{i}.jsonl", t)
    assert main(["project", str(tmp_path / "s"), "--profile", "hand", "--modes", "ar,s2moe", "--terms", "none"]) == 0
    assert "s2moe copied 2 tokens from earlier traces (2 accepted) of the 2 it drafted" in capsys.readouterr().out
    assert (
        main(
            [
                "project",
                str(tmp_path / "s"),
                "--profile",
                "hand",
                "--modes",
                "ar,s2moe",
                "--terms",
                "none",
                "--no-session-copies",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["modes"]["s2moe"]["copied"] == 0


def session_traces() -> tuple[Trace, Trace]:
    """Plain steps of two prompts: the second's prompt ends in "40 41", which the first generated, followed by
    the "42 43" the second goes on with."""

    def plain_trace(prompt, generated, name):
        steps = [TraceStep((t,), 0, (), None, R0[None], R0[None], 0.0, 0.0) for t in generated]
        return Trace(
            header(draft_max=3, n_predict=len(generated), prompt_tokens=len(prompt), prompt=prompt),
            steps,
            n_tokens=len(generated),
            seconds=1.0,
            name=name,
        )

    return (
        plain_trace((1, 2, 3), [40, 41, 42, 43, 44, 45], "first"),
        plain_trace((7, 8, 40, 41), [42, 43, 50, 51, 52, 53], "second"),
    )


def test_s2moe_copies_from_traces_of_other_prompts_replayed_before():
    """A trace whose own context repeats nothing copies what followed its last bigram in a trace of another
    prompt replayed before it, as decoding copies from its earlier generations: "40 41" is followed by "42 43 44"
    there, and the rule (a prior of 0.6, T_AR 10 ms saved, a row 2.5 ms) keeps the first two copied tokens, both
    of them the tokens the recording committed. Replayed alone, after a trace of its own prompt (bench's repeats
    and interleaved modes), or without session copies (bench's +lookup rung), nothing is copied."""
    first, second = session_traces()
    prof = profile(c_draft_ms=50.0, t_tok_ms=2.5)
    s = project([first, second], prof, modes=["s2moe"], terms="none").modes["s2moe"]
    assert (s.copied, s.copies_accepted, s.copied_session, s.session_accepted) == (2, 2, 2, 2)
    assert s.iterations == 6 + 4 and s.draft_passes == 0
    for traces, kw in (([second], {}), ([second, second], {}), ([first, second], {"session": False})):
        assert project(traces, prof, modes=["s2moe"], terms="none", **kw).modes["s2moe"].copied == 0
