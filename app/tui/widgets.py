"""Widgets shared by the screens: the navigation bar, chat turns, the prompt input with history, tables that
fit their width."""

from __future__ import annotations

from collections.abc import Sequence

from rich.segment import Segment as RichSegment
from rich.text import Text
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.strip import Strip
from textual.widgets import Checkbox, DataTable, Footer, Input, SelectionList, Static
from textual.widgets._footer import FooterKey
from textual.widgets._toggle_button import ToggleButton

from ..columns import Column, columns_that_fit
from .segments import BONUS, CORRECTION, DRAFT, REJECTED, TARGET, Segment

SCREENS = (
    ("chat", "Chat", "f2"),
    ("calibrate", "Calibrate", "f3"),
    ("profiles", "Profiles", "f4"),
    ("bench", "Bench", "f5"),
    ("device", "Device", "f10"),
)


SHORT_LABELS = {"Calibrate": "Calib", "Profiles": "Prof", "Device": "Dev"}


class NavBar(Static):
    """One line at the top: the screens with their keys, the current one highlighted, and the model."""

    DEFAULT_CSS = """
    NavBar { height: 1; background: $panel; color: $text; padding: 0 1; }
    """

    def __init__(self, current: str, **kw):
        super().__init__(**kw)
        self.current = current

    def on_mount(self) -> None:
        self.refresh_bar()

    def on_resize(self) -> None:
        self.refresh_bar()

    def refresh_bar(self) -> None:
        app = self.app
        model = getattr(app, "model_short_label", "") or getattr(app, "model_label", "")
        room = self.size.width - len("  │ ") - len(model) if model else self.size.width
        # the screens as wide as the model's name leaves room for: in full, then with short names, then the
        # other screens by their keys alone, then the current one alone (F1 lists them all) rather than the
        # model's name cut off
        for form in ("full", "short", "keys", "current", "current short"):
            tabs = self._tabs(form)
            if tabs.cell_len <= room:
                break
        text = Text(no_wrap=True, overflow="ellipsis")
        if form == "full" and self.size.width >= 100:
            text.append("S²-MoE ", style="bold")
        text.append_text(tabs)
        if model:
            text.append("  │ ", style="dim")
            text.append(model, style="italic")
        self.update(text)

    def _tabs(self, form: str) -> Text:
        text = Text()
        for mode, label, key in SCREENS:
            current = mode == self.current
            if form.startswith("current") and not current:
                continue
            if form in ("short", "current short") or (form == "keys" and not current):
                label = "" if form == "keys" else SHORT_LABELS.get(label, label)
            text.append(f" {key.upper()} {label} ".replace("  ", " "), style="reverse bold" if current else "")
        return text


def progress_bar(done: int, total: int) -> str:
    """A few cells of progress for a line of text: ▰ done, ▱ to do."""
    done = max(0, min(done, total))
    return "▰" * done + "▱" * (total - done)


def segment_styles(app) -> dict[str, str]:
    """Rich styles of the token kinds, from the current theme's colours (readable in light and dark)."""
    v = app.theme_variables
    return {
        DRAFT: v.get("success", "green"),
        BONUS: f"bold {v.get('primary', 'blue')}",
        CORRECTION: f"bold underline {v.get('warning', 'yellow')}",
        TARGET: "",
        REJECTED: f"dim strike {v.get('error', 'red')}",
    }


def legend(app) -> Text:
    styles = segment_styles(app)
    text = Text()
    for label, kind in (
        ("accepted", DRAFT),
        ("correction", CORRECTION),
        ("bonus", BONUS),
        ("rejected", REJECTED),
        ("plain", TARGET),
    ):
        text.append(label, style=styles[kind] or "")
        text.append(" ")
    return text


class TurnView(Static):
    """One prompt and its answer, each piece coloured by how it was produced."""

    DEFAULT_CSS = """
    TurnView { height: auto; margin: 0 0 1 0; }
    """

    def __init__(self, index: int, prompt: str, settings_text: str, **kw):
        super().__init__(**kw)
        self.index = index
        self.prompt = prompt
        self.settings_text = settings_text
        self.segments: list[Segment] = []
        self.status = ""
        self.summary = ""
        self.show_rejected = True
        self.dirty = True

    def add(self, segments) -> None:
        self.segments.extend(segments)
        self.dirty = True

    @property
    def answer_text(self) -> str:
        return "".join(s.text for s in self.segments if s.kind != REJECTED)

    def render_text(self) -> Text:
        styles = segment_styles(self.app)
        text = Text()
        text.append("› ", style="bold")
        text.append(self.prompt, style="bold")
        text.append(f"   [{self.settings_text}]\n", style="dim")
        for seg in self.segments:
            if seg.kind == REJECTED and not self.show_rejected:
                continue
            text.append(seg.text, style=styles.get(seg.kind, ""))
        footer = self.summary or self.status
        if footer:
            text.append(f"\n  {footer}", style="dim italic")
        return text

    def redraw(self) -> None:
        self.dirty = False
        self.update(self.render_text())


class ChatTurn(TurnView):
    """A turn of the transcript: a user message and the assistant's answer under the model's chat template
    (template: its name), or a prompt and its completion (template None)."""

    def __init__(self, index: int, prompt: str, settings_text: str, template: str | None = None, **kw):
        super().__init__(index, prompt, settings_text, **kw)
        self.template = template


class Transcript(VerticalScroll):
    """The chat history of this session."""

    can_focus = True

    @property
    def turns(self) -> list[TurnView]:
        return list(self.query(TurnView))


class PromptInput(Input):
    """The prompt line; Up/Down recall earlier prompts of this session, Ctrl+U clears it (Input's own Ctrl+U
    deletes only what is left of the cursor)."""

    BINDINGS = [
        Binding("ctrl+u", "clear", "Clear the prompt", show=False),
        Binding("up", "history(-1)", "Previous prompt", show=False),
        Binding("down", "history(1)", "Next prompt", show=False),
        # an Enter typed while the app starts, before the terminal is in raw mode, arrives as a line feed
        Binding("ctrl+j", "submit", "Send", show=False),
    ]

    def __init__(self, **kw):
        super().__init__(**kw)
        self.history: list[str] = []
        self._pos = 0

    def remember(self, prompt: str) -> None:
        if not self.history or self.history[-1] != prompt:
            self.history.append(prompt)
        self._pos = len(self.history)

    def action_clear(self) -> None:
        self.value = ""

    def action_history(self, step: int) -> None:
        if not self.history:
            return
        self._pos = max(0, min(len(self.history), self._pos + step))
        self.value = self.history[self._pos] if self._pos < len(self.history) else ""
        self.cursor_position = len(self.value)


class FittedTable(DataTable):
    """A DataTable that shows the columns its width allows, most important first, instead of clipping the
    right-hand ones off at 80 columns. Rows are given as dicts keyed by column key, so a re-layout can rebuild
    them with whichever columns are shown."""

    def __init__(self, columns: Sequence[Column], **kw):
        super().__init__(**kw)
        self.all_columns = tuple(columns)
        self.shown: tuple[tuple[str, int], ...] = ()
        self.row_data: list[tuple[str | None, dict]] = []

    def set_rows(self, rows: Sequence[tuple[str | None, dict]]) -> None:
        self.row_data = list(rows)
        self._rebuild(force=True)

    def on_resize(self) -> None:
        self._rebuild(force=False)

    def room(self) -> int:
        scrollbar = self.styles.scrollbar_size_vertical if self.show_vertical_scrollbar else 0
        return max(0, self.size.width - scrollbar)

    def _rebuild(self, force: bool) -> None:
        if self.size.width == 0:
            return  # not laid out yet: the first resize fills the table
        fitted = columns_that_fit(self.all_columns, self.room(), self.cell_padding)
        shown = tuple((c.key, w) for c, w in fitted)
        if shown == self.shown and not force:
            return
        row = self.cursor_row
        self.clear(columns=shown != self.shown)
        if shown != self.shown:
            for col, width in fitted:
                self.add_column(col.label, width=width, key=col.key)
            self.shown = shown
        for key, values in self.row_data:
            self.add_row(*(values.get(k, "") for k, _ in shown), key=key)
        if self.row_data:
            self.move_cursor(row=min(max(row, 0), len(self.row_data) - 1))
        # a vertical scrollbar appears only once the rows are laid out, and it takes room from the columns
        self.call_after_refresh(self._rebuild, False)


class CheckList(SelectionList):
    """A SelectionList whose boxes say their state: ✓ when selected, empty when not. Textual draws the same
    X in both and tells them apart by colour alone."""

    def render_line(self, y: int) -> Strip:
        strip = super().render_line(y)
        segments = list(strip)
        for i, seg in enumerate(segments):
            meta = seg.style.meta if seg.style is not None else {}
            if seg.text == ToggleButton.BUTTON_INNER and "option" in meta:
                selected = self.get_option_at_index(meta["option"]).value in self._selected
                segments[i] = RichSegment("✓" if selected else " ", seg.style)
                return Strip(segments, strip.cell_length)
        return strip


class TickBox(Checkbox):
    """A Checkbox that says its state: ✓ when on, empty when off (Textual draws the same X both ways, told
    apart by colour alone)."""

    @property
    def BUTTON_INNER(self) -> str:  # noqa: N802 - the name ToggleButton draws its inside from
        return "✓" if self.value else " "


class FittedFooter(Footer):
    """A footer that shows the key hints its width allows instead of cutting the last ones off: F1 (help,
    which lists every key) always, then the actions `first` names in that order, then the others in the order
    the screen gives them, the command palette's last. Textual's footer scrolls its overflow out of sight, and
    the app's F1 comes after the screen's keys."""

    KEEP = "help"
    _laid_out_for = 0

    def __init__(self, *, first: tuple[str, ...] = (), **kw):
        super().__init__(**kw)
        self.first = (self.KEEP,) + tuple(first)

    def compose(self):
        widgets = list(super().compose())
        keys = [w for w in widgets if isinstance(w, FooterKey)]
        if len(keys) != len(widgets):
            yield from widgets  # key groups: no widths to count, Textual's layout as it is
            return
        room = self._laid_out_for = self.size.width or self.app.size.width
        palette = [w for w in keys if w.has_class("-command-palette")]
        rank = {action: i for i, action in enumerate(self.first)}
        ranked = sorted((w for w in keys if w not in palette), key=lambda w: rank.get(w.action, len(rank)))
        ranked += palette
        shown, used = set(), 0
        for w in ranked:
            width = self._width(w)
            if used + width <= room or w.action == self.KEEP:
                shown.add(w)
                used += width
        yield from (w for w in keys if w in shown)

    def _width(self, key: FooterKey) -> int:
        """Cells the hint takes, as Footer's and FooterKey's styles lay it out."""
        text = len(key.key_display) + len(key.description)
        if key.has_class("-command-palette"):
            return text + 2 + (0 if self.compact else 1)  # border, space, and the padding a full footer gives it
        return text + (2 if self.compact else 3)  # compact: a space and a margin; full: padding around both

    def on_resize(self, event) -> None:
        if event.size.width != self._laid_out_for:
            self.call_after_refresh(self.recompose)
