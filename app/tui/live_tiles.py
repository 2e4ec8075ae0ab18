"""The live panel's text: tiles of every figure at once, the latest draft tree, and a line that fits.

These are Rich renderables, not widgets: the panel puts them in one Static and they lay themselves out at
the width they are drawn at (sparklines take the room there is, notes are dropped before bars are). The
device screen borrows the sparklines.
"""

from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text

from .live_state import IterationTree, LiveState

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
