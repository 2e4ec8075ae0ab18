"""The chat screen: prompt in, answer streamed token by token with how each token was produced."""

from __future__ import annotations

import time
from dataclasses import replace

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Static

from ...engine.errors import S2MoEError
from .chat_controls import ChatSettingsControls
from .chat_events import ChatEventHandlers
from .chat_settings import MODE_HELP, ChatSettings, engine_modes, moe_modes
from .live import LivePanel
from .messages import EngineEvent, EngineFailed, EngineNotice, JobEnded, failure_text, post
from .state import remembered_settings, settings_from_state
from .widgets import ChatTurn, FittedFooter, NavBar, PromptInput, Transcript, TurnView, legend


class ChatScreen(ChatSettingsControls, ChatEventHandlers, Screen):
    """Chat with the model; the live panel beside it shows what each iteration did."""

    AUTO_FOCUS = "#prompt"

    BINDINGS = [
        Binding("escape", "stop", "Stop", tooltip="Stop the generation after the current iteration"),
        # not Ctrl+R, which runs on Calibrate and Bench: a letter that works off the prompt, as q and ? do
        Binding(
            "d",
            "toggle_rejected",
            "Drafts",
            show=False,
            tooltip="Show or hide rejected draft tokens (when not typing; Tab leaves the prompt)",
        ),
        Binding("f6", "cycle_mode", "Mode", tooltip="Next decoding mode (s2moe, ar, baselines)"),
        Binding("shift+f6", "cycle_mode(-1)", "Previous mode", show=False, tooltip="Previous decoding mode"),
        Binding("f7", "toggle_utility", "Utility", tooltip="Routing-aware expansion on/off (off: fixed draft length)"),
        Binding(
            "f8", "toggle_gating", "Gating", tooltip="Reuse-aware gating on/off (on, the default: lossy; off: lossless)"
        ),
        Binding("f9", "cycle_topk", "k_d", tooltip="Next number of experts per token in draft passes"),
        Binding(
            "shift+f9",
            "cycle_topk(-1)",
            "Fewer k_d",
            show=False,
            tooltip="Previous number of experts per token in draft passes",
        ),
        Binding("ctrl+o", "settings", "Settings", show=False, tooltip="All generation settings in one form"),
        Binding(
            "ctrl+s",
            "export",
            "Save",
            show=False,
            tooltip="Save the transcript as Markdown (.md) or JSONL (.jsonl); the path is shown after",
        ),
        Binding("ctrl+g", "full_live", "Plots", tooltip="The live panel full-screen, with every plot (again: back)"),
        Binding("ctrl+l", "toggle_live", "Live panel", show=False, tooltip="Show or hide the live panel"),
        Binding("ctrl+n", "new_chat", "New chat", show=False, tooltip="Clear the chat history"),
        Binding(
            "ctrl+y",
            "focus_live",
            "Focus live panel",
            show=False,
            tooltip="Focus the live panel (arrows/PgUp/PgDn scroll it; Tab returns)",
        ),
        Binding("i", "focus_prompt", "Prompt", show=False, tooltip="Focus the prompt (when not typing)"),
    ]

    PROMPT_HELP = [
        ("Up / Down", "earlier prompts of this session"),
        ("Ctrl+U", "clear the prompt"),
        ("Tab / Shift+Tab", "move focus: prompt, transcript, live panel (q, ?, d work off the prompt)"),
    ]
    COMPLETION_HELP = [("Enter", "generate (each prompt is a fresh completion; the transcript keeps them all)")]
    OTHER_HELP = [
        ("Modes (F6 next, Shift+F6 back)", list(MODE_HELP.items())),
        (
            "Answer colours",
            [
                ("accepted", "draft token the target accepted"),
                ("correction", "the target's token replacing the first rejected draft"),
                ("bonus", "the target's extra token after every draft was accepted"),
                ("rejected", "draft token the target rejected (struck through; d hides, off the prompt)"),
                ("plain", "a plain decoding step (no draft)"),
            ],
        ),
        (
            "Live panel",
            [
                ("Ctrl+G", "the panel full-screen with every plot; Ctrl+G or Esc returns"),
                (
                    "tiles",
                    "one line per figure: value, recent iterations as a sparkline, note; reuse and "
                    "memory draw one bar per layer, utility marks the rule's cut with |",
                ),
                ("accept len", "tokens committed per target pass (1.0 = plain decoding)"),
                ("accepted", "share of draft tokens the target accepted"),
                ("rollbacks", "rejected draft tokens undone after verification (removed from the model's KV cache)"),
                (
                    "reuse",
                    "distinct experts / (tokens × k) per layer: lower means the tokens shared more experts; "
                    "1/tokens is perfect reuse",
                ),
                ("useful", "share of the verification's experts that committed tokens needed"),
                ("moved", "expert selections reuse-aware gating moved onto shared experts"),
                (
                    "no draft",
                    "the utility rule's decision (or drafting, probing) with its numbers; F7 turns the rule off",
                ),
                (
                    "per step",
                    "under --budget: experts a verification read over all layers, those fetched from "
                    "storage (not in memory when their layer routed), page faults",
                ),
                ("faults", "under --budget: page faults per step that waited for storage"),
            ],
        ),
    ]

    @property
    def HELP_EXTRA(self):  # noqa: N802 - the name the help screen reads a screen's own sections by
        """The help's own sections; the prompt's says whether Enter continues a conversation."""
        template = self.app.session.template
        if self.app.session.conversation is not None:
            enter = [
                (
                    "Enter",
                    f"the next turn of the conversation, under the model's chat template ({template.name});"
                    " the model keeps the turns before in its KV cache",
                ),
                ("Ctrl+N", "a new conversation: the transcript and the model's history cleared"),
            ]
        else:
            enter = self.COMPLETION_HELP
        return [("Prompt", enter + self.PROMPT_HELP)] + self.OTHER_HELP

    def __init__(self, **kw):
        super().__init__(**kw)
        self.settings = ChatSettings()
        self.generating = False
        self.show_rejected = True
        self._turn: TurnView | None = None
        self._turn_index = 0
        self._status = ""
        self._told_template = None  # the model whose chat template the user was told about
        self._prefilled = None  # the running turn's Prefilled event
        self._profile_pending = False  # a profile was made active before a model was loaded to tune for
        self._queued: str | None = None  # a prompt sent while the model loads: it starts once it has

    # -- layout ------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield NavBar("chat", id="navbar")
        with Horizontal(id="chat-body"):
            with Vertical(id="chat-main"):
                yield Static(id="legend")
                yield Transcript(id="transcript")
                yield Static(id="settings-bar")
                yield PromptInput(placeholder="Prompt: Enter runs, Esc stops", id="prompt")
            yield LivePanel(id="live")
        # F1 Help must stay on the line at 80 columns: d and Ctrl+O are in the help and the palette
        yield FittedFooter(compact=True, first=("stop", "cycle_mode", "full_live"))

    def on_mount(self) -> None:
        self.app.register_view(self)
        self.query_one("#legend", Static).update(legend(self.app))
        try:
            remembered = remembered_settings()
        except S2MoEError as e:
            remembered = {}
            self.notify(
                f"{failure_text(e)}: the chat starts from the default settings, which replace the file "
                "when a setting changes",
                title="Settings not restored",
                severity="warning",
                timeout=12,
            )
        self.settings = replace(settings_from_state(remembered), **self.app.sampling_flags)
        self.adapt_to_model()
        self.set_interval(0.1, self.flush_text)
        self.set_interval(0.3, self.flush_live)  # plots cost more to draw than text
        self.set_interval(1.0, self.tick)
        self.query_one("#prompt").focus()
        self.app.theme_changed_signal.subscribe(self, lambda _theme: self._restyle())

    def _restyle(self) -> None:
        self.query_one("#legend", Static).update(legend(self.app))
        for turn in self.query(TurnView):
            turn.redraw()

    @property
    def focus_chain(self):
        """Tab goes prompt → transcript → live panel, as the help says (by position it would go from the
        prompt at the bottom to the panel on the right, then up to the transcript)."""
        chain = super().focus_chain
        order = [w for w in (self.query_one("#prompt"), self.transcript, self.live) if w in chain]
        return order + [w for w in chain if w not in order]

    @property
    def live(self) -> LivePanel:
        return self.query_one(LivePanel)

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    # -- settings ------------------------------------------------------------------------------------
    def available_modes(self) -> tuple[str, ...]:
        modes = engine_modes()
        model = self.app.session.model
        if model is not None and not model.can_self_draft:
            moe = set(moe_modes())
            modes = tuple(m for m in modes if m not in moe) or ("ar",)
        return modes

    # -- view actions ----------------------------------------------------------------------------------
    def action_toggle_rejected(self) -> None:
        self.show_rejected = not self.show_rejected
        for turn in self.query(TurnView):
            turn.show_rejected = self.show_rejected
            turn.redraw()
        self.notify("rejected drafts " + ("shown" if self.show_rejected else "hidden"), timeout=2)

    def action_toggle_live(self) -> None:
        live = self.live
        live.display = not live.display

    def action_full_live(self) -> None:
        if self.maximized is self.live:
            self.minimize()
            return
        self.live.display = True
        self.maximize(self.live, container=False)
        self.live.focus()
        self.flush_live()

    def action_focus_live(self) -> None:
        self.live.display = True
        self.live.focus()

    def action_focus_prompt(self) -> None:
        self.query_one("#prompt").focus()

    def action_export(self) -> None:
        from .export import TRANSCRIPT_FORMATS, ExportDialog, default_path, export_transcript

        turns = self.transcript.turns
        if not turns:
            self.notify("nothing to save yet: the transcript is empty", severity="warning")
            return

        def save(path: str | None) -> None:
            if path is None:
                return
            try:
                target = export_transcript(path, self.transcript.turns)
            except (S2MoEError, OSError) as e:
                self.notify(
                    str(e) if isinstance(e, S2MoEError) else f"cannot write {path}: {e.strerror}",
                    title="Not saved",
                    severity="error",
                    timeout=8,
                )
                return
            self.notify(f"saved {len(turns)} turn(s) to {target}", title="Transcript saved", timeout=10)

        self.app.push_screen(ExportDialog("Save the transcript", default_path("chat", ".md"), TRANSCRIPT_FORMATS), save)

    def action_new_chat(self) -> None:
        if self.generating:
            self.notify("stop the generation first (Esc)", severity="warning")
            return
        self.transcript.remove_children()
        self._turn = None
        self._turn_index = 0
        self.app.session.new_conversation()
        if self.app.session.conversation is not None:
            self.notify("a new conversation", timeout=2)

    def action_stop(self) -> None:
        if self._queued is not None:
            self.query_one("#prompt", PromptInput).value = self._queued
            self._queued = None
            self.end_queued_turn("taken back before the model had loaded")
        elif self.generating:
            self.app.session.stop.set()
            self.set_status("stopping…")
        elif self.maximized is not None:
            self.minimize()
        else:
            self.query_one("#prompt").focus()

    def check_action(self, action: str, parameters) -> bool | None:
        if action == "stop":
            return True if self.generating else None
        return True

    # -- generation --------------------------------------------------------------------------------------
    @on(PromptInput.Submitted, "#prompt")
    def submit(self, event: PromptInput.Submitted) -> None:
        prompt = event.value.strip()
        if not prompt:
            return
        if self.app.model_loading and not self.generating:
            # queued, not dropped: it starts once the model is ready (Esc takes it back)
            box = self.query_one("#prompt", PromptInput)
            box.remember(prompt)
            box.value = ""
            self._queued = prompt
            turn = self.begin_turn(prompt)
            turn.status = "queued: starts when the model has loaded (Esc takes it back)"
            turn.dirty = True
            self.update_settings_bar()
            return
        if self.generating or self.app.session.busy:
            self.notify("the engine is busy: wait, or press Esc to stop the generation", severity="warning")
            return
        if self.app.session.model_path is None:
            self.app.action_open_model()
            return
        box = self.query_one("#prompt", PromptInput)
        box.remember(prompt)
        box.value = ""
        self.start_generation(prompt)

    def model_loaded(self) -> None:
        """The model is ready: a prompt queued while it loaded starts now."""
        prompt, self._queued = self._queued, None
        if prompt is None or self._turn is None:
            return
        session = self.app.session
        self._turn.settings_text = self.settings.describe(session.model, session.tuned(), session.budget is not None)
        self._turn.status = "starting…"
        self._turn.dirty = True
        self.set_status("preparing…")
        self.generate(self._turn_index, prompt, replace(self.settings))

    def model_failed(self) -> None:
        """The model did not load: a queued prompt goes back into the box, unsent."""
        prompt, self._queued = self._queued, None
        if prompt is None:
            return
        self.end_queued_turn("not sent: the model did not load")
        self.query_one("#prompt", PromptInput).value = prompt

    def end_queued_turn(self, summary: str) -> None:
        if self._turn is not None:
            self._turn.summary = summary
            self._turn.dirty = True
        self.generating = False
        self.refresh_bindings()
        self.update_settings_bar()
        self.flush_text()

    def start_generation(self, prompt: str) -> ChatTurn:
        turn = self.begin_turn(prompt)
        self.generate(self._turn_index, prompt, replace(self.settings))
        return turn

    def begin_turn(self, prompt: str) -> ChatTurn:
        """A new turn in the transcript, waiting for engine events."""
        self._prefilled = None
        self._turn_index += 1
        session = self.app.session
        chat = session.template.name if session.conversation is not None else None
        turn = ChatTurn(
            self._turn_index,
            prompt,
            self.settings.describe(session.model, session.tuned(), session.budget is not None),
            chat,
        )
        turn.show_rejected = self.show_rejected
        turn.status = "starting…"
        self._turn = turn
        self.transcript.mount(turn)
        turn.redraw()
        self.transcript.scroll_end(animate=False)
        self.generating = True
        self.refresh_bindings()
        status = "loading model…" if self.app.session.decoder is None else "preparing…"
        if self.settings.mode == "s2moe" and self.settings.utility and not self.app.session.profile_name:
            status += " (first s2moe run measures cost constants)"
        self.set_status(status)
        return turn

    @work(thread=True, group="engine", exit_on_error=False)
    def generate(self, turn: int, prompt: str, settings: ChatSettings) -> None:
        session = self.app.session

        def emit(event, view):
            post(self, EngineEvent(turn, event, view, time.perf_counter()))

        def warn(text):
            post(self, EngineNotice(text))

        try:
            session.generate(prompt, settings, emit, warn)
        except Exception as e:  # noqa: BLE001 - shown to the user, never a crash
            post(self, EngineFailed(failure_text(e)))
        finally:
            post(self, JobEnded("generate"))
