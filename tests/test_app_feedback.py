"""What the app tells a first-time user: where each chat setting comes from (and that a profile made active wins),
what a budgeted start-up is doing while it loads, and what a stopped tuning kept. Pilot tests and snapshots at
80×24 and 60×20."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from s2moe.app.tui.calibrate_widgets import ConfirmSave
from s2moe.app.tui.chat_settings import FROM_DEFAULT, FROM_FLAG, FROM_PROFILE, FROM_USER, ChatSettings
from s2moe.app.tui.state import remember_settings
from s2moe.engine.measure.tune import TuneMeasured, TuneProgress, TuneStarted
from s2moe.engine.measure.tune_space import Settings
from test_app import fake_app, open_settings, type_prompt, wait_for
from test_app_snapshots import fixed_profile_folders, make_app, ready, scripted_engine_runs, settle  # noqa: F401 (autouse fixtures)
from test_app_support import FakeDecoder
from test_wizard import DEFAULTS, FP, TUNED, calibrated, scripted_calibration, scripted_tune, wizard

SLOWER = Settings(2, 8, 1.0, 0.5, 8)
SIZES = [pytest.param((80, 24), id="80x24"), pytest.param((60, 20), id="60x20")]


def run(coro):
    return asyncio.run(coro)


# -- where each setting comes from -----------------------------------------------------------------------------
def test_each_value_says_whether_it_is_the_flags_the_users_the_profiles_or_the_default():
    settings = ChatSettings(draft_topk=3, temperature=0.7, n_predict=64)
    sources = settings.sources({"draft_topk": 2, "threshold": 0.5}, {"temperature": 0.7})
    assert sources["draft_topk"] == FROM_USER and sources["threshold"] == FROM_PROFILE
    assert sources["temperature"] == FROM_FLAG and sources["n_predict"] == FROM_USER
    assert sources["draft_max"] == FROM_DEFAULT and sources["mode"] == FROM_DEFAULT
    assert settings.overrides({"draft_topk": 2, "threshold": 0.5}) == {"draft_topk": (3, 2)}
    assert settings.overrides({"draft_topk": 3}) == {}  # the same value is no mix
    assert settings.left_to_profile().draft_topk is None and settings.left_to_profile().n_predict == 64


def test_a_profile_saved_after_tuning_wins_over_the_remembered_k_d(monkeypatch, tmp_path):
    """The reported flow: k_d chosen with F9 (remembered), then calibrate → tune → save from F3, back to F2:
    the chat drafts with the profile's tuned k_d, and says whose values it uses."""
    monkeypatch.setattr("s2moe.engine.measure.tune.run_tune", scripted_tune([]))
    remember_settings({"draft_topk": 3})  # an earlier run's F9
    app = wizard(monkeypatch, tmp_path, scripted_calibration())
    decoders = []

    def factory(path):
        decoders.append(FakeDecoder(path))
        return decoders[-1]

    app.session._factory = factory

    async def go():
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.session.model is not None, what="model")
            chat = app.screen
            assert chat.settings.draft_topk == 3
            screen = await calibrated(pilot, app)
            await pilot.press("ctrl+t")
            await wait_for(
                pilot,
                lambda: screen.tune is not None and screen.tune.state == "done" and not screen.running,
                what="tuning",
            )
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmSave), what="the question")
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: app.session.profile_name == "my-box", what="the active profile")
            messages = [n.message for n in app._notifications]
            assert any("the profile's tuned values replace yours: k_d 2 (was 3)" in m for m in messages)
            await pilot.press("f2")
            assert chat.settings.draft_topk is None and chat.shown_settings().draft_topk == TUNED.draft_topk
            bar = str(chat.query_one("#settings-bar").render())
            assert "k_d=2" in bar and "yours" not in bar
            await type_prompt(pilot, "hi")
            await wait_for(pilot, lambda: not chat.generating and decoders[-1].configs, what="generation")
            cfg = decoders[-1].configs[-1]
            assert (cfg.draft_topk, cfg.draft_max, cfg.threshold) == (
                TUNED.draft_topk,
                TUNED.draft_max,
                TUNED.threshold,
            )
            # picked again after the profile: the user's, and the bar says over what
            await pilot.press("f9")
            bar = str(chat.query_one("#settings-bar").render())
            assert chat.settings.draft_topk == 3 and "k_d=3 (yours; profile 2)" in bar

    run(go())


def test_the_settings_form_names_each_values_source_and_resets_to_the_profile(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    write_tuned_profile(tmp_path)
    remember_settings({"draft_topk": 3, "threshold": 0.5})
    app = fake_app(profile="tuned-box", sampling={"temperature": 0.7})

    async def go():
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.session.model is not None, what="model")
            chat = app.screen
            form = await open_settings(pilot, app)
            assert form.sources["draft_topk"] == FROM_USER and form.sources["draft_max"] == FROM_PROFILE
            assert form.sources["temperature"] == FROM_FLAG and form.sources["n_predict"] == FROM_DEFAULT
            assert "from profile tuned-box" in str(form.query_one(".source-profile").render())
            # applied unchanged, the profile's values stay the profile's
            await pilot.click("#apply")
            await wait_for(pilot, lambda: app.screen is chat, what="the form closed")
            assert chat.settings.draft_max is None and chat.settings.draft_topk == 3
            form = await open_settings(pilot, app)
            await pilot.click("#reset")
            await wait_for(pilot, lambda: app.screen is chat, what="the form closed")
            assert chat.settings.draft_topk is None and chat.settings.threshold is None
            assert chat.shown_settings().draft_topk == 1 and chat.settings.temperature == 0.7
            form = await open_settings(pilot, app)
            assert form.query_one("#reset").disabled  # nothing of the user's left to reset
            await pilot.press("escape")
            await pilot.press("f9")  # the user's again; the palette resets it too
            assert chat.settings.draft_topk == 2
            await pilot.press("ctrl+p")
            await pilot.press(*"reset settings")
            await pilot.pause(0.3)
            await pilot.press("enter")
            await wait_for(pilot, lambda: chat.settings.draft_topk is None, what="the palette's reset")

    run(go())


TUNED_PROFILE = f"""\
schema: 1
name: tuned-box
kind: measured
device: {{name: test cpu, kind: cpu}}
models:
  {FP}:
    model: fake-moe.gguf
    t_ar_ms: 10.0
    c_draft_ms: 4.0
    t_exp_ms: 0.1
    t_tok_ms: 1.0
    intercept_ms: 2.0
    tuned:
      resident:
        settings: {{draft_topk: 1, draft_max: 6, threshold: 0.75, reuse_strength: 0.25, reuse_cap: 6}}
"""


def write_tuned_profile(config_home):
    folder = config_home / "s2moe" / "profiles"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tuned-box.yaml").write_text(TUNED_PROFILE)


def provenance_app(tmp_path):
    write_tuned_profile(tmp_path / "config")  # beside the snapshots' profiles
    remember_settings({"draft_topk": 3})
    return make_app(profile="tuned-box", sampling={"temperature": 0.7, "seed": 5})


@pytest.mark.parametrize("size", SIZES)
def test_snapshot_the_settings_bar_names_the_users_values_over_the_profile(snap_compare, size, tmp_path):
    async def run_before(pilot):
        await ready(pilot)
        await settle(pilot)

    assert snap_compare(provenance_app(tmp_path), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES)
def test_snapshot_the_settings_form_names_each_values_source(snap_compare, size, tmp_path):
    app = provenance_app(tmp_path)

    async def run_before(pilot):
        await ready(pilot)
        form = await open_settings(pilot, app)
        form.query_one("#set-topk").focus()  # the values of the user's and of the profile's in view
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=run_before)


# -- a stopped tuning ------------------------------------------------------------------------------------------
def held_tune(go: threading.Event, release: threading.Event):
    """A tuning that measures a rung, waits for `go`, then runs until stopped and finishes its measurement
    only on `release` (a slow measurement, as under a budget)."""

    def run_tune(decoder, prompts, **kw):
        stop = kw["should_stop"]
        yield TuneStarted(3, DEFAULTS, kw["time_budget_s"], {})
        for i, (s, tps) in enumerate([(DEFAULTS, 24.0), (TUNED, 30.0), (SLOWER, 27.0)]):
            yield TuneMeasured(i, s, 0, tps, 1)
        go.wait(10)
        yield TuneProgress(4, 10, "rung 2")
        while not stop() and not release.is_set():
            time.sleep(0.01)
        release.wait(10)

    return run_tune


def test_stopping_a_tuning_says_how_long_it_waits_and_keeps_the_best_so_far(monkeypatch, tmp_path):
    now, go, release = [0.0], threading.Event(), threading.Event()
    monkeypatch.setattr("s2moe.app.tui.calibrate.clock", lambda: now[0])
    monkeypatch.setattr("s2moe.engine.measure.tune.run_tune", held_tune(go, release))
    app = wizard(monkeypatch, tmp_path, scripted_calibration())

    async def go_():
        async with app.run_test(size=(80, 24)) as pilot:
            try:
                await stop_a_held_tuning(pilot)
            finally:
                go.set()
                release.set()

    async def stop_a_held_tuning(pilot):
        screen = await calibrated(pilot, app)
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: screen.tune is not None and len(screen.tune.points) == 3, what="rung 1")
        now[0] = 40.0  # the next measurement takes 40 s
        go.set()
        await wait_for(pilot, lambda: screen.tune.done == 4, what="the measurement")
        bar = screen.query_one("#cal-progress")
        assert (bar.progress, bar.total) == (4, 10)  # the tuning's progress, not the calibration's 100 %
        now[0] = 50.0
        await pilot.press("escape")
        text = screen.steps_text().plain
        assert text.rstrip().endswith(
            "stopping after the current measurement: up to ~30 s more (the longest so "
            "far took 40 s; this one began 10 s ago)…"
        )
        assert "Done. Press Ctrl+S" not in text
        release.set()
        await wait_for(pilot, lambda: not screen.running, what="the stop")
        await pilot.pause()
        text = screen.steps_text().plain
        assert (
            "stopped after rung 1 — partial: best so far k_d 2 · cap 12 · threshold 0.5 · α 0.25 |E*| 6 → "
            "30.00 tok/s, the defaults 24.00 tok/s (1.250×)" in text
        )
        assert text.rstrip().endswith("Ctrl+S saves the calibration alone.") and "Done. Press" not in text
        assert (bar.progress, bar.total) == (4, 10)
        left = screen.query_one("#cal-left")
        assert left.scroll_y == left.max_scroll_y  # the final status in view, not above it
        assert screen.profile_to_save()["models"][FP].get("tuned") is None  # partial: not in the profile

    run(go_())


def test_a_tuning_stopped_before_a_rung_ended_says_nothing_was_compared():
    from s2moe.app.tui.calibrate_steps import TuneState, stopping_text

    t = TuneState(state="stopped")
    assert t.best_so_far() is None
    t.points, t.settings = {0: (0, 24.0), 1: (0, 30.0)}, {0: DEFAULTS, 1: TUNED}
    assert t.best_so_far() == (TUNED, 30.0, 24.0, 0)
    # a later rung's figures only compare with each other: the candidate dropped at rung 1 is no longer best
    t.points.update({0: (1, 25.0), 2: (1, 26.0)})
    t.settings[2] = SLOWER
    assert t.best_so_far() == (SLOWER, 26.0, 25.0, 1)
    assert stopping_text(None, 3.2) == "stopping after the current measurement (running for 3 s)…"


@pytest.mark.parametrize("size", SIZES)
def test_snapshot_a_stopped_tuning(snap_compare, size, monkeypatch, tmp_path):
    monkeypatch.setattr("s2moe.engine.measure.tune.run_tune", scripted_tune([], until_stopped=True))
    app = wizard(monkeypatch, tmp_path, scripted_calibration())

    async def run_before(pilot):
        screen = await calibrated(pilot, app)
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: screen.tune is not None and screen.tune.total == 10, what="the search")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not screen.running, what="the stop")
        await settle(pilot)
        await pilot.pause(0.1)

    assert snap_compare(app, terminal_size=size, run_before=run_before)


# -- loading under a budget --------------------------------------------------------------------------------------
def test_a_budgeted_load_says_each_step_it_takes(monkeypatch):
    """Loading, warming every mode up, sizing the budget: each said as it starts, step of steps."""
    from s2moe.app.tui.session import EngineSession
    from s2moe.engine import offload

    steps = []
    session = EngineSession("fake-moe.gguf", budget="auto")
    session.decoder = decoder = FakeDecoder()

    class Offloader:
        budget_bytes = 123 << 20

    def offload_decoder(decoder_, budget, hot, warm_up):
        assert decoder_ is decoder and budget.auto
        warm_up()
        steps.append("planned")
        return Offloader()

    monkeypatch.setattr(offload, "current_budget", lambda: (object(), 1 << 30))
    monkeypatch.setattr(offload, "offload_decoder", offload_decoder)
    session._offload(lambda step, n, what: steps.append((step, n, what)))
    assert steps == [(2, 4, "warming up ar"), (3, 4, "warming up s2moe"), (4, 4, "sizing the budget"), "planned"]
    assert [cfg.mode for cfg in decoder.configs] == ["ar", "s2moe"] and session.budget_bytes == 123 << 20


def slow_loading_app(loaded: threading.Event, **kw):
    """The app on a scripted decoder whose load waits for `loaded` (a budgeted load's minute)."""
    decoders = []

    def factory(path):
        loaded.wait(20)
        if app.fail_load:
            raise OSError("cannot read the model")
        decoders.append(FakeDecoder(path))
        return decoders[-1]

    app = make_app(**kw)
    app.fail_load = False
    app.session._factory = factory
    app.fake_decoders = decoders
    return app


def test_a_prompt_sent_while_the_model_loads_is_queued_and_starts_once_it_has():
    loaded = threading.Event()
    app = slow_loading_app(loaded)

    async def go():
        async with app.run_test(size=(80, 24)) as pilot:
            try:
                await wait_for(pilot, lambda: app.load_progress is not None, what="the load's first step")
                chat = app.screen
                await type_prompt(pilot, "hi")
                assert chat.query_one("#prompt").value == ""  # taken, not dropped
                assert chat._queued == "hi" and len(chat.transcript.turns) == 1
                assert chat.transcript.turns[0].status.startswith("queued: starts when the model has loaded")
                bar = str(chat.query_one("#settings-bar").render())
                assert "loading ▰ 1/1: loading the model" in bar and "your prompt is queued" in bar
            finally:
                loaded.set()
            await wait_for(
                pilot,
                lambda: app.fake_decoders and app.fake_decoders[0].configs and not chat.generating,
                what="the queued generation",
            )
            assert chat._queued is None and "tok/s" in chat.transcript.turns[0].summary

    run(go())


def test_a_queued_prompt_can_be_taken_back_and_returns_to_the_box_if_the_load_fails():
    loaded = threading.Event()
    app = slow_loading_app(loaded)

    async def go():
        async with app.run_test(size=(80, 24)) as pilot:
            try:
                await wait_for(pilot, lambda: app.model_loading, what="the load")
                chat = app.screen
                await type_prompt(pilot, "hi")
                await pilot.press("escape")
                assert chat._queued is None and not chat.generating
                assert chat.query_one("#prompt").value == "hi"
                assert chat.transcript.turns[0].summary == "taken back before the model had loaded"
                await pilot.press("enter")  # queued again
                assert chat._queued == "hi"
                app.fail_load = True
            finally:
                loaded.set()
            await wait_for(pilot, lambda: not app.model_loading and chat._queued is None, what="the failed load")
            assert chat.query_one("#prompt").value == "hi" and not chat.generating
            assert chat.transcript.turns[-1].summary == "not sent: the model did not load"

    run(go())


def test_the_first_generation_says_it_measures_cost_constants():
    from s2moe.app.tui.messages import EngineEvent
    from s2moe.engine.events import MeasuringCosts

    app = make_app()

    async def go():
        async with app.run_test(size=(80, 24)) as pilot:
            await ready(pilot)
            chat = app.screen
            chat.begin_turn("hi")
            chat.on_engine_event(EngineEvent(1, MeasuringCosts(0.4, 12.3), None, 0.0))
            status = "measuring cost constants ▰▰▰▰▱▱▱▱▱▱ 40% · 12 s"
            assert status in str(chat.query_one("#settings-bar").render()) and status in chat._turn.status

    run(go())


def test_a_profile_that_does_not_cover_the_model_is_said_at_start_pointing_to_f3(tmp_path):
    (tmp_path / "config" / "s2moe" / "profiles" / "other-box.yaml").write_text(
        "schema: 1\nname: other-box\nkind: measured\nmodels:\n"
        "  ffffffffffffffff: {t_ar_ms: 5.0, c_draft_ms: 2.0, t_exp_ms: 0.1}\n"
    )
    app = make_app(profile="other-box")

    async def go():
        async with app.run_test(size=(80, 24)) as pilot:
            await ready(pilot)
            messages = [n.message for n in app._notifications]
            assert any(
                "profile other-box was not calibrated for this model: F3 (Calibrate) measures it" in m for m in messages
            )
            assert "profile other-box (not for this model: F3)" in str(app.screen.query_one("#settings-bar").render())

    run(go())


def loading_app(step: int, steps: int, what: str, queued: str | None):
    """The app as a budgeted load shows itself at `step`, 14 s in (no load runs: the snapshot is fixed)."""
    from s2moe.app.tui.messages import LoadProgress

    app = make_app(load_on_start=False, budget="auto")

    async def run_before(pilot):
        app.model_loading, app.load_started = True, 100.0
        app.on_load_progress(LoadProgress(step, steps, what))
        if queued:
            await type_prompt(pilot, queued)
        await settle(pilot)

    return app, run_before


@pytest.mark.parametrize("size", SIZES)
def test_snapshot_a_budgeted_load_with_a_queued_prompt(snap_compare, size, monkeypatch):
    monkeypatch.setattr("s2moe.app.tui.messages.clock", lambda: 114.0)
    app, run_before = loading_app(3, 4, "warming up s2moe", "def fib(n):")
    assert snap_compare(app, terminal_size=size, run_before=run_before)


def test_an_enter_typed_before_the_terminal_was_raw_still_sends():
    """Keys typed while the app starts reach it through the terminal's cooked mode, Enter as a line feed."""
    app = make_app()

    async def go():
        async with app.run_test(size=(80, 24)) as pilot:
            await ready(pilot)
            chat = app.screen
            await pilot.press(*"hi", "ctrl+j")
            await wait_for(pilot, lambda: len(chat.transcript.turns) == 1 and not chat.generating, what="the answer")

    run(go())


def test_a_profile_made_active_before_the_model_loads_wins_once_it_has(tmp_path):
    write_tuned_profile(tmp_path / "config")
    remember_settings({"draft_topk": 3, "n_predict": 64})
    app = make_app(load_on_start=False)

    async def go():
        async with app.run_test(size=(80, 24)) as pilot:
            chat = app.screen
            app.set_profile("tuned-box")  # F4 while nothing is loaded: what the profile tunes is not known yet
            assert chat.settings.draft_topk == 3
            app.load_model()
            await ready(pilot)
            assert chat.settings.draft_topk is None and chat.shown_settings().draft_topk == 1
            assert chat.settings.n_predict == 64  # not something a profile tunes: the user's stays

    run(go())
