"""The last bench's traces projected onto a device profile (engine.measure.projection): speed-ups by mode."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, OptionList, Static
from textual.widgets.option_list import Option
from textual_plotext import PlotextPlot

from ...engine.errors import S2MoEError
from ...engine.profiles import list_profiles

BUDGETS = ("none", "auto")


class ProjectionPlot(PlotextPlot):
    DEFAULT_CSS = "ProjectionPlot { height: 1fr; min-height: 8; }"

    def show(self, title: str, modes: list[str], speedups: list[float]) -> None:
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        plt.title(title)
        if modes:
            plt.bar([f"{m} ×{s:.2f}" for m, s in zip(modes, speedups)], speedups)
        self.refresh()


class ProjectionScreen(ModalScreen[None]):
    """Pick a profile (arrows); the traces are replayed under its constants at once. b: the budget."""

    HELP_TITLE = "Projection"
    BINDINGS = [Binding("escape,q", "dismiss", "Close"), Binding("b", "cycle_budget", "Budget")]
    DEFAULT_CSS = """
    ProjectionScreen { align: center middle; }
    #projection-box { width: 100%; height: 100%; border: round $accent; padding: 0 1; }
    #projection-title { height: auto; }
    #projection-profiles { width: 24; height: 1fr; }
    #projection-table { height: auto; }
    """

    def __init__(self, traces: list, repeats: int = 1, **kw):
        super().__init__(**kw)
        self.traces = traces
        self.repeats = repeats  # as the bench ran each prompt: the replay learns across them as it did
        self.budget = BUDGETS[0]
        self.profiles = {e.name: e for e in list_profiles() if e.error is None}
        self.current: str | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="projection-box"):
            yield Static("", id="projection-title")
            with Horizontal():
                yield OptionList(*[Option(name, id=name) for name in self.profiles], id="projection-profiles")
                with Vertical():
                    yield ProjectionPlot(id="projection-plot")
                    yield Static("", id="projection-table")
        yield Footer()

    def on_mount(self) -> None:
        self.update_title()
        profiles = self.query_one(OptionList)
        profiles.focus()
        if self.profiles:
            profiles.highlighted = 0

    def update_title(self) -> None:
        tokens = sum(t.n_tokens for t in self.traces)
        self.query_one("#projection-title", Static).update(
            f"PROJECTION, not a measurement: {len(self.traces)} trace(s) of the last bench"
            f"{f' × {self.repeats} repeats' if self.repeats > 1 else ''}, {tokens} tokens · "
            f"budget {self.budget} (b) · ↑↓ profile · Esc close"
        )

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        self.current = event.option.id
        self.show()

    def action_cycle_budget(self) -> None:
        self.budget = BUDGETS[(BUDGETS.index(self.budget) + 1) % len(BUDGETS)]
        self.update_title()
        self.show()

    def show(self) -> None:
        from ...engine.measure.projection import project

        plot = self.query_one(ProjectionPlot)
        table = self.query_one("#projection-table", Static)
        if self.current is None:
            return
        entry = self.profiles[self.current]
        try:
            p = project(
                self.traces, entry.data, budget=None if self.budget == "none" else self.budget, repeats=self.repeats
            )
        except S2MoEError as e:
            plot.show(f"{entry.name}: no projection", [], [])
            table.update(str(e))
            return
        modes = list(p.modes)
        plot.show(f"projected speed-up over ar on {entry.name}", modes, [r.speedup or 0.0 for r in p.modes.values()])
        lines = [
            f"{m:<8} {r.tok_per_s:>9.1f} tok/s  ×{r.speedup or 0:.2f}  fetched {r.fetched_per_token:.1f}/tok"
            + (f"  copied {r.copies_accepted}/{r.copied}" if r.copied else "")
            for m, r in p.modes.items()
        ]
        table.update("\n".join(lines + [p.budget, f"beyond the constants: {p.terms}"]))
