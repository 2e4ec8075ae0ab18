"""Device profiles: list, inspect (measured for this model vs reference), select the active one."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from ...engine.profiles import ProfileEntry, list_profiles
from .widgets import Column, FittedTable, NavBar

TABLE_COLUMNS = (
    Column("active", "", 1, 0),
    Column("name", "name", 16, 1),
    Column("kind", "kind", 9, 3),
    Column("from", "from", 7, 4),
    Column("covers", "this model", 10, 2),
    Column("models", "models", 6, 6),
    Column("device", "device", 20, 5, min_width=10),
)


class ProfilesScreen(Screen):
    HELP_TITLE = "Profiles"
    # Under 80 columns the table and the detail stack, so that the detail's lines have the full width.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (80, "-wide")]
    AUTO_FOCUS = "#prof-table"
    BINDINGS = [
        Binding("space,u", "activate", "Use", tooltip="Make the highlighted profile the active one (or Enter)"),
        Binding("delete,backspace,n", "clear", "No profile", tooltip="No profile: measure cost constants at start-up"),
        Binding("r", "reload", "Reload", tooltip="Read the profile folders again"),
        Binding("c", "calibrate", "Calibrate", show=False, tooltip="Calibrate a new profile (F3)"),
    ]

    def __init__(self, **kw):
        super().__init__(**kw)
        self.entries: list[ProfileEntry] = []
        self.model_note = ""

    def compose(self) -> ComposeResult:
        yield NavBar("profiles", id="navbar")
        yield Static(id="prof-active")
        with Horizontal(id="prof-body"):
            yield FittedTable(TABLE_COLUMNS, id="prof-table", cursor_type="row", zebra_stripes=True)
            with VerticalScroll(id="prof-detail-box"):
                yield Static(id="prof-detail")
        yield Footer()

    def on_mount(self) -> None:
        self.app.register_view(self)
        self.action_reload()
        self.query_one(FittedTable).focus()

    def adapt_to_model(self) -> None:
        self.fill()

    def fingerprint(self) -> str | None:
        model = self.app.session.model
        return model.fingerprint if model is not None else None

    def action_reload(self) -> None:
        try:
            self.entries = list_profiles()
        except Exception as e:  # noqa: BLE001 - a broken folder must not stop the app
            self.entries = []
            self.notify(f"cannot list profiles: {e}", severity="error")
        self.fill()

    def fill(self) -> None:
        active = self.app.session.profile_name
        fp = self.fingerprint()
        self.query_one(FittedTable).set_rows(
            [
                (
                    e.name,
                    {
                        "active": "●" if e.name == active else "",
                        "name": e.name,
                        "kind": e.kind,
                        "from": e.where,
                        "covers": (e.covers(fp) if fp else "?") or "—",
                        "models": str(e.n_models),
                        "device": e.device or "—",
                    },
                )
                for e in self.entries
            ]
        )
        self.show_active()
        self.show_detail()

    def show_active(self) -> None:
        name = self.app.session.profile_name
        text = Text()
        text.append("Active profile: ", style="bold")
        if name:
            text.append(name)
        else:
            text.append("none (cost constants measured at start-up)")
        if not self.entries:
            text.append(
                "\nNo profiles found. Calibrate one (F3) or copy a YAML profile into the user profile folder.",
                style="dim",
            )
        self.query_one("#prof-active", Static).update(text)

    def highlighted(self) -> ProfileEntry | None:
        table = self.query_one(DataTable)
        if not self.entries or table.cursor_row < 0 or table.cursor_row >= len(self.entries):
            return None
        return self.entries[table.cursor_row]

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.show_detail()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_activate()

    def show_detail(self) -> None:
        entry = self.highlighted()
        box = self.query_one("#prof-detail", Static)
        if entry is None:
            box.update("")
            return
        fp = self.fingerprint()
        data = entry.data or {}
        out = Table.grid(padding=(0, 1))
        out.add_column(style="bold")
        out.add_column(overflow="fold")  # a file name is folded onto the next line, never cut
        out.add_row("profile", entry.name)
        if entry.error:
            out.add_row("status", Text(entry.error, style="red"))
        covers = entry.covers(fp) if fp else ""
        if fp is None:
            self.model_note = "no model loaded"
        elif covers == "measured":
            self.model_note = "calibrated for it"
        elif covers == "reference":
            self.model_note = "not calibrated: reference values would apply"
        else:
            self.model_note = "not calibrated for it (selecting it falls back to measuring)"
        out.add_row("this model", Text(self.model_note, style="" if covers else "yellow"))
        # what the calibration could not measure or doubted, saved with the profile: near the top, where the
        # eye is before the profile is used
        checks = model_block(entry, fp).get("measured") or {}
        for flag in checks.get("flagged") or ():
            out.add_row("⚠ doubt", Text(str(flag), style="yellow"))
        for missing in checks.get("missing") or ():
            out.add_row("✖ missing", Text(str(missing), style="red"))
        out.add_row("kind", entry.kind)
        out.add_row("from", f"{entry.where} ({entry.path.name})")
        if entry.device:
            out.add_row("device", entry.device)
        if data.get("description"):
            out.add_row("about", str(data["description"]))
        # one space between columns and none at the edges: at 80 columns the pane has about 30 cells
        consts = Table(
            title="constants (ms)",
            box=None,
            padding=(0, 1),
            collapse_padding=True,
            pad_edge=False,
            title_justify="left",
        )
        consts.add_column("constant")
        consts.add_column("measured", justify="right")
        consts.add_column("reference", justify="right")
        for name, measured, reference in constants_table(entry, fp):
            consts.add_row(name, measured, reference)
        from rich.console import Group

        box.update(Group(out, Text(""), consts))

    def action_activate(self) -> None:
        entry = self.highlighted()
        if entry is None:
            return
        if entry.error:
            self.notify(entry.error, title="Invalid profile", severity="error")
            return
        fp = self.fingerprint()
        if entry.kind == "reference":
            self.notify(
                f"{entry.name} holds published constants of another device ({entry.device}), not "
                "measurements of this one: calibrate (F3) for this machine's own",
                severity="warning",
                timeout=8,
            )
        elif fp is not None and not entry.covers(fp):
            self.notify(
                f"{entry.name} was not calibrated for this model; generations will measure cost constants instead",
                severity="warning",
                timeout=8,
            )
        self.app.set_profile(entry.name)
        self.fill()

    def action_clear(self) -> None:
        self.app.set_profile(None)
        self.fill()

    def action_calibrate(self) -> None:
        self.app.switch_mode("calibrate")


def constants_table(entry: ProfileEntry, fingerprint: str | None) -> list[tuple[str, str, str]]:
    """Rows (constant, measured for this model, reference) in milliseconds, for the profile inspector."""
    keys = ("t_ar_ms", "c_draft_ms", "t_exp_ms", "t_tok_ms", "intercept_ms")
    measured = model_block(entry, fingerprint) or None
    reference = (entry.data or {}).get("reference")
    rows = []

    def fmt(block, key):
        if not isinstance(block, dict) or key not in block:
            return "—"
        v = block[key]
        return f"{v:.4g}" if isinstance(v, (int, float)) else str(v)

    for key in keys:
        rows.append((key.removesuffix("_ms"), fmt(measured, key), fmt(reference, key)))  # the title says ms
    for key, label in (("r2", "fit R²"), ("mape", "fit MAPE")):
        mfit = (measured or {}).get("fit") if isinstance(measured, dict) else None
        rfit = (reference or {}).get("fit") if isinstance(reference, dict) else None
        rows.append((label, fmt(mfit, key), fmt(rfit, key)))
    return rows


def model_block(entry: ProfileEntry, fingerprint: str | None) -> dict:
    """The profile's block for the model with this fingerprint ({} where it has none)."""
    models = (entry.data or {}).get("models") or {}
    block = models.get(fingerprint) if isinstance(models, dict) and fingerprint else None
    return block if isinstance(block, dict) else {}
