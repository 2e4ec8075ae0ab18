"""The live panel beside the chat: what the last iterations did, as numbers and textual-plotext plots.

LiveState collects data from engine events (cheap, per event); the panel redraws from it at most a few
times a second, so a fast engine never floods the UI with plot renders.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.cells import cell_len
from rich.console import Group
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static
from textual_plotext import PlotextPlot

from ...engine.events import DraftDecision, Finished, Iteration, Summary

MAX_POINTS = 120  # iterations kept for the per-iteration plots


@dataclass
class LiveState:
    summary: Summary = field(default_factory=Summary)  # the generation so far: its totals, mode and cost
    n_layer: int = 0
    k: int = 0
    threshold: float = 1.0
    gating: bool = False
    utility: bool = False
    ar_reference: float | None = None  # tok/s of a plain run in this session
    reuse_last: list[float] = field(default_factory=list)
    reuse_other: list[float] | None = None  # session mean with the other gating setting
    reuse_other_label: str = ""
    utilities: list[tuple[float | None, bool, float]] = field(default_factory=list)
    draft_stop: str = ""
    decision: DraftDecision | None = None  # the utility rule's latest decision
    rollbacks: list[int] = field(default_factory=list)
    accept: list[int] = field(default_factory=list)
    speed: list[tuple[float, float]] = field(default_factory=list)  # (seconds since prefill, tok/s)
    # expert offloading (s2moe app --budget): per layer, share of expert bytes in memory, share pinned,
    # and the hit rate of the draft-predicted experts at verification (None: no lookups yet)
    resident: list[float] | None = None
    pinned: list[float] | None = None
    hit_rate: list[float | None] | None = None
    t0: float | None = None
    version: int = 0  # bumped on every change; the panel redraws when it moved

    def start(self, started, t: float, session_stats=None) -> None:
        cfg = started.config or {}
        ar_ref, version = self.ar_reference, self.version
        residency = self.resident, self.pinned, self.hit_rate
        self.__init__()  # type: ignore[misc]
        self.ar_reference, self.version = ar_ref, version  # the version only ever grows
        self.resident, self.pinned, self.hit_rate = residency  # memory outlives one generation
        self.summary.add(started)
        self.n_layer = started.n_layer
        self.k = started.k
        self.threshold = float(cfg.get("threshold", 1.0))
        self.gating = started.mode == "s2moe" and float(cfg.get("reuse_strength", 0) or 0) > 0
        self.utility = started.mode == "s2moe" and bool(cfg.get("utility", False))
        if session_stats is not None:
            if session_stats.ar_tok_per_s:
                self.ar_reference = session_stats.ar_tok_per_s
            other = session_stats.reuse_by_gating.get(not self.gating)
            if other is not None and len(other) == self.n_layer:
                self.reuse_other = list(other)
                self.reuse_other_label = "gating on (mean)" if not self.gating else "gating off (mean)"
        self.t0 = t
        self.version += 1

    def prefilled(self, t: float) -> None:
        self.t0 = t
        self.version += 1

    def add(self, it: Iteration, view, t: float) -> None:
        s = self.summary
        s.add(it)
        self.draft_stop = it.draft_stop
        if it.draft_decision is not None:
            self.decision = it.draft_decision
        if it.verify_tokens >= 2:
            self.reuse_last = [float(x) for x in it.reuse_ratio]
        if view is not None and it.candidates:
            self.utilities = list(view.utilities)
        self.rollbacks.append(it.rollback)
        self.accept.append(len(it.committed))
        if self.t0 is not None and t > self.t0:
            self.speed.append((t - self.t0, s.committed / (t - self.t0)))
        del self.rollbacks[:-MAX_POINTS], self.accept[:-MAX_POINTS], self.speed[:-MAX_POINTS]
        self.version += 1

    def residency(self, snap) -> None:
        import math

        self.resident = [float(x) for x in snap.resident.mean(axis=1)]
        self.pinned = [float(x) for x in snap.pinned.mean(axis=1)]
        self.hit_rate = [None if math.isnan(h) else float(h) for h in snap.hit_rate]
        self.version += 1

    def finish(self, finished: Finished) -> None:
        self.summary.add(finished)
        self.version += 1

    @property
    def tok_per_s(self) -> float:
        """The finished generation's speed, or the latest measured while it runs."""
        if self.summary.seconds > 0:
            return self.summary.tok_per_s
        return self.speed[-1][1] if self.speed else 0.0

    def stats_text(self) -> str:
        s = self.summary
        if not s.mode:
            return "No generation yet. Type a prompt and press Enter."
        reuse_txt = f"{s.reuse_ratio:.2f}" if s.reuse_ratio is not None else "n/a"
        rate = f"{s.acceptance_rate:.0%}" if s.drafted else "n/a"
        useful = f"  useful {s.useful_share:.0%}" if s.useful_share is not None else ""
        lines = [
            f"{s.mode}  it {s.iterations}  tok {s.committed}  {self.tok_per_s:.1f} tok/s",
            f"accept len {s.accept_len:.2f}  accepted {rate}  rollbacks {s.rollbacks}",
            f"reuse {reuse_txt}{useful}  moved {s.gated_moves}  stop: {s.stop_reason or self.draft_stop or '…'}",
        ]
        if s.offloaded_steps:
            n = s.offloaded_steps
            # per verification: experts fetched / experts read, and page faults that waited for storage
            lines.append(f"fetched {s.experts_fetched / n:.1f}/{s.experts_read / n:.0f} experts  "
                         f"faults {s.storage_faults / n:.1f}")
        if s.cost is not None and s.cost.source:
            lines.append(f"cost: {s.cost.source}")
        return "\n".join(lines)

    def why(self) -> list[str]:
        """The utility rule's current decision in one line, most detailed wording first: the panel shows the
        first that fits its width. Where drafting cannot pay, it says how to draft anyway."""
        d = self.decision
        if d is None:
            return []
        if d.can_pay:
            return list(d.wordings)
        hints = (" · F7 turns the rule off and drafts anyway", " · F7 forces it")
        return [w + hint for w in d.wordings for hint in hints] + [f"{d.wordings[-1]} (F7)"]


class FirstFit:
    """The first of several wordings that fits the width it is drawn at (the last one wraps if none does)."""

    def __init__(self, texts: list[str]):
        self.texts = texts

    def __rich_console__(self, console, options):
        yield Text(next((t for t in self.texts if cell_len(t) <= options.max_width), self.texts[-1]))


class LivePlot(PlotextPlot):
    """A plot that redraws itself from a LiveState."""

    DEFAULT_CSS = """
    LivePlot { height: 11; width: 1fr; }
    """
    TITLE = ""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.draws = 0       # how many times data was plotted (tests read it)
        self.points = 0      # data points in the last draw

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


class ReusePlot(LivePlot):
    TITLE = "Reuse ratio per layer"

    def plot_data(self, s):
        plt = self.plt
        if not s.reuse_last:
            return 0
        labels = [str(i) for i in range(len(s.reuse_last))]
        if s.reuse_other:
            plt.multiple_bar(labels, [s.reuse_last, s.reuse_other], labels=["last", s.reuse_other_label])
        else:
            plt.bar(labels, s.reuse_last)
        plt.ylim(0, 1)
        plt.xlabel("layer (lower = more reuse)")
        return len(s.reuse_last)


class UtilityPlot(LivePlot):
    TITLE = "Draft utility vs threshold"

    def plot_data(self, s):
        plt = self.plt
        values = [(i + 1, u, kept) for i, (u, kept, _p) in enumerate(s.utilities) if u is not None]
        if not values:
            if not s.utilities:
                return 0
            # No utility rule in this mode: show each candidate's chain probability p_i instead.
            plt.title("Draft chain probability p_i")
            values = [(i + 1, p, kept) for i, (_u, kept, p) in enumerate(s.utilities)]
            kept = [(i, v) for i, v, k in values if k]
            dropped = [(i, v) for i, v, k in values if not k]
            if kept:
                plt.bar([i for i, _ in kept], [v for _, v in kept], label="kept")
            if dropped:
                plt.bar([i for i, _ in dropped], [v for _, v in dropped], label="dropped")
            plt.ylim(0, 1)
            plt.xlabel("candidate · no utility rule")
            return len(values)
        kept = [(i, u) for i, u, k in values if k]
        dropped = [(i, u) for i, u, k in values if not k]
        if kept:
            plt.bar([i for i, _ in kept], [u for _, u in kept], label="kept")
        if dropped:
            plt.bar([i for i, _ in dropped], [u for _, u in dropped], label="dropped")
        plt.hline(s.threshold)
        plt.xlabel(f"candidate · threshold {s.threshold:g}")
        return len(values)


class SpeedPlot(LivePlot):
    TITLE = "Tokens/s"

    def plot_data(self, s):
        plt = self.plt
        if not s.speed:
            return 0
        xs = [x for x, _ in s.speed]
        mode = s.summary.mode
        plt.plot(xs, [y for _, y in s.speed], label=mode)
        # The AR reference is a plain run of this session (the cost model's T_AR is the bare decode step,
        # without the per-token overhead every mode pays, so it would flatter plain decoding).
        ref = s.ar_reference
        if ref is not None and mode != "ar":
            plt.plot([xs[0], xs[-1]] if len(xs) > 1 else [xs[0], xs[0] + 1e-3], [ref, ref], label="ar")
            plt.xlabel("seconds")
        else:
            plt.xlabel("seconds" if mode == "ar" else "seconds · run ar once for a reference")
        plt.ylim(0, None)
        return len(xs)


class AcceptPlot(LivePlot):
    TITLE = "Tokens per target pass"

    def plot_data(self, s):
        plt = self.plt
        if not s.accept:
            return 0
        xs = list(range(1, len(s.accept) + 1))
        plt.plot(xs, s.accept, label="per iteration")
        running, total = [], 0
        for i, a in enumerate(s.accept):
            total += a
            running.append(total / (i + 1))
        plt.plot(xs, running, label="mean")
        plt.ylim(0, None)
        return len(xs)


class RollbackPlot(LivePlot):
    TITLE = "KV rollbacks"

    def plot_data(self, s):
        plt = self.plt
        if not s.rollbacks:
            return 0
        plt.bar(list(range(1, len(s.rollbacks) + 1)), s.rollbacks)
        plt.ylim(0, None)
        return len(s.rollbacks)


class ResidencyPlot(LivePlot):
    TITLE = "Experts in memory per layer"

    def plot_data(self, s):
        plt = self.plt
        if s.resident is None:
            plt.title(f"{self.TITLE} (with --budget)")
            return 0
        labels = [str(i) for i in range(len(s.resident))]
        hits = [h for h in (s.hit_rate or []) if h is not None]
        if hits and len(hits) == len(s.resident):
            plt.multiple_bar(labels, [s.resident, hits], labels=["resident", "draft-predicted hit"])
        else:
            plt.multiple_bar(labels, [s.resident, s.pinned or [0.0] * len(labels)], labels=["resident", "pinned"])
        plt.ylim(0, 1)
        plt.xlabel("layer · share of experts")
        return len(labels)


class LivePanel(VerticalScroll):
    """Stats and plots of the current generation. Focusable so the keyboard can scroll it."""

    can_focus = True

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

    @property
    def plots(self) -> list[LivePlot]:
        return list(self.query(LivePlot))

    def flush(self, force: bool = False) -> None:
        """Redraw if the state changed since the last redraw."""
        if not force and self._drawn == self.state.version:
            return
        self._drawn = self.state.version
        stats, why = self.state.stats_text(), self.state.why()
        self.query_one("#live-stats", Static).update(Group(Text(stats), FirstFit(why)) if why else stats)
        for plot in self.plots:
            plot.draw(self.state)
