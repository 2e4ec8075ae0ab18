"""The bench screen: run decoding modes on a prompt set, show the table and plots."""

from __future__ import annotations

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Footer, Input, Label, ProgressBar, Select, SelectionList, Static, TextArea
from textual_plotext import PlotextPlot

from ...engine.decoding.generation_config import GenerationConfig
from ...engine.errors import ConfigError, S2MoEError
from ...engine.measure import bench as engine_bench
from ...engine.measure.bench_results import BenchDone, BenchProgress, BenchRow, BenchTrace, judgements
from ...engine.measure.prompts import load_prompts
from ..options import SAMPLING_VALUES, sampling_value
from .chat_settings import engine_modes
from .dialogs import SAMPLING_LABELS
from .messages import EngineFailed, JobEnded, JobEvent, engine_ready, run_engine_job
from .widgets import CheckList, Column, FittedTable, NavBar

DEFAULT_PROMPTS = "Once upon a time\nThe capital of France is\ndef fibonacci(n):"
DEFAULT_MODES = ("ar", "s2moe")
PROMPT_SETS = ("natural", "humaneval")  # the named sets engine.measure.prompts.load_prompts knows
# fixed widths, so the table looks the same however rows arrive; at 80 columns the last ones give way
TABLE_COLUMNS = (
    Column("mode", "mode", 10, 0),
    Column("tok_s", "tok/s", 7, 2),
    Column("tok_range", "tok/s range", 11, 8),
    Column("x_ar", "× ar", 5, 1),
    Column("x_range", "× ar range", 10, 3),
    Column("accept", "accept", 6, 4),
    Column("draft", "draft", 5, 5),
    Column("reuse", "reuse", 5, 6),
    Column("rollbacks", "rollb.", 6, 9),
    Column("same", "= ar", 4, 7),
)
DEFAULT_REPEATS = 3
# the sampler settings in the form's narrow labels (the settings dialog's longer ones are the tooltips)
SAMPLING_FORM = {
    "temperature": "Temperature",
    "seed": "Seed (-1 rand)",
    "top_k": "Top-k",
    "top_p": "Top-p",
    "min_p": "Min-p",
    "repeat_penalty": "Repeat penalty",
    "repeat_last_n": "Penalty window",
}
DEFAULT_SAMPLING = GenerationConfig()


def _traceable(info) -> bool:
    """Whether the model can record the traces a projection replays (a MoE model that can self-draft)."""
    from ...engine.decoding.generation_config import GenerationConfig

    try:
        GenerationConfig(mode="s2moe", trace=True).validate(info)
    except ConfigError:
        return False
    return True


def _fmt(v, spec=".2f", none="—"):
    return none if v is None else format(v, spec)


def _label(r: BenchRow) -> str:
    return r.mode if r.budget in ("none", None) else f"{r.mode}@{r.budget}"


class BenchPlot(PlotextPlot):
    """tokens/s by mode, with the speed-up over ar in the labels."""

    DEFAULT_CSS = "BenchPlot { height: 1fr; min-height: 8; }"
    TITLE = "tokens/s by mode (× ar)"

    def show_rows(self, rows: list[BenchRow]) -> None:
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        plt.title(self.TITLE)
        if rows:
            self.plot_rows(rows)
        self.refresh()

    def plot_rows(self, rows: list[BenchRow]) -> None:
        labels = [f"{_label(r)} ×{r.speedup_text}" if r.speedup_vs_ar is not None else _label(r) for r in rows]
        self.plt.bar(labels, [float(r.tok_per_s) for r in rows])

    def on_mount(self) -> None:
        super().on_mount()
        self.plt.title(self.TITLE)


class BenchAcceptPlot(BenchPlot):
    """What each mode's speculation did: tokens per target pass and reuse ratio."""

    # the legend is in the title: plotext draws a legend inside the plot, over the bars
    TITLE = "accept length (left bar), reuse ratio (right) by mode"

    def plot_rows(self, rows: list[BenchRow]) -> None:
        labels = [_label(r) for r in rows]
        accept = [float(r.accept_len) for r in rows]
        reuse = [float(r.reuse_ratio) if r.reuse_ratio is not None else 0.0 for r in rows]
        self.plt.multiple_bar(labels, [accept, reuse])


class BenchScreen(Screen):
    HELP_TITLE = "Bench"
    # Under 100 columns the form and the results stack: side by side the form keeps its 30 columns and the
    # results get what is left, too narrow for the table's columns (fewer than a stacked 60 would show).
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]
    AUTO_FOCUS = "#bench-prompts"
    BINDINGS = [
        Binding("ctrl+r", "start", "Run", tooltip="Run the selected modes on the prompts"),
        Binding("escape", "stop", "Stop", tooltip="Stop after the current generation"),
        Binding("ctrl+s", "export", "Save", tooltip="Save the results as JSON (.json) or CSV (.csv)"),
        # not F6, the chat's Mode key: no key means two things across the screens
        Binding("ctrl+f", "project", "Project", tooltip="Project the last bench's traces onto a device profile"),
    ]

    def __init__(self, **kw):
        super().__init__(**kw)
        self.running = False
        self.rows: list[BenchRow] = []
        self.done: BenchDone | None = None
        self.traces: list = []  # the last bench's decoding traces (engine.measure.trace), for the projection

    def mode_choices(self) -> list[str]:
        modes = list(engine_modes())
        for name in engine_bench.ABLATION:
            if name not in modes:
                modes.append(name)
        return modes

    def compose(self) -> ComposeResult:
        yield NavBar("bench", id="navbar")
        with Horizontal(id="bench-body"):
            with VerticalScroll(id="bench-form", can_focus=False):  # its fields take the focus and scroll it
                yield Static("", id="bench-intro")
                yield Label("Prompt set")
                yield Select(
                    [("typed below", "custom")] + [(s, s) for s in PROMPT_SETS],
                    value="custom",
                    allow_blank=False,
                    id="bench-set",
                )
                with Horizontal(classes="form-row"):
                    yield Label("Max prompts", classes="form-label")
                    yield Input("4", id="bench-max", type="integer")
                yield Label("Prompts (one per line)")
                yield TextArea(DEFAULT_PROMPTS, id="bench-prompts", soft_wrap=True, show_line_numbers=False)
                yield Label("Modes (Space toggles)")
                yield CheckList(id="bench-modes")
                with Horizontal(classes="form-row"):
                    yield Label("Tokens", classes="form-label")
                    yield Input("32", id="bench-n", type="integer")
                with Horizontal(classes="form-row"):
                    yield Label("Repeats", classes="form-label")
                    yield Input(
                        str(DEFAULT_REPEATS),
                        id="bench-repeats",
                        type="integer",
                        tooltip="Times the whole prompt set runs; the table shows the median and range",
                    )
                yield Label("Sampling (T 0 = greedy)")
                for key, label in SAMPLING_FORM.items():
                    with Horizontal(classes="form-row"):
                        yield Label(label, classes="form-label")
                        yield Input(
                            str(getattr(DEFAULT_SAMPLING, key)),
                            id=f"bench-{key}",
                            tooltip=f"{SAMPLING_LABELS[key]}: as {SAMPLING_VALUES[key][0]}",
                        )
                with Horizontal(classes="button-row"):
                    yield Button("Run", variant="primary", id="bench-run")
                    yield Button("Stop", id="bench-stop")
            with Vertical(id="bench-out"):
                yield ProgressBar(total=1, show_eta=False, id="bench-progress")
                yield Static("", id="bench-status")
                yield FittedTable(TABLE_COLUMNS, id="bench-table", zebra_stripes=True, cursor_type="row")
                yield Static("", id="bench-verdict")
                yield BenchPlot(id="bench-plot")
                yield BenchAcceptPlot(id="bench-accept-plot")
        yield Footer()

    def on_mount(self) -> None:
        self.app.register_view(self)
        modes = self.query_one("#bench-modes", SelectionList)
        for m in self.mode_choices():
            modes.add_option((m, m, m in DEFAULT_MODES))
        self.update_state()

    def adapt_to_model(self) -> None:
        self.update_state()

    def update_state(self) -> None:
        self.query_one("#bench-intro", Static).update(
            "Runs every selected mode on each prompt in turn (ar is always included as the reference), after an "
            "untimed warm-up; repeats give each figure its range."
        )
        self.query_one("#bench-run", Button).disabled = self.running
        self.query_one("#bench-stop", Button).disabled = not self.running
        self.refresh_bindings()

    def check_action(self, action: str, parameters) -> bool | None:
        if action == "start":
            return None if self.running else True
        if action == "stop":
            return True if self.running else None
        if action == "project":
            return True if self.traces and not self.running else None
        return True

    def request(self) -> tuple[list[str], list[str], int, str]:
        raw_max = self.query_one("#bench-max", Input).value.strip() or "0"
        try:
            max_prompts = int(raw_max)
        except ValueError:
            raise ConfigError(f"max prompts: {raw_max!r} is not a whole number") from None
        spec = self.query_one("#bench-set", Select).value
        if spec == "custom":
            name = "custom"
            prompts = [p for p in self.query_one("#bench-prompts", TextArea).text.splitlines() if p.strip()]
            prompts = prompts[:max_prompts] if max_prompts > 0 else prompts
        else:
            name, prompts = load_prompts(spec, max_prompts if max_prompts > 0 else None)
        modes = list(self.query_one("#bench-modes", SelectionList).selected)
        raw = self.query_one("#bench-n", Input).value.strip()
        if not prompts:
            raise ConfigError("type at least one prompt")
        if not modes:
            raise ConfigError("select at least one mode")
        try:
            n = int(raw)
        except ValueError:
            raise ConfigError(f"tokens: {raw!r} is not a whole number") from None
        if not 1 <= n <= 4096:
            raise ConfigError("tokens must be between 1 and 4096")
        return prompts, modes, n, name

    def repeats(self) -> int:
        raw = self.query_one("#bench-repeats", Input).value.strip()
        try:
            repeats = int(raw)
        except ValueError:
            raise ConfigError(f"repeats: {raw!r} is not a whole number") from None
        if not 1 <= repeats <= 100:
            raise ConfigError("repeats must be between 1 and 100")
        return repeats

    def sampling(self) -> dict:
        """The sampler settings of the form, as GenerationConfig fields (read as the CLI's flags are)."""
        return {key: sampling_value(key, self.query_one(f"#bench-{key}", Input).value) for key in SAMPLING_FORM}

    def action_start(self) -> None:
        if not engine_ready(self):
            return
        try:
            prompts, modes, n, prompt_set = self.request()
            repeats = self.repeats()
            sampling = self.sampling()
        except S2MoEError as e:
            self.notify(e.worded(SAMPLING_FORM), severity="error")
            return
        self.rows = []
        self.done = None
        self.traces = []
        self.query_one(FittedTable).set_rows([])
        for plot in self.query(BenchPlot):
            plot.show_rows([])
        self.query_one("#bench-progress", ProgressBar).update(total=1, progress=0)
        self.query_one("#bench-status", Static).update("starting…")
        self.query_one("#bench-verdict", Static).update("")
        self.running = True
        self.update_state()
        self.bench(prompts, modes, n, prompt_set, repeats, sampling)

    @work(thread=True, group="engine", exit_on_error=False)
    def bench(
        self,
        prompts: list[str],
        modes: list[str],
        n: int,
        prompt_set: str = "custom",
        repeats: int = 1,
        sampling: dict | None = None,
    ) -> None:
        session = self.app.session
        run_bench = engine_bench.run_bench

        def events():
            session.load()  # the loaded model is reused: the session lock is held, nothing else uses it
            return run_bench(
                session.model_path,
                prompts=prompts,
                modes=modes,
                n_tokens=n,
                n_threads=session.n_threads,
                should_stop=session.stop.is_set,
                decoder=session.decoder,
                prompt_set=prompt_set,
                repeats=repeats,
                base=GenerationConfig(**(sampling or {})),
                trace=_traceable(session.decoder.info),
            )

        run_engine_job(self, session, "bench", events)

    def action_export(self) -> None:
        from .export import BENCH_FORMATS, ExportDialog, default_path, export_bench

        if self.done is None:
            self.notify("nothing to save yet: run the bench first", severity="warning")
            return
        done = self.done

        def save(path: str | None) -> None:
            if path is None:
                return
            try:
                target = export_bench(path, done)
            except (S2MoEError, OSError) as e:
                self.notify(
                    str(e) if isinstance(e, S2MoEError) else f"cannot write {path}: {e.strerror}",
                    title="Not saved",
                    severity="error",
                    timeout=8,
                )
                return
            self.query_one("#bench-status", Static).update(f"saved to {target}")
            self.notify(f"saved to {target}", title="Bench results saved", timeout=10)

        self.app.push_screen(
            ExportDialog("Save the bench results", default_path("bench", ".json"), BENCH_FORMATS), save
        )

    def action_stop(self) -> None:
        if self.running:
            self.app.session.stop.set()
            self.query_one("#bench-status", Static).update("stopping…")

    def action_project(self) -> None:
        from .projection import ProjectionScreen

        repeats = int(self.done.config.get("repeats", 1)) if self.done is not None else 1
        self.app.push_screen(ProjectionScreen(self.traces, repeats))

    def on_job_event(self, message: JobEvent) -> None:
        ev = message.event
        if isinstance(ev, BenchTrace):
            self.traces.append(ev.trace)
        elif isinstance(ev, BenchProgress):
            self.query_one("#bench-progress", ProgressBar).update(total=max(1, ev.total), progress=ev.done)
            if ev.warmup:
                text = f"warm-up (untimed): {ev.mode}"
            else:
                text = f"{ev.done}/{ev.total}: {ev.mode} on prompt {ev.prompt_index + 1}"
                if ev.repeat:
                    text += f", repeat {ev.repeat + 1}"
            self.query_one("#bench-status", Static).update(text)
        elif isinstance(ev, BenchDone):
            self.done = ev
            self.rows = list(ev.rows)
            self.show_rows()
            self.show_verdict(ev)
            status = "done"
            repeats = max((r.repeats for r in self.rows), default=1)
            if repeats > 1:
                status += f" · medians of {repeats} repeats"
            fit = ev.cost_model.get("r2")
            if fit is not None:
                status += f" · verification cost fit R² {fit:.3f}"
            if any(r.decoded_as_ar for r in self.rows):
                status += " · ≈ decoded as ar (no drafts, same tokens): that ratio is noise"
            elif any(r.within_noise and r.mode != "ar" for r in self.rows):
                status += " · ≈ not significant: within the run-to-run spread of ar's speed"
            if ev.config.get("greedy") is False:
                status += (
                    f" · sampled at T={ev.config['temperature']:g}, prompt i with seed {ev.config['seed']} + i "
                    "in every mode (= ar: ar's tokens)"
                )
            self.query_one("#bench-status", Static).update(status)

    def show_verdict(self, done: BenchDone) -> None:
        """The fastest mode, each mode against ar, and a warning where the machine was busy (engine.measure.speed)."""
        lines = [
            line for budget, judgement in judgements(done.rows, done.config.get("load")) for line in judgement.lines()
        ]
        verdict = self.query_one("#bench-verdict", Static)
        verdict.update("\n".join(lines))
        verdict.set_class(any(line.startswith("warning:") for line in lines), "-warning")

    def show_rows(self) -> None:
        self.query_one(FittedTable).set_rows(
            [
                (
                    None,
                    {
                        "mode": _label(r),
                        "tok_s": _fmt(r.tok_per_s, ".1f"),
                        "tok_range": r.tok_per_s_range or "—",
                        "x_ar": r.speedup_text,
                        "x_range": r.speedup_range or "—",
                        "accept": _fmt(r.accept_len),
                        "draft": _fmt(r.draft_len),
                        "reuse": _fmt(r.reuse_ratio),
                        "rollbacks": str(r.rollbacks),
                        "same": _fmt(r.identical_to_ar, ".0%"),
                    },
                )
                for r in self.rows
            ]
        )
        for plot in self.query(BenchPlot):
            plot.show_rows(self.rows)

    def on_engine_failed(self, message: EngineFailed) -> None:
        self.notify(message.text, title="Bench failed", severity="error", timeout=10)

    def on_job_ended(self, message: JobEnded) -> None:
        self.running = False
        if self.done is None:
            self.query_one("#bench-status", Static).update("stopped" if self.rows == [] else "stopped early")
        self.update_state()

    @on(Button.Pressed, "#bench-run")
    def _run_pressed(self) -> None:
        self.action_start()

    @on(Button.Pressed, "#bench-stop")
    def _stop_pressed(self) -> None:
        self.action_stop()
