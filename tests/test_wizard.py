"""The calibration wizard is honest about failed steps: ✖ with the reason in plain words, doubtful fits flagged,
and saving with failed steps asks first and records what is missing."""

from __future__ import annotations

import asyncio
import time
from inspect import signature

import yaml
from test_app_support import FakeDecoder

from s2moe.app.tui.app import S2MoEApp
from s2moe.app.tui.calibrate import FIELDS, ConfirmSave, Outcome, plain_words, step_outcome
from s2moe.engine.calibrate import CalibrationDone, StepResult, StepStarted
from s2moe.engine.calibrate import run_calibration as REAL_RUN_CALIBRATION

FP = "0123456789abcdef"  # the fake model's fingerprint
WORKER_ERROR = ("s2moe.engine.errors.ConfigError: cannot lower the memory limit to the auto budget 1.2 GiB: the "
                "process holds 1.5 GiB it cannot give back (Device or resource busy); give the budget a size instead")
BUDGET_FAILED = f"failed: {WORKER_ERROR}"


def results():
    """A calibration's step results: a fit that explains little with a T_exp of zero, a failed budget step."""
    return [
        StepResult(1, "bandwidth", "memory 10.0 GB/s", {"memory_bandwidth_gb_s": 10.0}),
        StepResult(2, "steps", "T_AR 0.51 ms · draft step 0.46 ms", {"t_ar_ms": 0.51, "c_draft_ms": 0.46}),
        StepResult(3, "cost model", "T_exp 0.0000 ms · R² 0.290",
                   {"measured": [1.0, 1.1, 1.2], "predicted": [1.1, 1.1, 1.1], "r2": 0.29, "mape": 0.2,
                    "t_exp_ms": 0.0, "t_tok_ms": 0.1, "intercept_ms": 0.4}),
        StepResult(4, "hot experts", "32 most routed experts", {"hot_experts": []}),
        StepResult(5, "budget", f"{BUDGET_FAILED}; cold T_exp derived from storage bandwidth",
                   {"skipped": BUDGET_FAILED}),
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
        profile = {"schema": 1, "name": name, "kind": "measured", "device": {"name": "test cpu", "kind": "cpu"},
                   "models": {FP: {"model": "fake-moe.gguf", "t_ar_ms": 0.51, "c_draft_ms": 0.46, "t_exp_ms": 0.0,
                                   "t_tok_ms": 0.1, "intercept_ms": 0.4, "measured": {"by": "s2moe calibrate"}}}}
        yield StepResult(6, "profile", "not saved (save=False)", {"path": None})
        yield CalibrationDone(profile, None)

    return run_calibration


def test_plain_words_drop_class_names_and_name_the_field():
    assert plain_words(WORKER_ERROR, FIELDS).startswith("cannot lower the memory limit to the auto budget")
    assert plain_words("BudgetUnavailable: no cgroup; raise --budget", FIELDS) == \
        "no cgroup; raise the Memory budget field"
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
    skipped = step_outcome(StepResult(5, "budget", "skipped: no memory budget given",
                                      {"skipped": "skipped: no memory budget given"}))
    assert skipped == Outcome("skipped", "no memory budget given")


async def wait_for(pilot, cond, what, timeout=20.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        await pilot.pause(0.02)


def wizard(monkeypatch, tmp_path, calibration):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setattr("s2moe.engine.calibrate.run_calibration", calibration)
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


def test_cli_calibrate_marks_failed_steps_and_doubtful_fits(monkeypatch, tmp_path, capsys):
    from s2moe.app.cli import main

    monkeypatch.setattr("s2moe.engine.calibrate.run_calibration", scripted_calibration())
    assert main(["calibrate", "--model", "fake-moe.gguf", "--no-save", "--no-plot"]) == 0
    err = " ".join(capsys.readouterr().err.split())  # rich wraps at the console's width
    assert f"[5] budget: ✖ failed: {plain_words(WORKER_ERROR)} (cold T_exp derived from storage bandwidth)" in err
    assert "ConfigError" not in err
    assert "⚠ fit R² 0.29 is below 0.8" in err and "⚠ T_exp 0.0000 ms is not positive" in err
    assert "warning: 1 step failed (budget): the profile lacks what they measure" in err
