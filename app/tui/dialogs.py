"""Modal dialogs: key bindings help, open a model, generation settings."""

from __future__ import annotations

from dataclasses import replace

from rich.table import Table
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Select, Static
from textual.widgets.option_list import Option

from ...engine.errors import ConfigError
from ..options import SAMPLING_VALUES, sampling_value
from .chat_settings import FROM_DEFAULT, FROM_FLAG, FROM_PROFILE, FROM_USER, OPEN_KEYS, ChatSettings
from .widgets import TickBox

# The sampler settings the form offers, in the order of llama.cpp's chain after the temperature and seed.
SAMPLING_LABELS = {
    "temperature": "Temperature (0 greedy)",
    "seed": "Seed (-1 random)",
    "top_k": "Top-k (0 off)",
    "top_p": "Top-p (1 off)",
    "min_p": "Min-p (0 off)",
    "repeat_penalty": "Repeat penalty (1 off)",
    "repeat_last_n": "Penalty window (tokens)",
}

KEY_NAMES = {"escape": "Esc", "question_mark": "?", "enter": "Enter", "tab": "Tab"}


def key_label(key: str) -> str:
    parts = []
    for k in key.split(","):
        k = k.strip()
        if k in KEY_NAMES:
            parts.append(KEY_NAMES[k])
        elif k.startswith("ctrl+"):
            parts.append("Ctrl+" + k[5:].upper())
        elif k.startswith("shift+"):
            parts.append("Shift+" + key_label(k[6:]))
        elif k.startswith("f") and k[1:].isdigit():
            parts.append(k.upper())
        else:
            parts.append(k)
    return " / ".join(parts)


class HelpScreen(ModalScreen[None]):
    """Every key binding of the screen underneath and of the app."""

    BINDINGS = [Binding("escape,f1,q,question_mark", "dismiss", "Close")]

    def __init__(self, sections: list[tuple[str, list[tuple[str, str]]]]):
        super().__init__()
        self.sections = sections

    def compose(self) -> ComposeResult:
        table = Table(show_header=False, box=None, padding=(0, 1), expand=True)
        table.add_column("key", style="bold", no_wrap=True)
        table.add_column("action")
        for title, rows in self.sections:
            table.add_row(Text(title, style="underline"), "")
            for key, desc in rows:
                table.add_row(key, desc)
            table.add_row("", "")
        with Vertical(id="help-box", classes="dialog"):
            yield Label("Keys  (Esc closes; Ctrl+P opens the command palette)", classes="dialog-title")
            with VerticalScroll(id="help-scroll"):
                yield Static(table, id="help-table")

    def on_mount(self) -> None:
        self.query_one("#help-scroll").focus()


def binding_sections(screen, app) -> list[tuple[str, list[tuple[str, str]]]]:
    """(title, [(key, description)]) for the screen's and the app's bindings, without duplicates."""

    def rows(bindings):
        out, seen = [], set()
        for b in bindings:
            if isinstance(b, tuple):
                b = Binding(*b)
            desc = b.tooltip or b.description or b.action
            if not desc or (b.key, b.action) in seen:
                continue
            seen.add((b.key, b.action))
            out.append((key_label(b.key), desc))
        return out

    sections = []
    title = getattr(screen, "HELP_TITLE", None) or type(screen).__name__.removesuffix("Screen")
    screen_rows = rows(getattr(screen, "BINDINGS", []))
    if screen_rows:
        sections.append((title, screen_rows))
    sections.append(("Everywhere", rows(getattr(app, "HELP_BINDINGS", app.BINDINGS))))
    sections.extend(getattr(screen, "HELP_EXTRA", []))
    return sections


def packaged_models() -> list[dict]:
    """The models this install ships (engine.zoo), or [] when there are none."""
    from ...engine import zoo

    try:
        return zoo.list_models()
    except Exception:  # noqa: BLE001 - a broken manifest must not stop the dialog
        return []


class ModelPathDialog(ModalScreen[str | None]):
    """Open a model: pick a packaged one or type the path of a GGUF file."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, message: str = "", current: str | None = None, models: list[dict] | None = None):
        super().__init__()
        self.message = message
        self.current = current or ""
        self.models = packaged_models() if models is None else models
        # Screen applies AUTO_FOCUS once its children are mounted; focusing from on_mount instead races with an
        # app that is shutting down while the dialog is still being composed.
        self.AUTO_FOCUS = "#model-list" if self.models and not self.current else "#model-path"

    def compose(self) -> ComposeResult:
        with Vertical(id="model-box", classes="dialog"):
            yield Label("Open a model", classes="dialog-title")
            if self.message:
                yield Static(self.message, id="model-message")
            if self.models:
                yield Label("Packaged models (Enter opens):")
                options = []
                for m in self.models:
                    size = m.get("size_bytes")
                    spec = f"{m.get('n_expert', '?')} experts top-{m.get('k', '?')}" if m.get("n_expert") else ""
                    extra = " · ".join(
                        x for x in (m.get("arch", ""), spec, f"{size / 1e6:.0f} MB" if size else "") if x
                    )
                    options.append(Option(f"{m['name']}  ({extra})" if extra else m["name"], id=str(m["path"])))
                yield OptionList(*options, id="model-list")
                yield Label("…or the path of a GGUF file:")
            yield Input(value=self.current, placeholder="path to a GGUF Mixture-of-Experts model", id="model-path")
            yield Static("Enter opens it · Tab switches · Esc cancels", classes="dialog-hint")

    @on(OptionList.OptionSelected, "#model-list")
    def picked(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    @on(Input.Submitted, "#model-path")
    def submitted(self, event: Input.Submitted) -> None:
        from pathlib import Path

        path = Path(event.value.strip()).expanduser()
        if not event.value.strip():
            self.notify("type a path to a .gguf file", severity="warning")
            return
        if not path.is_file():
            self.notify(f"no such file: {path.name}", severity="error")
            return
        self.dismiss(str(path))

    def action_cancel(self) -> None:
        self.dismiss(None)


class SettingsDialog(ModalScreen[ChatSettings | None]):
    """Every generation setting in one form (the F6–F9 keys change the main ones directly)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "apply", "Apply")]

    def __init__(
        self,
        settings: ChatSettings,
        modes: tuple[str, ...],
        model=None,
        *,
        sources: dict[str, str] | None = None,
        profile: str | None = None,
        reset: ChatSettings | None = None,
    ):
        """settings: the values shown; sources: where each comes from (ChatSettings.sources); reset: what
        "Reset to profile" gives back (the user's values left to the profile), None for no such button."""
        super().__init__()
        self.settings = settings
        self.modes = modes
        self.model = model
        self.sources = sources or {}
        self.profile = profile
        self.reset = reset

    def label(self, key: str, text: str) -> Label:
        """A field's name with where its value comes from under it."""
        source = self.sources.get(key)
        if source is None:
            return Label(text)
        where = {
            FROM_PROFILE: f"profile {self.profile}",
            FROM_FLAG: "command line",
            FROM_USER: "yours",
            FROM_DEFAULT: "default",
        }[source]
        style = "bold" if source == FROM_USER else "dim"
        return Label(Text.assemble(text, "\n", (f" from {where}", style)), classes=f"source-{source}")

    def compose(self) -> ComposeResult:
        s = self.settings
        k = self.model.k if self.model is not None and self.model.is_moe else 8
        topk = sorted(set(range(1, max(2, k))) | {s.draft_topk})
        with Vertical(id="settings-box", classes="dialog"):
            yield Label("Generation settings", classes="dialog-title")
            with VerticalScroll(id="settings-scroll"), Grid(id="settings-grid"):
                yield self.label("mode", "Mode")
                yield Select([(m, m) for m in self.modes], value=s.mode, allow_blank=False, id="set-mode")
                yield self.label("utility", "Utility expansion")
                yield TickBox("on", value=s.utility, id="set-utility")
                yield self.label("gating", "Reuse gating")
                yield TickBox("on (lossy; off is lossless)", value=s.gating, id="set-gating")
                yield self.label("lookup", "Copies from context")
                yield TickBox(
                    "on",
                    value=s.lookup,
                    id="set-lookup",
                    tooltip="s2moe: draft what followed a repeated n-gram, where the rule says it pays",
                )
                yield self.label("reuse_strength", "Gating strength α")
                yield Input(str(s.reuse_strength), id="set-alpha", type="number")
                yield self.label("memory_strength", "Memory strength α_m")
                yield Input(
                    str(s.memory_strength),
                    id="set-memory",
                    type="number",
                    tooltip="under a memory budget, with gating on: every step's bias toward the experts "
                    "in memory (0 = off)",
                )
                yield self.label("draft_topk", "Draft experts k_d")
                yield Select([(str(v), v) for v in topk], value=s.draft_topk, allow_blank=False, id="set-topk")
                yield self.label("draft_max", "Draft cap")
                yield Input(str(s.draft_max), id="set-draftmax", type="integer")
                yield self.label("threshold", "Utility threshold")
                yield Input(str(s.threshold), id="set-threshold", type="number")
                yield self.label("n_predict", "Tokens to generate")
                yield Input(str(s.n_predict), id="set-n", type="integer")
                for key, label in SAMPLING_LABELS.items():
                    yield self.label(key, label)
                    yield Input(
                        str(getattr(s, key)),
                        id=f"sample-{key}",
                        tooltip=f"as {SAMPLING_VALUES[key][0]} of s2moe generate",
                    )
            with Horizontal(classes="dialog-buttons"):
                if self.reset is not None:
                    yield Button(
                        "Reset to profile" if self.profile else "Reset to defaults",
                        id="reset",
                        disabled=FROM_USER not in {self.sources.get(key) for key in OPEN_KEYS},
                        tooltip="Forget your values of what a profile tunes (k_d, cap, threshold, α, "
                        "α_m, copies): the active profile's apply, else the defaults",
                    )
                yield Button("Apply", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")
            yield Static("Tab moves · Ctrl+S applies · Esc cancels", classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one("#set-mode").focus()

    def _read(self) -> ChatSettings | None:
        def num(widget_id, cast, lo, hi):
            raw = self.query_one(widget_id, Input).value.strip()
            try:
                v = cast(raw)
            except ValueError:
                raise ValueError(f"{widget_id[5:]}: {raw!r} is not a number") from None
            if not lo <= v <= hi:
                raise ValueError(f"{widget_id[5:]}: {v} is outside {lo}..{hi}")
            return v

        try:
            return replace(
                self.settings,
                mode=self.query_one("#set-mode", Select).value,
                utility=self.query_one("#set-utility", TickBox).value,
                gating=self.query_one("#set-gating", TickBox).value,
                lookup=self.query_one("#set-lookup", TickBox).value,
                reuse_strength=num("#set-alpha", float, 0.0, 100.0),
                memory_strength=num("#set-memory", float, 0.0, 100.0),
                draft_topk=int(self.query_one("#set-topk", Select).value),
                draft_max=num("#set-draftmax", int, 1, 16),
                threshold=num("#set-threshold", float, 0.0, 1e6),
                n_predict=num("#set-n", int, 1, 100000),
                **{key: sampling_value(key, self.query_one(f"#sample-{key}", Input).value) for key in SAMPLING_LABELS},
            )
        except ValueError as e:
            self.notify(str(e), severity="error")
            return None
        except ConfigError as e:
            self.notify(e.worded(SAMPLING_LABELS), severity="error")
            return None

    def action_apply(self) -> None:
        result = self._read()
        if result is not None:
            self.dismiss(result)

    def action_cancel(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed, "#apply")
    def _apply_pressed(self) -> None:
        self.action_apply()

    @on(Button.Pressed, "#reset")
    def _reset_pressed(self) -> None:
        self.dismiss(self.reset)

    @on(Button.Pressed, "#cancel")
    def _cancel_pressed(self) -> None:
        self.action_cancel()

    @on(Input.Submitted)
    def _input_submitted(self) -> None:
        self.action_apply()
