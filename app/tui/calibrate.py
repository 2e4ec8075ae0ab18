"""The calibration wizard: the steps of `s2moe calibrate`, what each measures and why, the cost-model fit,
then (optionally) `s2moe tune`'s search with its candidates plotted live, then save the result as a named
profile."""

from __future__ import annotations

import copy
import time

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Footer, Input, Label, ProgressBar, Static

from ...engine.decoding.gpu import Placement
from ...engine.errors import S2MoEError
from ...engine.measure import tune as engine_tune
from ...engine.measure.calibration_events import CalibrationDone, StepProgress, StepResult, StepStarted
from ...engine.measure.calibration_process import run_calibration_beside_budget
from ...engine.measure.tune import (
    TuneDone,
    TuneJointQuality,
    TuneMeasured,
    TuneMemoryQuality,
    TuneProgress,
    TuneQuality,
    TuneStarted,
)
from ...engine.offload import Budget
from ...engine.profiles import cost_for_model, save_profile, tuned_condition
from .calibrate_steps import (
    FIELDS,
    TUNE_MINUTES,
    TUNE_MINUTES_BUDGETED,
    TUNE_PROMPTS,
    StepState,
    TuneState,
    plain_words,
    step_outcome,
    stopping_text,
    tune_minutes,
)
from .calibrate_widgets import ConfirmSave, FitPlot, TunePlot
from .messages import EngineFailed, JobEnded, JobEvent, engine_ready, run_engine_job
from .widgets import NavBar

INTRO = (
    "Calibration measures this device's cost constants for the loaded model: the time of a plain "
    "decoding step (T_AR), of a draft step (C_draft), and how verification time grows with distinct "
    "experts (T_exp) and tokens (T_tok). Routing-aware expansion uses them to decide how far to draft. "
    "The fit of the verification cost model is plotted when the regression step ends."
)

clock = time.monotonic  # the wizard's clock for how long measurements take (tests pass their own)


class CalibrateScreen(Screen):
    HELP_TITLE = "Calibrate"
    # Under 80 columns the form and the plots stack: side by side, each input would be 8 cells wide.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (80, "-wide")]
    AUTO_FOCUS = "#cal-name"
    BINDINGS = [
        Binding("ctrl+r", "start", "Run", tooltip="Start the calibration"),
        Binding("ctrl+t", "tune", "Tune", tooltip="After calibration: search the fastest decoding settings"),
        Binding("escape", "stop", "Stop", tooltip="Stop the calibration or tuning after the current measurement"),
        Binding("ctrl+s", "save", "Save", tooltip="Save the result as a named profile and make it active"),
    ]

    def __init__(self, **kw):
        super().__init__(**kw)
        self.steps: dict[int, StepState] = {}
        self.running = False
        self.result: dict | None = None
        self.saved_path = None
        self.profile_step: StepState | None = None  # the step that reports where the profile was written
        self.fit: dict | None = None
        self.n_steps = 0
        self.tune: TuneState | None = None
        # when the running job's last event came, the longest gap between two, and when a stop was asked for:
        # what "stopping after the current measurement" can honestly say about how long that takes
        self.last_event_t: float | None = None
        self.longest_gap_s: float | None = None
        self.stop_asked_t: float | None = None
        self.stop_timer = None

    def compose(self) -> ComposeResult:
        yield NavBar("calibrate", id="navbar")
        with Horizontal(id="cal-body"):
            with VerticalScroll(id="cal-left", can_focus=False):  # its fields take the focus and scroll it
                yield Static(INTRO, id="cal-intro")
                with Horizontal(classes="form-row"):
                    yield Label("Profile name", classes="form-label")
                    yield Input(placeholder="e.g. my-laptop", id="cal-name")
                with Horizontal(classes="form-row"):
                    yield Label("Memory budget", classes="form-label")
                    yield Input(placeholder="auto or 800M", id="cal-budget")
                with Horizontal(classes="form-row"):
                    yield Label("Tuning minutes", classes="form-label")
                    yield Input(
                        placeholder=f"{TUNE_MINUTES:g} ({TUNE_MINUTES_BUDGETED:g} budgeted)",
                        id="cal-tune-minutes",
                        type="number",
                    )
                with Horizontal(classes="button-row"):
                    yield Button("Run", variant="primary", id="cal-run")
                    yield Button("Tune", id="cal-tune")
                    yield Button("Stop", id="cal-stop")
                    yield Button("Save", variant="success", id="cal-save", tooltip="Save as a named profile (Ctrl+S)")
                yield ProgressBar(total=1, show_eta=False, id="cal-progress")
                yield Static("", id="cal-steps")
            with Vertical(id="cal-right"):
                yield FitPlot(id="cal-fit")
                yield TunePlot(id="cal-tune-plot")
        yield Footer()

    def on_mount(self) -> None:
        self.app.register_view(self)
        if self.app.session.budget is not None:
            # an app run under a budget is calibrated for that budget unless the user says otherwise
            self.query_one("#cal-budget", Input).value = self.app.session.budget
        self.update_state()

    def adapt_to_model(self) -> None:
        self.update_state()

    def update_state(self) -> None:
        # once the steps run, they (with their own descriptions) take the intro's place
        self.query_one("#cal-intro", Static).display = not self.steps
        self.query_one("#cal-run", Button).disabled = self.running
        self.query_one("#cal-tune", Button).disabled = self.result is None or self.running
        self.query_one("#cal-stop", Button).disabled = not self.running
        self.query_one("#cal-save", Button).disabled = self.result is None or self.running
        self.query_one("#cal-steps", Static).update(self.steps_text())
        self.refresh_bindings()

    def check_action(self, action: str, parameters) -> bool | None:
        if action == "start":
            return None if self.running else True
        if action == "stop":
            return True if self.running else None
        if action in ("save", "tune"):
            return True if (self.result is not None and not self.running) else None
        return True

    def steps_text(self) -> Text:
        text = Text()
        for step in sorted(self.steps.values(), key=lambda s: s.index):
            mark = {"done": "⚠" if step.flags else "✔", "failed": "✖", "skipped": "–"}.get(step.state, "▶")
            style = {"running": "bold", "failed": "bold red", "done": "yellow" if step.flags else ""}.get(
                step.state, ""
            )
            text.append(f"{mark} {step.index}/{self.n_steps or len(self.steps)} {step.name}\n", style=style)
            if step.description:
                text.append(f"   {step.description}\n", style="dim")
            if step.state == "running" and step.total:
                text.append(f"   {step.done}/{step.total}\n", style="dim")
            if step.state == "failed":
                text.append(f"   failed: {step.reason}\n", style="red")
            elif step.state == "skipped":
                text.append(f"   skipped: {step.reason}\n", style="dim")
            if step.summary:
                text.append(f"   {step.summary}\n")
            for flag in step.flags:
                text.append(f"   ⚠ {flag}\n", style="yellow")
        if self.tune is not None:
            self.tune_text(text)
        if self.stop_asked_t is not None and self.running:
            text.append(
                "\n" + stopping_text(self.longest_gap_s, clock() - (self.last_event_t or self.stop_asked_t)),
                style="bold",
            )
            return text
        if self.result is not None and self.tune is not None and self.tune.state == "stopped":
            text.append(
                "\nTuning stopped: the profile would get no tuned settings. Ctrl+T tunes again (longer "
                "Tuning minutes search more); Ctrl+S saves the calibration alone.",
                style="bold",
            )
            return text
        if self.result is not None and not (self.tune is not None and self.tune.state == "running"):
            failed = self.failed_steps()
            then = (
                " Ctrl+T (Tune) first searches the fastest decoding settings."
                if self.tune is None
                else " The profile records the tuned settings."
                if self.tune.section
                else ""
            )
            if self.saved_path:
                text.append(
                    f"\nSaved as profile “{self.result_name()}” and made active: {self.saved_path}", style="bold"
                )
            elif failed:
                names = ", ".join(s.name for s in failed)
                text.append(
                    f"\nFinished, but {len(failed)} step{'s' if len(failed) > 1 else ''} failed ({names}). "
                    "Ctrl+S saves what was measured: it asks first, and the profile says what is missing." + then,
                    style="bold",
                )
            else:
                text.append(
                    "\nDone. Press Ctrl+S (or the Save button) to save it as a named profile." + then, style="bold"
                )
        return text

    def tune_text(self, text: Text) -> None:
        t = self.tune
        mark = {"done": "✔", "failed": "✖", "stopped": "–"}.get(t.state, "▶")
        style = {"running": "bold", "failed": "bold red"}.get(t.state, "")
        text.append(f"{mark} tune\n", style=style)
        text.append(
            "   the fastest k_d, draft cap, threshold, α, |E*| and copies within the gating quality "
            "constraint (successive halving)\n",
            style="dim",
        )
        if t.state == "running" and t.total:
            text.append(f"   {t.phase}: {t.done}/{t.total}\n", style="dim")
        if t.state == "failed":
            text.append(f"   failed: {t.reason}\n", style="red")
        for line in t.lines:
            text.append(f"   {line}\n")
        if t.state == "stopped":
            # under the log, where the eye is when the stop comes
            best = t.best_so_far()
            if best is None:
                text.append(
                    "   stopped before the first rung ended: no candidate measured against the defaults\n", style="bold"
                )
            else:
                settings, tok_s, defaults, rung = best
                versus = f", the defaults {defaults:.2f} tok/s ({tok_s / defaults:.3f}×)" if defaults else ""
                text.append(
                    f"   stopped after rung {rung + 1} — partial: best so far "
                    f"{settings.label(self.app.session.budget is not None)} → {tok_s:.2f} tok/s{versus}; "
                    "not confirmed against the defaults, so not saved in the profile\n",
                    style="bold",
                )

    def failed_steps(self) -> list[StepState]:
        return [s for s in sorted(self.steps.values(), key=lambda s: s.index) if s.state == "failed"]

    # -- running ---------------------------------------------------------------------------------
    def action_start(self) -> None:
        if not engine_ready(self):
            return
        session = self.app.session
        try:
            raw = self.query_one("#cal-budget", Input).value
            # auto: the engine sizes it inside the cgroup, as bench and the app do
            budget = Budget.parse(raw) if raw.strip() else None
            if budget is not None:
                budget.check_fits_machine()
        except S2MoEError as e:
            self.notify(str(e), severity="error")
            return
        name = self.query_one("#cal-name", Input).value.strip() or None
        self.steps.clear()
        self.result = None
        self.saved_path = None
        self.tune = None
        self.running = True
        self.job_started()
        self.query_one("#cal-progress", ProgressBar).update(total=1, progress=0)
        self.update_state()
        self.calibrate(session.model_path, budget, name)

    @work(thread=True, group="engine", exit_on_error=False)
    def calibrate(self, model_path: str, budget, name) -> None:
        session = self.app.session
        run_engine_job(
            self,
            session,
            "calibrate",
            # an app started under a budget runs inside its cgroup: the calibration runs beside it, as
            # `s2moe calibrate` would, its resident steps without the budget
            lambda: run_calibration_beside_budget(
                model_path,
                budget=budget,
                name=name,
                save=False,
                n_threads=session.n_threads,
                should_stop=session.stop.is_set,
                placement=session.placement or Placement(),
                n_batch=session.n_batch,
            ),
        )

    def action_stop(self) -> None:
        if self.running and self.stop_asked_t is None:
            self.app.session.stop.set()
            self.stop_asked_t = clock()
            self.show_steps()
            # the wait's line counts up until the job ends
            self.stop_timer = self.set_interval(1.0, self.show_steps)

    def show_steps(self) -> None:
        """Redraw the steps and keep their end (the newest step, the final status) in view."""
        self.query_one("#cal-steps", Static).update(self.steps_text())
        left = self.query_one("#cal-left")
        self.call_after_refresh(left.scroll_end, animate=False)

    def job_started(self) -> None:
        self.last_event_t, self.longest_gap_s, self.stop_asked_t = clock(), None, None

    def action_tune(self) -> None:
        if self.result is None:
            self.notify("run the calibration first: tuning decides with its constants", severity="warning")
            return
        if not engine_ready(self):
            return
        session = self.app.session
        offloaded = session.budget is not None
        raw = self.query_one("#cal-tune-minutes", Input).value.strip()
        minutes = tune_minutes(raw, offloaded)
        if minutes is None:
            self.notify(f"Tuning minutes must be a number of minutes above 0, got {raw!r}", severity="error")
            return
        try:
            cost = cost_for_model(self.result, self.result_fingerprint(), offloaded=offloaded)
        except S2MoEError as e:
            self.notify(plain_words(str(e), FIELDS), title="Cannot tune", severity="error")
            return
        self.tune = TuneState()
        self.running = True
        self.job_started()
        # the bar follows the tuning now, not the calibration that ended at 100 %
        self.query_one("#cal-progress", ProgressBar).update(total=1, progress=0)
        self.update_state()
        self.tune_worker(cost, minutes * 60, offloaded)

    @work(thread=True, group="engine", exit_on_error=False)
    def tune_worker(self, cost, seconds: float, offloaded: bool) -> None:
        from ...engine.measure.prompts import load_prompts

        session = self.app.session

        def events():
            session.load()
            _, prompts = load_prompts(TUNE_PROMPTS, 32)
            context = {
                "budget": session.budget_label() or "none",
                "prompts": TUNE_PROMPTS,
                "threads": session.n_threads,
                "by_app": True,
            }
            yield from engine_tune.run_tune(
                session.decoder,
                prompts,
                cost=cost,
                time_budget_s=seconds,
                should_stop=session.stop.is_set,
                context=context,
            )

        run_engine_job(self, session, "tune", events)

    def result_fingerprint(self) -> str | None:
        """The model of the calibration's result: the loaded one where the result has it."""
        models = (self.result or {}).get("models") or {}
        model = self.app.session.model
        return model.fingerprint if model is not None and model.fingerprint in models else next(iter(models), None)

    def on_tune_event(self, ev) -> None:
        t = self.tune
        if t is None:
            return
        if isinstance(ev, TuneStarted):
            t.lines.append(
                f"{ev.candidates} candidates; defaults {ev.defaults.label(self.app.session.budget is not None)}"
            )
        elif isinstance(ev, (TuneQuality, TuneMemoryQuality, TuneJointQuality)):
            from ..cmd_tune import quality_check_text

            t.lines.append(quality_check_text(ev))
        elif isinstance(ev, TuneProgress):
            t.done, t.total, t.phase = ev.done, ev.total, ev.phase
            self.query_one("#cal-progress", ProgressBar).update(total=max(1, ev.total), progress=ev.done)
        elif isinstance(ev, TuneMeasured):
            t.points[ev.index] = (ev.rung, ev.tok_per_s)
            t.settings[ev.index] = ev.settings
            if ev.index == 0:
                t.defaults_tok_s = ev.tok_per_s
            where = "final comparison" if ev.rung < 0 else f"rung {ev.rung + 1}"
            self.query_one(TunePlot).show_candidates(
                t.points, t.defaults_tok_s, f"Tuning: tok/s per candidate, {where}"
            )
        elif isinstance(ev, TuneDone):
            from ..cmd_tune import summary_lines

            t.state, t.section = "done", ev.section
            t.lines += summary_lines(ev.section, None)[:-1]  # the path comes with the save
            self.saved_path = None  # what was saved before lacks the tuning

    def on_job_event(self, message: JobEvent) -> None:
        ev = message.event
        now = clock()
        if self.last_event_t is not None:
            gap = now - self.last_event_t
            self.longest_gap_s = gap if self.longest_gap_s is None else max(self.longest_gap_s, gap)
        self.last_event_t = now
        if isinstance(
            ev, (TuneStarted, TuneQuality, TuneMemoryQuality, TuneJointQuality, TuneProgress, TuneMeasured, TuneDone)
        ):
            self.on_tune_event(ev)
        elif isinstance(ev, StepStarted):
            first = not self.steps
            self.steps[ev.index] = StepState(ev.index, ev.name, ev.description, total=0)
            if first:
                self.update_state()
            self.n_steps = max(1, ev.total)
            bar = self.query_one("#cal-progress", ProgressBar)
            bar.update(total=self.n_steps, progress=max(0, ev.index - 1))  # steps count from 1
        elif isinstance(ev, StepProgress):
            step = self.steps.get(ev.index)
            if step is not None:
                step.done, step.total = ev.done, ev.total
        elif isinstance(ev, StepResult):
            step = self.steps.setdefault(ev.index, StepState(ev.index, ev.name))
            step.total = 0
            outcome = step_outcome(ev, FIELDS)
            step.state, step.reason, step.flags = outcome.state, outcome.reason, list(outcome.flags)
            step.summary = ev.summary if outcome.state == "done" else outcome.note
            if "path" in ev.data:
                self.profile_step = step
            data = ev.data
            if "measured" in data and "predicted" in data:
                self.fit = data
                self.query_one(FitPlot).show_fit(
                    list(data["measured"]), list(data["predicted"]), data.get("r2"), data.get("mape"), unit="ms"
                )
            bar = self.query_one("#cal-progress", ProgressBar)
            bar.update(progress=ev.index)
        elif isinstance(ev, CalibrationDone):
            self.result = ev.profile
            self.saved_path = ev.path
            bar = self.query_one("#cal-progress", ProgressBar)
            bar.update(progress=bar.total)
            name_box = self.query_one("#cal-name", Input)
            if not name_box.value.strip() and isinstance(ev.profile, dict) and ev.profile.get("name"):
                name_box.value = str(ev.profile["name"])
        self.show_steps()

    def on_engine_failed(self, message: EngineFailed) -> None:
        reason = plain_words(message.text, FIELDS)
        if self.tune is not None and self.tune.state == "running":
            self.tune.state, self.tune.reason = "failed", reason
            self.query_one("#cal-steps", Static).update(self.steps_text())
            self.notify(reason, title="Tuning failed", severity="error", timeout=10)
            return
        for step in self.steps.values():
            if step.state == "running":
                step.state, step.reason = "failed", reason
        self.query_one("#cal-steps", Static).update(self.steps_text())
        self.notify(reason, title="Calibration failed", severity="error", timeout=10)

    def on_job_ended(self, message: JobEnded) -> None:
        self.running = False
        if self.stop_timer is not None:
            self.stop_timer.stop()
            self.stop_timer = None
        if message.job == "tune":
            if self.tune is not None and self.tune.state == "running":
                self.tune.state = "stopped"
            self.update_state()
            self.show_steps()
            return
        if self.result is None and self.steps:
            self.notify("calibration stopped before the end; nothing to save", severity="warning")
        self.update_state()

    # -- saving ------------------------------------------------------------------------------------------
    def result_name(self) -> str:
        name = self.query_one("#cal-name", Input).value.strip()
        if not name and isinstance(self.result, dict):
            name = str(self.result.get("name") or "")
        return name

    def action_save(self) -> None:
        if self.result is None:
            self.notify("run the calibration first", severity="warning")
            return
        name = self.result_name()
        if not name:
            self.notify("type a profile name first", severity="warning")
            self.query_one("#cal-name", Input).focus()
            return
        failed = self.failed_steps()
        if not failed:
            self.save(name)
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self.save(name)

        self.app.push_screen(ConfirmSave(failed), answered)

    def profile_to_save(self) -> dict:
        """The result, with what failed steps did not measure and which values are in doubt recorded in this
        model's block (measured.missing, measured.flagged)."""
        profile = copy.deepcopy(self.result)
        missing = [f"{s.name}: {s.reason}" for s in self.failed_steps()]
        flagged = [f"{s.name}: {flag}" for s in sorted(self.steps.values(), key=lambda s: s.index) for flag in s.flags]
        models = profile.get("models") or {}
        fp = self.result_fingerprint()
        if fp is not None and self.tune is not None and self.tune.section is not None:
            tuned = models[fp].setdefault("tuned", {})
            tuned[tuned_condition(self.app.session.budget is not None)] = copy.deepcopy(self.tune.section)
        if not missing and not flagged:
            return profile
        if fp is not None:
            measured = models[fp].setdefault("measured", {})
            if missing:
                measured["missing"] = missing
            if flagged:
                measured["flagged"] = flagged
        return profile

    def save(self, name: str) -> None:
        try:
            self.saved_path = save_profile(self.profile_to_save(), name)
        except S2MoEError as e:
            self.notify(str(e), title="Not saved", severity="error")
            return
        except OSError as e:
            self.notify(f"cannot write the profile: {e.strerror}", title="Not saved", severity="error")
            return
        self.app.set_profile(name)
        if self.profile_step is not None:
            self.profile_step.summary = f"saved as {name}: {self.saved_path}"
        self.notify(f"saved profile {name}: {self.saved_path}", timeout=6)
        self.update_state()

    @on(Button.Pressed, "#cal-run")
    def _run_pressed(self) -> None:
        self.action_start()

    @on(Button.Pressed, "#cal-tune")
    def _tune_pressed(self) -> None:
        self.action_tune()

    @on(Button.Pressed, "#cal-stop")
    def _stop_pressed(self) -> None:
        self.action_stop()

    @on(Button.Pressed, "#cal-save")
    def _save_pressed(self) -> None:
        self.action_save()

    @on(Input.Submitted, "#cal-name")
    def _name_submitted(self) -> None:
        if self.result is not None:
            self.action_save()
