"""The calibration wizard's widgets: the plots of the cost-model fit and of the tuning candidates' speed, and
the dialog that asks before saving a profile with failed steps."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static
from textual_plotext import PlotextPlot

from .calibrate_steps import StepState


class ConfirmSave(ModalScreen[bool]):
    """Asks before saving a profile that lacks what failed steps would have measured."""

    DEFAULT_CSS = "ConfirmSave { align: center middle; } #confirm-text { padding: 0 0 1 0; }"
    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save anyway")]

    def __init__(self, failed: list[StepState]):
        super().__init__()
        self.failed = failed

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box", classes="dialog"):
            yield Label("Save a profile with failed steps?", classes="dialog-title")
            lines = [f"✖ {s.name}: {s.reason}" for s in self.failed]
            lines.append("The profile will lack what they measure, and say so.")
            yield Static("\n".join(lines), id="confirm-text")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save anyway", variant="warning", id="confirm-save")
                yield Button("Cancel", id="confirm-cancel")

    def on_mount(self) -> None:
        self.query_one("#confirm-cancel").focus()

    def action_save(self) -> None:
        self.dismiss(True)

    def action_cancel(self) -> None:
        self.dismiss(False)

    @on(Button.Pressed, "#confirm-save")
    def _save_pressed(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#confirm-cancel")
    def _cancel_pressed(self) -> None:
        self.dismiss(False)


class FitPlot(PlotextPlot):
    """Measured vs predicted verification time, with the identity line."""

    DEFAULT_CSS = "FitPlot { height: 1fr; min-height: 10; }"

    def show_fit(self, measured, predicted, r2=None, mape=None, unit: str = "ms") -> None:
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        m = [float(x) for x in measured]
        p = [float(x) for x in predicted]
        title = "Verification cost model fit"
        if r2 is not None:
            title += f": R² {r2:.3f}"
        if mape is not None:
            title += f", MAPE {mape:.1%}"
        plt.title(title)
        if m:
            plt.scatter(m, p, label="batches")
            lo, hi = min(m + p), max(m + p)
            plt.plot([lo, hi], [lo, hi], label="ideal")
        plt.xlabel(f"measured {unit}".strip())
        plt.ylabel(f"predicted {unit}".strip())
        self.refresh()

    def on_mount(self) -> None:
        super().on_mount()
        self.plt.title("Verification cost model fit (after the regression step)")


class TunePlot(PlotextPlot):
    """The tuning candidates' speed as the search measures them: tok/s by candidate, one series per rung,
    the defaults' speed as a line."""

    DEFAULT_CSS = "TunePlot { height: 1fr; min-height: 10; }"

    def show_candidates(self, points: dict[int, tuple[int, float]], defaults_tok_s: float | None, title: str) -> None:
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        plt.title(title)
        for rung in sorted({r for r, _ in points.values()}):
            xs = [i for i, (r, _) in sorted(points.items()) if r == rung]
            plt.scatter(xs, [points[i][1] for i in xs], label="final" if rung < 0 else f"rung {rung + 1}")
        if defaults_tok_s:
            plt.hline(defaults_tok_s)
        plt.xlabel("candidate (0: the defaults)")
        plt.ylabel("tok/s")
        self.refresh()

    def on_mount(self) -> None:
        super().on_mount()
        self.plt.title("Tuning: tok/s per candidate (after calibration, Ctrl+T)")
