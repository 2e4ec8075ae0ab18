"""The S²-MoE terminal app: chat with live speculation plots, calibration, profiles, bench, the device."""

from __future__ import annotations

import asyncio
import signal

from textual import work
from textual.app import App
from textual.binding import Binding

from . import messages
from .bench import BenchScreen
from .calibrate import CalibrateScreen
from .chat import ChatScreen
from .commands import S2MoECommands
from .device import DeviceScreen
from .dialogs import HelpScreen, ModelPathDialog, binding_sections
from .messages import LoadProgress, ModelFailed, ModelReady, failure_text, post
from .profiles_screen import ProfilesScreen
from .session import EngineSession
from .state import remember_profile
from .widgets import NavBar

NO_MODEL_MESSAGE = (
    "No model was given and this install ships no default model. "
    "Type the path of a GGUF Mixture-of-Experts model (or start with --model PATH)."
)


class S2MoEApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "S²-MoE"
    ENABLE_COMMAND_PALETTE = True
    COMMANDS = App.COMMANDS | {S2MoECommands}
    MODES = {
        "chat": ChatScreen,
        "calibrate": CalibrateScreen,
        "profiles": ProfilesScreen,
        "bench": BenchScreen,
        "device": DeviceScreen,
    }
    DEFAULT_MODE = "chat"

    BINDINGS = [
        Binding(
            "ctrl+c,ctrl+q",
            "quit",
            "Quit",
            priority=True,
            show=False,
            tooltip="Quit from anywhere (stops a running job first)",
        ),
        Binding("q", "quit", "Quit", show=False, tooltip="Quit (when not typing)"),
        Binding("f1,question_mark", "help", "Help"),
        Binding("f2", "switch_mode('chat')", "Chat", show=False, tooltip="Chat screen"),
        Binding("f3", "switch_mode('calibrate')", "Calibrate", show=False, tooltip="Calibration wizard"),
        Binding("f4", "switch_mode('profiles')", "Profiles", show=False, tooltip="Device profiles"),
        Binding("f5", "switch_mode('bench')", "Bench", show=False, tooltip="Compare modes"),
        Binding(
            "f10",
            "switch_mode('device')",
            "Device",
            show=False,
            tooltip="Memory, page cache, storage reads, CPU, the budget; a Jetson's GPU",
        ),
        # not Ctrl+T: on Calibrate that key starts a tuning run, and no key may mean two things
        Binding("f12", "toggle_theme", "Theme", show=False, tooltip="Light / dark theme"),
        Binding("ctrl+p", "command_palette", "Palette", show=False, tooltip="Command palette: every action by name"),
    ]

    def __init__(
        self,
        model_path: str | None = None,
        *,
        profile: str | None = None,
        n_threads: int | None = None,
        n_ctx: int = 2048,
        model_message: str | None = None,
        load_on_start: bool = True,
        decoder_factory=None,
        budget: str | None = None,
        placement=None,
        sampling: dict | None = None,
        n_batch: int | None = None,
        copy_cache: str | None = None,
    ):
        super().__init__()
        self.sampling_flags = dict(sampling or {})  # ChatSettings fields the command line set
        self.session = EngineSession(
            model_path,
            n_threads=n_threads,
            n_ctx=n_ctx,
            profile=profile,
            decoder_factory=decoder_factory,
            budget=budget,
            placement=placement,
            n_batch=n_batch,
            copy_cache=copy_cache,
        )
        self.model_message = model_message
        self.load_on_start = load_on_start
        self._views: list = []
        self.model_loading = False
        self.load_progress: LoadProgress | None = None  # the load's latest step while it loads
        self.load_started: float | None = None
        self.quitting = False
        self.exit_code, self.exit_word = 0, None

    # -- start-up ------------------------------------------------------------------------------------------------
    def on_mount(self) -> None:
        self.theme = "textual-dark"
        if not self.is_headless:
            # Through the event loop: a Python handler would raise in whatever the loop runs at that moment,
            # and asyncio's own takes a Ctrl-C for a quit with exit code 0.
            loop = asyncio.get_running_loop()
            for sig, code, word in ((signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")):
                loop.add_signal_handler(sig, self._signalled, code, word)
        if self.session.model_path is None:
            self.push_screen(ModelPathDialog(self.model_message or NO_MODEL_MESSAGE), self._model_chosen)
        elif self.load_on_start:
            self.load_model()

    def _model_chosen(self, path: str | None) -> None:
        if path is None:
            if self.session.model_path is None:
                self.notify("no model loaded: Ctrl+P → “Open model…” when you have one", severity="warning", timeout=8)
            return
        if self.session.busy:
            self.notify("the engine is busy; stop the running job first", severity="warning")
            return
        self.session.set_model(path)
        self.model_changed()
        self.load_model()

    def action_open_model(self) -> None:
        self.push_screen(ModelPathDialog(current=self.session.model_path), self._model_chosen)

    @work(thread=True, group="load", exit_on_error=False)
    def load_model(self) -> None:
        session = self.session
        self.model_loading = True
        self.load_progress, self.load_started = None, messages.clock()
        self.call_from_thread(self.model_changed)
        try:
            if not session.lock.acquire(timeout=30):
                return
            try:
                model = session.load(lambda step, steps, what: post(self, LoadProgress(step, steps, what)))
            finally:
                session.lock.release()
            self.model_loading = False  # before the screens hear of it: a prompt sent then starts at once
            post(self, ModelReady(model))
        except Exception as e:  # noqa: BLE001 - a model llama.cpp cannot load is a message, not a crash
            from ...engine.drafting.copycache import CopyCacheError

            self.model_loading = False
            post(self, ModelFailed(failure_text(e), copy_cache=isinstance(e, CopyCacheError)))
        finally:
            self.model_loading = False

    def on_load_progress(self, message: LoadProgress) -> None:
        self.load_progress = message
        self.model_changed()

    def on_model_ready(self, message: ModelReady) -> None:
        self.model_changed()
        chat = self.chat_screen
        if chat is not None:
            chat.model_loaded()
        problem = self.session.profile_problem()
        if problem:
            self.notify(problem, title="Profile", severity="warning", timeout=12)
        cpu = self.session.cpu_buffers
        if cpu is not None and cpu.reason in ("amx", "crashed"):
            self.notify(cpu.line(), title="CPU weights", timeout=12)

    def on_model_failed(self, message: ModelFailed) -> None:
        self.model_loading = False
        chat = self.chat_screen
        if chat is not None:
            chat.model_failed()
        # a copy cache that stops the load is no fault of the model: said as what it is
        title = "Could not use the copy cache" if message.copy_cache else "Could not load the model"
        self.notify(message.text, title=title, severity="error", timeout=12)
        self.session.model_path = None
        self.model_changed()
        said = f"{title}, so the model was not loaded" if message.copy_cache else title
        self.push_screen(ModelPathDialog(f"{said}: {message.text}"), self._model_chosen)

    @property
    def model_label(self) -> str:
        s = self.session
        if s.model is not None:
            label = s.model.describe()
        elif s.model_path is None:
            label = "no model (Ctrl+P → Open model…)"
        else:
            from pathlib import Path

            label = f"{Path(s.model_path).name} · loading…" if self.model_loading else Path(s.model_path).name
        label += f" · profile {s.profile_name}" if s.profile_name else ""
        label += f" · {s.budget_label()}" if s.budget else ""
        return label

    @property
    def model_short_label(self) -> str:
        s = self.session
        if s.model is None:
            return self.model_label
        return (
            s.model.short()
            + (f" · profile {s.profile_name}" if s.profile_name else "")
            + (f" · {s.budget_label()}" if s.budget else "")
        )

    def register_view(self, screen) -> None:
        if screen not in self._views:
            self._views.append(screen)

    def model_changed(self) -> None:
        """Tell every screen that the model, the active profile or the loading state changed."""
        for screen in self.query_all_screens():
            for bar in screen.query(NavBar):
                bar.refresh_bar()
            hook = getattr(screen, "adapt_to_model", None)
            if hook is not None:
                hook()

    def query_all_screens(self):
        seen = []
        for screen in list(self._views) + list(self.screen_stack):
            if screen not in seen and screen.is_mounted:
                seen.append(screen)
        return seen

    def set_profile(self, name: str | None) -> None:
        self.session.profile_name = name
        remember_profile(name)
        chat = self.chat_screen
        if chat is not None and name is not None:
            chat.profile_activated()
        self.model_changed()
        self.notify(
            f"active profile: {name}" if name else "no profile: cost constants are measured at start-up", timeout=4
        )

    # -- actions -----------------------------------------------------------------------------------------------
    def chat_action(self, action: str, *args) -> None:
        """Run a chat-screen action from anywhere (the command palette)."""
        screen = self.chat_screen
        if screen is None:
            return
        getattr(screen, f"action_{action}")(*args)

    def bench_export(self) -> None:
        """Save the bench results (the command palette): from the Bench screen, where they are."""
        self.switch_mode("bench")
        self.call_after_refresh(lambda: self.screen.action_export())

    def bench_project(self) -> None:
        """Project the last bench's traces (the command palette): from the Bench screen, where they are."""
        self.switch_mode("bench")
        self.call_after_refresh(lambda: self.screen.action_project())

    @property
    def chat_screen(self) -> ChatScreen | None:
        for screen in self.query_all_screens():
            if isinstance(screen, ChatScreen):
                return screen
        return None

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            return
        self.push_screen(HelpScreen(binding_sections(self.screen, self)))

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.current_theme.dark else "textual-dark"

    async def action_quit(self) -> None:
        """Quit cleanly from anywhere: ask the running job to stop, give it a moment, leave."""
        if self.quitting:
            return
        self.quitting = True
        self.session.stop.set()
        await asyncio.to_thread(self.session.close, 3.0)
        self.exit(return_code=self.exit_code, message=self.exit_word)

    def _signalled(self, code: int, word: str) -> None:
        """SIGINT (kill -INT; Ctrl+C typed at the app is a key, and quits with 0) or SIGTERM: quit as Ctrl+Q
        does (the running job stopped, the terminal restored), then exit with the command line's code for
        the signal and its word on stderr."""
        self.exit_code, self.exit_word = code, word
        self.run_worker(self.action_quit())
