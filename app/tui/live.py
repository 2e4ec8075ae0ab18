"""The live panel beside the chat: what the last iterations did, as compact tiles and textual-plotext plots.

LiveState collects data from engine events (cheap, per event); the panel redraws from it at most a few
times a second, so a fast engine never floods the UI with plot renders. The tiles at the top put every
figure on one screen (one line each, with a sparkline or one bar per layer); the plots below them are the
same data in full, and Ctrl+G shows the panel full-screen to read them. The state lives in live_state,
the tiles and the tree view in live_tiles; this module holds the widgets: the plots and the panel.
"""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static
from textual_plotext import PlotextPlot

from .live_state import LiveState
from .live_tiles import FirstFit, Tiles, TreeView


class LivePlot(PlotextPlot):
    """A plot that redraws itself from a LiveState."""

    DEFAULT_CSS = """
    LivePlot { height: 11; width: 1fr; }
    """
    TITLE = ""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.draws = 0  # how many times data was plotted (tests read it)
        self.points = 0  # data points in the last draw

    def draw(self, s: LiveState) -> None:
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        plt.title(self.TITLE)
        self.points = self.plot_data(s)
        self.draws += 1
        self.refresh()

    def plot_data(self, s: LiveState) -> int:  # pragma: no cover - overridden
        return 0

    def on_mount(self) -> None:
        super().on_mount()
        self.plt.title(self.TITLE)


# Legends go into the titles, each series told apart by its marker (not by colour alone): plotext draws a
# legend inside the plot, over the data. Bars get a width of their own because plotext's default one
# makes neighbouring bars run into a single band.
BAR = 0.5
SECOND = "░"  # the marker of a second series of bars


def layer_bars(plt, first: list[float], second: list[float] | None = None) -> None:
    xs = list(range(len(first)))
    if second is None:
        plt.bar(xs, first, width=BAR)
    else:
        plt.multiple_bar(xs, [first, second], width=0.7, marker=["█", SECOND])
    plt.xticks(xs, [str(x) for x in xs] if len(xs) <= 16 else None)
    plt.ylim(0, 1)


class ReusePlot(LivePlot):
    TITLE = "Distinct experts per layer"

    def plot_data(self, s):
        plt = self.plt
        if not s.reuse_last:
            return 0
        if s.reuse_other:
            plt.title(f"Distinct experts: last █, {s.reuse_other_label} {SECOND}")
        layer_bars(plt, s.reuse_last, s.reuse_other)
        plt.xlabel("layer (fewer = more shared)")
        return len(s.reuse_last)


class UtilityPlot(LivePlot):
    TITLE = f"Draft utility: kept █, dropped {SECOND}"

    def plot_data(self, s):
        plt = self.plt
        values = [(i + 1, u, kept) for i, (u, kept, _p) in enumerate(s.utilities) if u is not None]
        if not values:
            if not s.utilities:
                return 0
            # No utility rule in this mode: show each candidate's chain probability p_i instead.
            plt.title(f"Chain probability: kept █, dropped {SECOND}")
            values = [(i + 1, p, kept) for i, (_u, kept, p) in enumerate(s.utilities)]
            self.candidates(values)
            plt.ylim(0, 1)
            plt.xlabel("candidate · no utility rule")
            return len(values)
        self.candidates(values)
        plt.hline(s.threshold)
        plt.xlabel(f"candidate · threshold {s.threshold:g} (the line)")
        return len(values)

    def candidates(self, values) -> None:
        plt = self.plt
        kept = [(i, v) for i, v, k in values if k]
        dropped = [(i, v) for i, v, k in values if not k]
        if kept:
            plt.bar([i for i, _ in kept], [v for _, v in kept], width=BAR)
        if dropped:
            plt.bar([i for i, _ in dropped], [v for _, v in dropped], width=BAR, marker=SECOND)
        xs = [i for i, _, _ in values]
        plt.xticks(xs, [str(x) for x in xs] if len(xs) <= 16 else None)


class SpeedPlot(LivePlot):
    TITLE = "Tokens/s"

    def plot_data(self, s):
        plt = self.plt
        if not s.speed:
            return 0
        xs = [x for x, _ in s.speed]
        mode = s.summary.mode
        plt.plot(xs, [y for _, y in s.speed], marker="•")
        # The AR reference is a plain run of this session (the cost model's T_AR is the bare decode step,
        # without the per-token overhead every mode pays, so it would flatter plain decoding).
        ref = s.ar_reference
        if ref is not None and mode != "ar":
            plt.plot([xs[0], xs[-1]] if len(xs) > 1 else [xs[0], xs[0] + 1e-3], [ref, ref], marker="-")
            plt.title(f"Tokens/s: {mode} •, ar reference -")
            plt.xlabel("seconds")
        else:
            plt.xlabel("seconds" if mode == "ar" else "seconds · run ar once for a reference")
        plt.ylim(0, None)
        return len(xs)


class AcceptPlot(LivePlot):
    TITLE = "Tokens per target pass: each •, mean -"

    def plot_data(self, s):
        plt = self.plt
        if not s.accept:
            return 0
        xs = list(range(1, len(s.accept) + 1))
        plt.plot(xs, s.accept, marker="•")
        running, total = [], 0
        for i, a in enumerate(s.accept):
            total += a
            running.append(total / (i + 1))
        plt.plot(xs, running, marker="-")
        plt.ylim(0, None)
        plt.xlabel("iteration")
        return len(xs)


class RollbackPlot(LivePlot):
    TITLE = "KV rollbacks per iteration"

    def plot_data(self, s):
        plt = self.plt
        if not s.rollbacks:
            return 0
        plt.bar(list(range(1, len(s.rollbacks) + 1)), s.rollbacks, width=BAR)
        plt.ylim(0, None)
        plt.xlabel("iteration")
        return len(s.rollbacks)


class ResidencyPlot(LivePlot):
    TITLE = "Experts in memory per layer"

    def plot_data(self, s):
        plt = self.plt
        if s.resident is None:
            plt.title(f"{self.TITLE} (with --budget)")
            return 0
        hits = [h for h in (s.hit_rate or []) if h is not None]
        if hits and len(hits) == len(s.resident):
            plt.title(f"Per layer: resident █, draft-predicted hit {SECOND}")
            layer_bars(plt, s.resident, hits)
        else:
            plt.title(f"Per layer: resident █, pinned {SECOND}")
            layer_bars(plt, s.resident, s.pinned or [0.0] * len(s.resident))
        plt.xlabel("layer · share of experts" + (f" · {s.budget}" if s.budget else ""))
        return len(s.resident)


class LivePanel(VerticalScroll):
    """Tiles and plots of the current generation. Focusable so the keyboard can scroll it."""

    can_focus = True
    ALLOW_MAXIMIZE = True  # Ctrl+G: containers may not be maximized unless they say so

    def __init__(self, **kw):
        super().__init__(**kw)
        self.state = LiveState()
        self._drawn = -1

    def compose(self) -> ComposeResult:
        yield Static(self.state.stats_text(), id="live-stats")
        yield ReusePlot(id="plot-reuse")
        yield UtilityPlot(id="plot-utility")
        yield SpeedPlot(id="plot-speed")
        yield AcceptPlot(id="plot-accept")
        yield RollbackPlot(id="plot-rollback")
        yield ResidencyPlot(id="plot-residency")

    def on_mount(self) -> None:
        # the tiles from the start, not only after the chat's first redraw tick
        self.call_after_refresh(self.flush, True)

    @property
    def plots(self) -> list[LivePlot]:
        return list(self.query(LivePlot))

    def flush(self, force: bool = False) -> None:
        """Redraw if the state changed since the last redraw."""
        if not force and self._drawn == self.state.version:
            return
        self._drawn = self.state.version
        why = self.state.why()
        v = self.app.theme_variables
        styles = {
            "bars": v.get("primary", "blue"),
            "kept": v.get("success", "green"),
            "dropped": f"dim {v.get('error', 'red')}",
            "accepted": f"bold {v.get('success', 'green')}",
            "rejected": f"dim {v.get('error', 'red')}",
        }
        parts = [Tiles(self.state, styles)] + ([FirstFit(why)] if why else [])
        if self.state.tree is not None:
            parts.append(TreeView(self.state.tree, styles))
        details = self.state.stats_text()
        if details:
            parts.append(Text(details, style="dim"))
        self.query_one("#live-stats", Static).update(Group(*parts))
        for plot in self.plots:
            plot.draw(self.state)
