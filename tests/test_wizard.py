"""The calibration wizard is honest about failed steps: ✖ with the reason in plain words, doubtful fits flagged,
and saving with failed steps asks first and records what is missing."""

from __future__ import annotations

import asyncio
import time
from inspect import signature

import yaml
from s2moe.app.tui.app import S2MoEApp
from s2moe.app.tui.calibrate_steps import FIELDS, Outcome, plain_words, step_outcome, tune_minutes
from s2moe.app.tui.calibrate_widgets import ConfirmSave
from s2moe.engine.measure.calibrate import run_calibration as REAL_RUN_CALIBRATION
from s2moe.engine.measure.calibration_events import CalibrationDone, StepResult, StepStarted
from s2moe.engine.measure.quality_checks import CheckFigures
from s2moe.engine.measure.tune import TuneDone, TuneJointQuality, TuneMeasured, TuneProgress, TuneQuality, TuneStarted
from s2moe.engine.measure.tune import run_tune as REAL_RUN_TUNE
from s2moe.engine.measure.tune_space import Settings
from s2moe.engine.offload import Budget
from test_app_support import FakeDecoder

FP = "0123456789abcdef"  # the fake model's fingerprint
WORKER_ERROR = (
    "s2moe.engine.errors.ConfigError: cannot lower the memory limit to the auto budget 1.2 GiB: the "
    "process holds 1.5 GiB it cannot give back (Device or resource busy); give the budget a size instead"
)
BUDGET_FAILED = f"failed: {WORKER_ERROR}"


def results():
    """A calibration's step results: a fit that explains little with a T_exp of zero, a failed budget step."""
    return [
        StepResult(1, "bandwidth", "memory 10.0 GB/s", {"memory_bandwidth_gb_s": 10.0}),
        StepResult(2, "steps", "T_AR 0.51 ms · draft step 0.46 ms", {"t_ar_ms": 0.51, "c_draft_ms": 0.46}),
        StepResult(
            3,
            "cost model",
            "T_exp 0.0000 ms · R² 0.290",
            {
                "measured": [1.0, 1.1, 1.2],
                "predicted": [1.1, 1.1, 1.1],
                "r2": 0.29,
                "mape": 0.2,
                "t_exp_ms": 0.0,
                "t_tok_ms": 0.1,
                "intercept_ms": 0.4,
            },
        ),
        StepResult(4, "hot experts", "32 most routed experts", {"hot_experts": []}),
        StepResult(
            5, "budget", f"{BUDGET_FAILED}; cold T_exp derived from storage bandwidth", {"skipped": BUDGET_FAILED}
        ),
    ]


def scripted_calibration(fail_in_step: int | None = None):
    def run_calibration(model_path, **kw):
        call = signature(REAL_RUN_CALIBRATION).bind(model_path, **kw)
        name = call.arguments.get("name") or "local"
        for r in results():
            yield StepStarted(r.index, 6, r.name, f"measures {r.name}")
            if r.index == fail_in_step:
                raise RuntimeError("llama_decode returned -1")
            yield r
        yield StepStarted(6, 6, "profile", "write the profile")
        profile = {
            "schema": 1,
            "name": name,
            "kind": "measured",
            "device": {"name": "test cpu", "kind": "cpu"},
            "models": {
                FP: {
                    "model": "fake-moe.gguf",
                    "t_ar_ms": 0.51,
                    "c_draft_ms": 0.46,
                    "t_exp_ms": 0.0,
                    "t_tok_ms": 0.1,
                    "intercept_ms": 0.4,
                    "measured": {"by": "s2moe calibrate"},
                }
            },
        }
        yield StepResult(6, "profile", "not written to a file yet", {"path": None})
        yield CalibrationDone(profile, None)

    return run_calibration


def test_plain_words_drop_class_names_and_name_the_field():
    assert plain_words(WORKER_ERROR, FIELDS).startswith("cannot lower the memory limit to the auto budget")
    assert (
        plain_words("BudgetUnavailable: no cgroup; raise --budget", FIELDS)
        == "no cgroup; raise the Memory budget field"
    )
    assert plain_words("raise --budget", {}) == "raise --budget"  # the CLI keeps its flags


def test_step_outcomes():
    r = results()
    assert step_outcome(r[0]) == Outcome("done")
    cost = step_outcome(r[2])
    assert cost.state == "done" and len(cost.flags) == 2
    assert cost.flags[0].startswith("fit R² 0.29 is below 0.8") and cost.flags[1].startswith("T_exp 0.0000 ms is not")
    budget = step_outcome(r[4], FIELDS)
    assert budget.state == "failed" and budget.reason == plain_words(WORKER_ERROR)
    assert budget.note == "cold T_exp derived from storage bandwidth"

    # beside a poor fit, what the repeats' own spread allowed tells noise from a missing term
    def fit_flag(ceiling):
        return step_outcome(StepResult(5, "budget", "R² 0.5", {"r2": 0.5, "r2_ceiling": ceiling})).flags[0]

    assert "the device was noisy" in fit_flag(0.6) and "no model of their counts gets past 0.60" in fit_flag(0.6)
    assert "could reach 0.97, so the time follows something they do not count" in fit_flag(0.97)
    assert fit_flag(None).endswith("explains little of the measured time")
    skipped = step_outcome(
        StepResult(5, "budget", "skipped: no memory budget given", {"skipped": "skipped: no memory budget given"})
    )
    assert skipped == Outcome("skipped", "no memory budget given")


async def wait_for(pilot, cond, what, timeout=20.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        await pilot.pause(0.02)


def wizard(monkeypatch, tmp_path, calibration):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setattr("s2moe.engine.measure.calibrate.run_calibration", calibration)
    return S2MoEApp("fake-moe.gguf", decoder_factory=lambda path: FakeDecoder(path))


def test_a_failed_step_is_marked_and_saving_asks_first(monkeypatch, tmp_path):
    app = wizard(monkeypatch, tmp_path, scripted_calibration())
    saved = tmp_path / "s2moe" / "profiles" / "my-box.yaml"

    async def go():
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.session.model is not None, "model")
            await pilot.press("f3")
            screen = app.screen
            screen.query_one("#cal-name").value = "my-box"
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: screen.result is not None and not screen.running, "calibration")
            text = screen.steps_text().plain
            assert "✖ 5/6 budget" in text and "failed: cannot lower the memory limit" in text
            assert "ConfigError" not in text and "s2moe.engine" not in text
            assert "⚠ 3/6 cost model" in text and "fit R² 0.29 is below 0.8" in text
            assert "T_exp 0.0000 ms is not positive" in text
            assert "✔ 2/6 steps" in text and "Done." not in text and "1 step failed (budget)" in text
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmSave), "the question")
            assert "budget: cannot lower the memory limit" in str(app.screen.query_one("#confirm-text").render())
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.screen is screen, "the wizard again")
            assert not saved.exists() and app.session.profile_name is None
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmSave), "the question")
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: saved.exists(), "the profile")
            assert app.session.profile_name == "my-box"

    asyncio.run(go())
    measured = yaml.safe_load(saved.read_text())["models"][FP]["measured"]
    assert measured["by"] == "s2moe calibrate"
    assert measured["missing"] == [f"budget: {plain_words(WORKER_ERROR, FIELDS)}"]
    assert [f.split(":")[0] for f in measured["flagged"]] == ["cost model", "cost model"]


def test_an_error_mid_step_marks_that_step_failed(monkeypatch, tmp_path):
    app = wizard(monkeypatch, tmp_path, scripted_calibration(fail_in_step=3))

    async def go():
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.session.model is not None, "model")
            await pilot.press("f3")
            screen = app.screen
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: 3 in screen.steps and not screen.running, "the failure")
            text = screen.steps_text().plain
            assert "✖ 3/6 cost model" in text and "failed: llama_decode returned -1" in text
            assert "RuntimeError" not in text and screen.result is None

    asyncio.run(go())


def test_an_app_under_a_budget_calibrates_for_that_budget(monkeypatch, tmp_path):
    calls = []

    def recording(model_path, **kw):
        calls.append(kw)
        yield from scripted_calibration()(model_path, **kw)

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setattr("s2moe.engine.measure.calibrate.run_calibration", recording)
    app = S2MoEApp("fake-moe.gguf", budget="768M", load_on_start=False, decoder_factory=FakeDecoder)

    async def go():
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press("f3")
            screen = app.screen
            assert screen.query_one("#cal-budget").value == "768M"
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: screen.result is not None and not screen.running, "calibration")

    asyncio.run(go())
    assert [kw["budget"] for kw in calls] == [Budget(768 << 20)]


def test_cli_calibrate_marks_failed_steps_and_doubtful_fits(monkeypatch, tmp_path, capsys):
    from s2moe.app.cli import main

    monkeypatch.setattr("s2moe.engine.measure.calibrate.run_calibration", scripted_calibration())
    assert main(["calibrate", "--model", "fake-moe.gguf", "--no-save", "--no-plot"]) == 0
    err = " ".join(capsys.readouterr().err.split())  # rich wraps at the console's width
    assert f"[5] budget: ✖ failed: {plain_words(WORKER_ERROR)} (cold T_exp derived from storage bandwidth)" in err
    assert "ConfigError" not in err
    assert "⚠ fit R² 0.29 is below 0.8" in err and "⚠ T_exp 0.0000 ms is not positive" in err
    assert "warning: 1 step failed (budget): the profile lacks what they measure" in err


# -- the tuning step ----------------------------------------------------------------------------------------------
DEFAULTS = Settings(1, 8, 1.0, 0.5, 8)
TUNED = Settings(2, 12, 0.5, 0.25, 6)


def tune_section() -> dict:
    return {
        "settings": TUNED.as_dict(),
        "defaults": DEFAULTS.as_dict(),
        "speed": {
            "tuned_tok_s": 30.0,
            "defaults_tok_s": 24.0,
            "ar_tok_s": 20.0,
            "gain": 1.25,
            "per_prompt_ratios": [1.2, 1.3, 1.25],
            "separated": True,
            "verdict": "tuned 1.250× the defaults",
        },
        "quality": {"ppl_ratio": 1.004, "top1_agreement": 0.97, "tokens": 300},
        "search": {
            "method": "successive halving",
            "candidates": 4,
            "pool": 8,
            "feasible": 7,
            "rungs": 2,
            "runs": 18,
            "seconds": 12.0,
            "time_budget_s": 180.0,
        },
        "log": [{"rung": 1, **TUNED.as_dict(), "tok_s": 30.0, "prompts": 1, "kept": True}],
    }


def scripted_tune(calls: list, *, fail: bool = False, until_stopped: bool = False):
    """Stands in for engine.measure.tune.run_tune (called as the real one would be): fixed candidates and speeds."""

    def run_tune(decoder, prompts, **kw):
        call = signature(REAL_RUN_TUNE).bind(decoder, prompts, **kw)
        calls.append(call.arguments)
        stop = call.arguments["should_stop"]
        yield TuneStarted(4, DEFAULTS, call.arguments["time_budget_s"], {})
        yield TuneQuality(0.25, 6, CheckFigures(300, 1.004, 0.97, None, 0.011, 0.006), True)
        yield TuneQuality(1.0, 6, CheckFigures(300, 1.05, 0.85), False)
        yield TuneJointQuality(0.25, 6, 0.3, CheckFigures(280, 1.012, 0.93, 0.004, 0.015, 0.007), True)
        for i, (s, tps) in enumerate([(DEFAULTS, 24.0), (TUNED, 30.0), (Settings(2, 8, 1.0, 0.5, 8), 27.0)]):
            yield TuneMeasured(i, s, 0, tps, 1)
        if fail:
            raise RuntimeError("llama_decode returned -1")
        while until_stopped and not stop():
            yield TuneProgress(1, 10, "rung 2")
            time.sleep(0.01)
        if until_stopped:
            return
        yield TuneMeasured(1, TUNED, -1, 30.0, 3)
        yield TuneDone(tune_section(), TUNED, DEFAULTS)

    return run_tune


def test_the_tuning_minutes_default_to_more_under_a_budget_and_refuse_what_is_no_duration():
    assert tune_minutes("", offloaded=False) == 3 and tune_minutes("  ", offloaded=True) == 10
    assert tune_minutes("2.5", offloaded=True) == 2.5  # typed, it wins
    assert tune_minutes("0", offloaded=False) is None and tune_minutes("abc", offloaded=True) is None
    assert tune_minutes("1441", offloaded=False) is None


async def calibrated(pilot, app):
    await wait_for(pilot, lambda: app.session.model is not None, "model")
    await pilot.press("f3")
    screen = app.screen
    screen.query_one("#cal-name").value = "my-box"
    await pilot.press("ctrl+r")
    await wait_for(pilot, lambda: screen.result is not None and not screen.running, "calibration")
    return screen


def test_tuning_after_calibration_plots_the_candidates_and_saves_the_result(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr("s2moe.engine.measure.tune.run_tune", scripted_tune(calls))
    app = wizard(monkeypatch, tmp_path, scripted_calibration())
    saved = tmp_path / "s2moe" / "profiles" / "my-box.yaml"

    async def go():
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await calibrated(pilot, app)
            assert "Ctrl+T (Tune) first searches" in screen.steps_text().plain
            screen.query_one("#cal-tune-minutes").value = "2"
            await pilot.press("ctrl+t")
            await wait_for(
                pilot, lambda: screen.tune is not None and screen.tune.state == "done" and not screen.running, "tuning"
            )
            assert calls[0]["time_budget_s"] == 120 and calls[0]["cost"].t_ar == 0.51e-3  # the calibration's
            assert screen.tune.points == {0: (0, 24.0), 1: (-1, 30.0), 2: (0, 27.0)}
            text = screen.steps_text().plain
            assert "✔ tune" in text and "✖ fails the constraint" in text and "tuned 1.250× the defaults" in text
            assert (
                "quality of both, α 0.25 |E*| 6 α_m 0.3: perplexity ratio 1.0120 ± 0.0071, top-1 agreement "
                "0.930 ± 0.015 over 280 tokens: ok" in text
            )
            assert "k_d 2, draft cap 12, threshold 0.5, α 0.25, |E*| 6 → 30.00 tok/s" in text
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmSave), "the question")
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: saved.exists(), "the profile")
            await wait_for(pilot, lambda: screen.saved_path is not None, "the path")
            assert f"made active: {saved}" in screen.steps_text().plain

    asyncio.run(go())
    block = yaml.safe_load(saved.read_text())["models"][FP]
    assert block["tuned"]["resident"] == tune_section()
    assert block["measured"]["missing"]  # the failed budget step is still recorded


def test_tuning_can_be_stopped_and_a_failure_is_marked(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr("s2moe.engine.measure.tune.run_tune", scripted_tune(calls, until_stopped=True))
    app = wizard(monkeypatch, tmp_path, scripted_calibration())

    async def go():
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await calibrated(pilot, app)
            await pilot.press("ctrl+t")
            await wait_for(pilot, lambda: screen.tune is not None and screen.tune.total == 10, "the search")
            await pilot.press("escape")
            await wait_for(pilot, lambda: not screen.running, "the stop")
            assert screen.tune.state == "stopped" and "partial: best so far" in screen.steps_text().plain
            assert screen.profile_to_save()["models"][FP].get("tuned") is None
            monkeypatch.setattr("s2moe.engine.measure.tune.run_tune", scripted_tune(calls, fail=True))
            await pilot.press("ctrl+t")
            await wait_for(pilot, lambda: screen.tune.state == "failed" and not screen.running, "the failure")
            text = screen.steps_text().plain
            assert "✖ tune" in text and "failed: llama_decode returned -1" in text and "RuntimeError" not in text
            screen.query_one("#cal-tune-minutes").value = "soon"
            await pilot.press("ctrl+t")
            await pilot.pause()
            assert len(calls) == 2 and screen.tune.state == "failed"  # refused: no third run

    asyncio.run(go())


def test_tuning_needs_a_calibration_first(monkeypatch, tmp_path):
    app = wizard(monkeypatch, tmp_path, scripted_calibration())

    async def go():
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.session.model is not None, "model")
            await pilot.press("f3")
            screen = app.screen
            assert screen.query_one("#cal-tune").disabled
            screen.action_tune()
            await pilot.pause()
            assert screen.tune is None

    asyncio.run(go())


def test_a_failing_cold_worker_reports_its_reason_as_data(tmp_path):
    """The budget step's worker says why it failed in a message of its own, not as a traceback's last line
    that the wizard would have to strip a class name from."""
    import json
    import subprocess
    import sys

    gone = tmp_path / "gone.gguf"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "s2moe.engine.measure.calibration_worker",
            "--cold-worker",
            json.dumps({"model": str(gone), "cap": 8}),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    error = json.loads(out.stdout.strip().splitlines()[-1])["error"]
    assert error == {"kind": "ModelError", "message": f"cannot read model file {gone}: not found"}


def test_the_tuning_step_snapshot(snap_compare, monkeypatch, tmp_path):
    """The wizard once tuning has finished: the candidates plotted by rung, the result under the steps."""
    monkeypatch.setattr("s2moe.engine.measure.tune.run_tune", scripted_tune([]))
    app = wizard(monkeypatch, tmp_path, scripted_calibration())

    async def run_before(pilot):
        from textual.widgets import Input

        screen = await calibrated(pilot, app)
        await pilot.press("ctrl+t")
        await wait_for(
            pilot, lambda: screen.tune is not None and screen.tune.state == "done" and not screen.running, "tuning"
        )
        for widget in screen.query(Input):
            widget.cursor_blink = False
        app.clear_notifications()
        await pilot.pause()

    assert snap_compare(app, terminal_size=(120, 40), run_before=run_before)


def test_a_budget_beyond_the_machine_s_memory_is_refused_before_calibrating(monkeypatch, tmp_path):
    """As on the command line: a limit larger than the machine binds nothing, and the steps before the budget's
    would have run for minutes first."""
    from s2moe.engine.offload.procfs import meminfo

    calls = []

    def calibration(model_path, **kw):
        calls.append(kw)
        yield from ()

    app = wizard(monkeypatch, tmp_path, calibration)

    async def go():
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.session.model is not None, "model")
            await pilot.press("f3")
            screen = app.screen
            screen.query_one("#cal-budget").value = f"{-(-4 * meminfo()['MemTotal'] // (1 << 30))}G"
            await pilot.press("ctrl+r")
            await pilot.pause(0.5)
            assert calls == []
            assert any("more than this machine's memory" in n.message for n in app._notifications)

    asyncio.run(go())
