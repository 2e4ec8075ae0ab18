"""The live panel beside the chat: what the last iterations did, as compact tiles and textual-plotext plots.

LiveState collects data from engine events (cheap, per event); the panel redraws from it at most a few
times a second, so a fast engine never floods the UI with plot renders. The tiles at the top put every
figure on one screen (one line each, with a sparkline or one bar per layer); the plots below them are the
same data in full, and Ctrl+G shows the panel full-screen to read them.
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


@dataclass(frozen=True)
class IterationTree:
    """The draft tree of one iteration as the panel draws it: the text of each drafted token, its parent
    (index into the drafted tokens; -1: the pending token) and the accepted path, read off the event."""

    index: int
    pieces: tuple[str, ...]
    parents: tuple[int, ...]
    accepted_path: tuple[int, ...]
    target: str | None  # the target's own token after the path (None: cut by a stop)
    draft_stop: str

    @classmethod
    def of(cls, it: Iteration, piece) -> IterationTree:
        has_target = len(it.committed) == len(it.accepted) + 1
        return cls(
            it.index,
            tuple(piece(t) for t in it.drafted),
            tuple(it.tree_parents or ()),
            tuple(it.accepted_path),
            piece(it.target_token) if has_target else None,
            it.draft_stop,
        )


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
    budget: str = ""  # the memory budget as the session words it ("" fully resident)
    tree: IterationTree | None = None  # the latest iteration's draft tree, once the generation drafts trees
    t0: float | None = None
    version: int = 0  # bumped on every change; the panel redraws when it moved

    def start(self, started, t: float, session_stats=None) -> None:
        cfg = started.config or {}
        ar_ref, version = self.ar_reference, self.version
        residency = self.resident, self.pinned, self.hit_rate, self.budget
        self.__init__()  # type: ignore[misc]
        self.ar_reference, self.version = ar_ref, version  # the version only ever grows
        self.resident, self.pinned, self.hit_rate, self.budget = residency  # memory outlives one generation
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

    def add(self, it: Iteration, view, t: float, piece=None) -> None:
        """`piece` gives a token's text (the decoder's); without it the draft tree is not kept."""
        s = self.summary
        s.add(it)
        self.draft_stop = it.draft_stop
        # an iteration of a tree mode that drafted nothing is an empty tree, not a chain
        if piece is not None and (it.tree_parents is not None or self.tree is not None):
            self.tree = IterationTree.of(it, piece)
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
        """The finished generation's decoding speed (as bench and tune count it: the prefill left out), or the
        latest measured while it runs."""
        if self.summary.seconds > 0:
            return self.summary.decode_tok_per_s
        return self.speed[-1][1] if self.speed else 0.0

    def stats_text(self) -> str:
        """What the tiles have no line for: the useful share of verified experts, offloading's fetches and
        faults, and where the cost constants came from."""
        s = self.summary
        if not s.mode:
            return "No generation yet. Type a prompt and press Enter."
        lines = []
        if s.useful_share is not None:
            lines.append(f"useful {s.useful_share:.0%} of the verified experts")
        if s.offloaded_steps:
            n = s.offloaded_steps
            # per verification, over all layers (so more than a layer's expert count): experts read, those not
            # in memory when their layer routed, and page faults that waited for storage
            lines.append(
                f"per step: {s.experts_read / n:.0f} experts read (all layers), "
                f"{s.experts_fetched / n:.1f} fetched from storage, {s.storage_faults / n:.1f} faults"
            )
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


SPARKS = "▁▂▃▄▅▆▇█"
MIN_SPARK, MAX_SPARK = 6, 40  # iterations a sparkline shows
LABEL = 7  # the width of a tile's label column
VALUE = 5  # … and of its value


def spark(values, top: float | None = None) -> str:
    """One block character per value, its height the value's share of `top` (default: the largest).
    Zero is the lowest block rather than a blank, so that every bar is there to count."""
    values = [max(0.0, float(v)) for v in values]
    top = top if top is not None else max(values, default=0.0)
    if top <= 0:
        return SPARKS[0] * len(values)
    return "".join(SPARKS[min(len(SPARKS) - 1, int(v / top * (len(SPARKS) - 1) + 0.5))] for v in values)


class Tiles:
    """Every figure of the generation at once, one line per tile in the manner of btop: a label, the
    current value, a sparkline of the recent iterations (or one bar per layer) and a short note. The
    sparklines take the width the panel has; a note that does not fit is dropped before the bars are."""

    def __init__(self, state: LiveState, styles: dict[str, str] | None = None):
        self.state = state
        self.styles = styles or {}

    def _line(self, width: int, label: str, value: str, bars: Text | str, note: str = "") -> Text:
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(f"{label:<{LABEL}}", style="bold")
        text.append(f"{value:>{VALUE}} ")
        bars = bars if isinstance(bars, Text) else Text(bars, style=self.styles.get("bars", ""))
        text.append_text(bars)
        if note and cell_len(text.plain) + 2 + cell_len(note) <= width:
            text.append("  " + note, style="dim")
        return text

    def _series(self, width: int, label: str, value: str, values, note: str, top: float | None = None) -> Text:
        """A time series tile: the latest iterations as a sparkline, as many as leave room for the note
        (at least MIN_SPARK of them; the note goes first when even those do not fit)."""
        room = width - LABEL - VALUE - 1
        fit = room - (cell_len(note) + 2 if note else 0)
        n = min(MAX_SPARK, max(MIN_SPARK, fit), max(1, room))
        return self._line(width, label, value, spark(values[-n:], top) if values else "", note)

    def lines(self, width: int) -> list[Text]:
        s = self.state
        su = s.summary
        room = max(4, width - LABEL - VALUE - 1)  # what the bars may take when the note is dropped
        out = []
        head = Text(no_wrap=True, overflow="ellipsis")
        head.append(su.mode or "—", style="bold reverse")
        head.append(f" it {su.iterations} · {su.committed} tok · {su.stop_reason or s.draft_stop or '…'}")
        out.append(head)
        speeds = [v for _, v in s.speed]
        note = ""
        if s.ar_reference and su.mode != "ar":
            note = f"×{s.tok_per_s / s.ar_reference:.2f} vs ar"
        out.append(self._series(width, "tok/s", f"{s.tok_per_s:.1f}", speeds, note))
        rate = f"{su.acceptance_rate:.0%} accepted" if su.drafted else "no drafts"
        out.append(self._series(width, "accept", f"{su.accept_len:.2f}", s.accept, rate, max(s.accept, default=1)))
        out.append(self._series(width, "rollb.", str(su.rollbacks), s.rollbacks, "tok undone"))
        out += self._reuse(width, room)
        out.append(self._utility(width, room))
        out += self._memory(width, room)
        return out

    def _per_layer(self, width: int, room: int, label: str, value: str, values, note: str) -> list[Text]:
        """One bar per layer, spaced apart while there is room; more layers than the room go on in further
        lines under the first, never merged."""
        if len(values) * 2 - 1 <= room:
            return [self._line(width, label, value, " ".join(spark(values, 1.0)), note)]
        bars = spark(values, 1.0)
        chunks = [bars[i : i + room] for i in range(0, len(bars), room)]
        out = [self._line(width, label, value, chunks[0], note)]
        out += [self._line(width, "", "", chunk) for chunk in chunks[1:]]
        return out

    def _reuse(self, width: int, room: int) -> list[Text]:
        s = self.state
        su = s.summary
        value = f"{su.reuse_ratio:.2f}" if su.reuse_ratio is not None else "n/a"
        if not s.reuse_last:
            return [self._line(width, "reuse", value, "", "per layer once a draft is verified")]
        note = f"{len(s.reuse_last)} layers" + (f" · moved {su.gated_moves}" if su.gated_moves else "")
        return self._per_layer(width, room, "reuse", value, s.reuse_last, note)

    def _utility(self, width: int, room: int) -> Text:
        s = self.state
        values = [(u, kept) for u, kept, _p in s.utilities if u is not None]
        if not values:
            word = "off" if s.summary.mode and not s.utility else "—"
            return self._line(width, "utility", word, "", f"threshold {s.threshold:g}" if s.utility else "")
        kept = sum(1 for _, k in values if k)
        top = max([u for u, _ in values] + [s.threshold])
        bars = Text()
        for i, (u, k) in enumerate(values[: room - 1]):
            if i == kept:
                bars.append("|", style="bold")  # where the rule cut the chain: state not by colour alone
            bars.append(spark([u], top), style=self.styles.get("kept" if k else "dropped", ""))
        if kept == len(values):
            bars.append("|", style="bold")
        return self._line(width, "utility", f"{kept}/{len(values)}", bars, f"≥ threshold {s.threshold:g}")

    def _memory(self, width: int, room: int) -> list[Text]:
        s = self.state
        if s.resident is None:
            return [self._line(width, "memory", "all", "", "resident (no --budget)")]
        share = sum(s.resident) / max(1, len(s.resident))
        hits = [h for h in (s.hit_rate or []) if h is not None]
        note = s.budget.removeprefix("budget ")
        if hits:
            note = f"hit {sum(hits) / len(hits):.0%}" + (f" · {note}" if note else "")
        return self._per_layer(width, room, "memory", f"{share:.0%}", s.resident, note)

    def __rich_console__(self, console, options):
        width = options.max_width
        yield from self.lines(width)


VISIBLE = {ord(" "): "␣", ord("\n"): "⏎", ord("\t"): "⇥", 0x7F: "␡"} | {
    c: chr(0x2400 + c) for c in range(32) if c not in (9, 10)
}


def token_label(text: str) -> str:
    """A token's text with its whitespace and control characters visible (as their Unicode pictures), so
    that tokens side by side stay apart and none moves the cursor."""
    return text.translate(VISIBLE) or "∅"


ACCEPTED, REJECTED, TARGET = "✓", "✗", "→"


class TreeView:
    """The latest iteration's draft tree in a few lines: the pending token (•), then each drafted token
    marked ✓ (on the accepted path) or ✗, and → the target's own token after the path. A node's first child
    goes on along its line (the accepted child first, so the accepted path is the first line); its other
    children start lines of their own under it (└), the deepest branch first so that each sits next to its
    parent. Lines past `max_lines` are counted, not drawn."""

    def __init__(self, tree: IterationTree, styles: dict[str, str] | None = None, max_lines: int = 6):
        self.tree = tree
        self.styles = styles or {}
        self.max_lines = max_lines

    def lines(self, width: int) -> list[Text]:
        tree = self.tree
        path = set(tree.accepted_path)
        last = tree.accepted_path[-1] if tree.accepted_path else -1
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(tree.parents):
            children.setdefault(parent, []).append(node)
        for kids in children.values():
            kids.sort(key=lambda n: n not in path)  # stable: the accepted child first, the rest in draft order
        head = Text(no_wrap=True, overflow="ellipsis")
        head.append(f"{'tree':<{LABEL}}", style="bold")
        head.append(f"{len(tree.accepted_path)}/{len(tree.pieces)}".rjust(VALUE) + " ")
        if tree.pieces:
            legends = [
                f"{ACCEPTED} accepted {REJECTED} rejected {TARGET} target",
                f"{ACCEPTED}acc {REJECTED}rej {TARGET}target",
            ]
        else:
            legends = [f"no draft ({tree.draft_stop})"]
        notes = [f"it {tree.index} · {legends[0]}", *legends, f"it {tree.index}"]
        head.append(next((n for n in notes if cell_len(head.plain) + cell_len(n) <= width), notes[-1]), style="dim")
        body: list[Text] = []

        def branch(node: int, indent: int, lead: str) -> None:
            line = Text(" " * indent + lead, no_wrap=True, overflow="ellipsis")
            later: list[tuple[list[int], int]] = []
            while True:
                if node >= 0:
                    ok = node in path
                    if lead != "└" or cell_len(line.plain) > indent + 1:
                        line.append(" ")
                    line.append(
                        (ACCEPTED if ok else REJECTED) + token_label(tree.pieces[node]),
                        style=self.styles.get("accepted" if ok else "rejected", ""),
                    )
                kids = children.get(node, [])
                column = cell_len(line.plain)
                if node == last:
                    if tree.target is not None:
                        line.append(f" {TARGET}" + token_label(tree.target), style="bold")
                    later.append((kids, column))
                    break
                later.append((kids[1:], column))
                if not kids:
                    break
                node = kids[0]
            body.append(line)
            for kids, column in reversed(later):  # the deepest first: each branch right under its parent
                for kid in kids:
                    branch(kid, column, "└")

        branch(-1, 0, "•")
        if len(body) > self.max_lines:
            hidden = len(body) - self.max_lines + 1
            body = body[: self.max_lines - 1] + [Text(f"  … {hidden} more branches", style="dim")]
        return [head] + body

    def __rich_console__(self, console, options):
        yield from self.lines(options.max_width)


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
