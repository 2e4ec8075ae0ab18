"""Saving what the app shows: the chat's transcript (Markdown or JSONL) and the bench's results (JSON or
CSV). The format follows the file name's extension; the file is written whole or not at all."""

from __future__ import annotations

import csv
import io
import json
import time
from dataclasses import asdict
from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static

from ...engine.errors import ConfigError
from ...engine.files import write_atomic
from ...engine.measure.bench_results import BenchDone

TRANSCRIPT_FORMATS = {".md": "Markdown", ".markdown": "Markdown", ".jsonl": "JSONL"}
BENCH_FORMATS = {".json": "JSON", ".csv": "CSV"}


def default_path(stem: str, suffix: str) -> str:
    return str(Path.cwd() / f"s2moe-{stem}-{time.strftime('%Y%m%d-%H%M%S')}{suffix}")


def transcript_markdown(turns) -> str:
    """A section per turn; a conversation's turns (under the model's chat template) name their roles."""
    out = ["# s2moe chat transcript", ""]
    for turn in turns:
        if turn.template is None:
            out += [f"## {turn.index}. {turn.prompt}", "", f"*{turn.settings_text}*", "", turn.answer_text.strip(), ""]
        else:
            out += [
                f"## {turn.index}. user",
                "",
                turn.prompt,
                "",
                "### assistant",
                "",
                f"*{turn.settings_text} · chat template {turn.template}*",
                "",
                turn.answer_text.strip(),
                "",
            ]
        if turn.summary:
            out += [f"> {turn.summary}", ""]
    return "\n".join(out)


def transcript_jsonl(turns) -> str:
    """One object per turn: the prompt, the settings, the answer, the summary line, and the answer's pieces
    with how each was produced (accepted draft, correction, bonus, rejected draft, plain step). A
    conversation's turn also has its messages with their roles and the chat template's name (null: a
    completion)."""
    lines = []
    for turn in turns:
        record = {
            "turn": turn.index,
            "prompt": turn.prompt,
            "settings": turn.settings_text,
            "answer": turn.answer_text,
            "summary": turn.summary,
            "template": turn.template,
        }
        if turn.template is not None:
            record["messages"] = [
                {"role": "user", "content": turn.prompt},
                {"role": "assistant", "content": turn.answer_text},
            ]
        record["segments"] = [{"kind": s.kind, "text": s.text} for s in turn.segments]
        lines.append(json.dumps(record, ensure_ascii=False))
    return "".join(line + "\n" for line in lines)


def bench_csv(done: BenchDone) -> str:
    """One row per mode with every field of its BenchRow; lists (per layer, per repeat) joined by spaces, a list
    of lists (ar's tokens of each prompt) each joined by spaces and the lists by " | "."""
    rows = [asdict(r) for r in done.rows]
    buf = io.StringIO()
    if not rows:
        return ""

    def cell(v):
        if v is None:
            return ""
        if isinstance(v, list):
            return " | ".join(cell(x) for x in v) if v and isinstance(v[0], list) else " ".join(f"{x:g}" for x in v)
        return v

    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: cell(v) for k, v in row.items()})
    return buf.getvalue()


def export_transcript(path: str, turns) -> Path:
    target, kind = _target(path, TRANSCRIPT_FORMATS)
    if not turns:
        raise ConfigError("nothing to save yet: the transcript is empty")
    write_atomic(target, transcript_markdown(turns) if kind == "Markdown" else transcript_jsonl(turns), "transcript")
    return target


def export_bench(path: str, done: BenchDone | None) -> Path:
    target, kind = _target(path, BENCH_FORMATS)
    if done is None:
        raise ConfigError("nothing to save yet: run the bench first")
    write_atomic(
        target, json.dumps(done.as_dict(), indent=2) + "\n" if kind == "JSON" else bench_csv(done), "bench results"
    )
    return target


def _target(path: str, formats: dict[str, str]) -> tuple[Path, str]:
    """The absolute path to write and its format; one clear error for a name or folder that will not do."""
    text = path.strip()
    if not text:
        raise ConfigError("give a file name")
    target = Path(text).expanduser()
    kind = formats.get(target.suffix.lower())
    if kind is None:
        raise ConfigError(f"{target.name}: the name must end in {' or '.join(formats)} (that picks the format)")
    target = target.absolute()
    if not target.parent.is_dir():
        raise ConfigError(f"no folder {target.parent}")
    if target.is_dir():
        raise ConfigError(f"{target} is a folder")
    return target, kind


class ExportDialog(ModalScreen[str | None]):
    """Asks where to save; Enter saves (the caller writes and says where), Esc cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    ExportDialog { align: center middle; }
    #export-box { width: 90%; max-width: 90; height: auto; border: thick $primary; background: $surface;
                  padding: 0 1; }
    """

    def __init__(self, title: str, path: str, formats: dict[str, str], **kw):
        super().__init__(**kw)
        self.title_text = title
        self.path = path
        self.formats = formats

    def compose(self) -> ComposeResult:
        by_name: dict[str, list[str]] = {}
        for ext, name in self.formats.items():
            by_name.setdefault(name, []).append(ext)
        kinds = "; ".join(f"{' '.join(exts)} {name}" for name, exts in by_name.items())
        with Vertical(id="export-box"):
            yield Label(self.title_text, classes="dialog-title")
            yield Input(self.path, id="export-path")
            yield Static(f"The extension picks the format ({kinds}). Enter saves · Esc cancels", classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one("#export-path", Input).focus()

    @on(Input.Submitted, "#export-path")
    def _submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)
