"""The chat screen's generation settings: kept valid for the loaded model, shown in the bar under the transcript
(with a model's load in progress), changed by the keys and the settings form, and given way to an active profile's
tuned values. Apart from the screen so that what a setting means stays apart from how a chat runs."""

from __future__ import annotations

from dataclasses import asdict, replace

from textual.widgets import Static

from . import messages
from .chat_settings import OPEN_KEYS, SHORT_NAMES, ChatSettings, mode_help, value_text
from .state import remember_settings
from .widgets import progress_bar


class ChatSettingsControls:
    """ChatScreen's settings: its bar, keys and form. A part of the screen, not a widget of its own: it reads the
    screen's app, session, modes and queued prompt."""

    def adapt_to_model(self) -> None:
        """Keep the settings valid for the loaded model (dense or top-1 → no self-drafting modes; a k_d
        chosen for another model and not below this one's k → this model's default)."""
        model = self.app.session.model
        s = self.settings
        modes = self.available_modes()
        if s.mode not in modes:
            s = replace(s, mode=modes[0] if "s2moe" not in modes else "s2moe")
        if model is not None and model.is_moe and s.draft_topk is not None and s.draft_topk >= model.k:
            s = replace(s, draft_topk=None)
        self.settings = s
        if self._profile_pending and model is not None:
            self.profile_activated()
        self.update_settings_bar()
        template = self.app.session.template
        if model is not None and template is not None and template.text is not None and self._told_template != model:
            self._told_template = model
            self.notify(template.status, timeout=6)

    def update_settings_bar(self) -> None:
        session = self.app.session
        tuned = session.tuned()
        # the user's own values where the profile tuned others are marked, so that a mix is never silent
        text = self.settings.describe(session.model, tuned, session.budget is not None, self.settings.overrides(tuned))
        if session.profile_name:
            text += f" · profile {session.profile_name}"
            if session.profile_problem():
                text += " (not for this model: F3)"
        if self.app.model_loading:
            text = f"{self.loading_text()}\n{text}"  # first: until it ends, nothing else can happen
        elif self._status:
            text += f"   {self._status}"
        self.query_one("#settings-bar", Static).update(text)

    def loading_text(self) -> str:
        """What the model's load is doing, with its step and how long it has taken (a budgeted load warms up
        and sizes the budget for a minute or more), and whether a prompt waits for it."""
        app = self.app
        p = app.load_progress
        waited = f" · {messages.clock() - app.load_started:.0f} s" if app.load_started is not None else ""
        if p is None:
            text = f"loading the model…{waited}"
        else:
            text = f"loading {progress_bar(p.step, p.steps)} {p.step}/{p.steps}: {p.what}{waited}"
        return text + (" · your prompt is queued" if self._queued is not None else "")

    def tick(self) -> None:
        """Once a second: a load's seconds count up."""
        if self.app.model_loading:
            self.update_settings_bar()

    def set_status(self, text: str) -> None:
        self._status = text
        self.update_settings_bar()

    def apply_settings(self, settings: ChatSettings) -> None:
        self.settings = settings
        self.adapt_to_model()
        remember_settings(asdict(self.settings))

    def shown_settings(self) -> ChatSettings:
        """The settings with what they leave open filled in: the active profile's tuned values, else the
        model's defaults (with no model loaded, k_d of the top-8 model the k_d choices assume then)."""
        s = self.settings.resolved(self.app.session.model, self.app.session.tuned())
        if s.draft_topk is None:
            from ...engine.decoding.generation_config import routing_defaults

            s = replace(s, draft_topk=routing_defaults(64, 8).draft_topk)
        return s

    def action_cycle_mode(self, step: int = 1) -> None:
        modes = self.available_modes()
        i = modes.index(self.settings.mode) if self.settings.mode in modes else -step
        self.apply_settings(replace(self.settings, mode=modes[(i + step) % len(modes)]))
        self.notify(f"{self.settings.mode}: {mode_help(self.settings.mode)}".rstrip(": "), timeout=3)

    def action_set_mode(self, mode: str) -> None:
        if mode not in self.available_modes():
            self.notify(f"mode {mode} does not apply to this model", severity="warning")
            return
        self.apply_settings(replace(self.settings, mode=mode))

    def action_toggle_utility(self) -> None:
        self.apply_settings(replace(self.settings, utility=not self.settings.utility))
        self.notify("utility expansion " + ("on" if self.settings.utility else "off (fixed draft length)"), timeout=2)

    def action_toggle_lookup(self) -> None:
        self.apply_settings(replace(self.settings, lookup=not self.shown_settings().lookup))
        self.notify(
            "copies from the context "
            + ("on (s2moe, where the utility rule says they pay)" if self.settings.lookup else "off"),
            timeout=2,
        )

    def action_toggle_gating(self) -> None:
        self.apply_settings(replace(self.settings, gating=not self.settings.gating))
        self.notify(
            "reuse-aware gating "
            + ("on (lossy: answers can differ from plain decoding's)" if self.settings.gating else "off (lossless)"),
            timeout=3,
        )

    def action_cycle_topk(self, step: int = 1) -> None:
        model = self.app.session.model
        k = model.k if model is not None and model.is_moe else 8
        choices = list(range(1, max(2, k)))
        current = self.shown_settings().draft_topk
        i = choices.index(current) if current in choices else -step
        self.apply_settings(replace(self.settings, draft_topk=choices[(i + step) % len(choices)]))
        self.notify(f"draft experts per token k_d = {self.settings.draft_topk}", timeout=2)

    def action_settings(self) -> None:
        from .dialogs import SettingsDialog

        session = self.app.session
        shown = self.shown_settings()
        reset = self.settings.left_to_profile()

        def done(result):
            if result is None:
                return
            if result is not reset:
                # a value the form showed unchanged stays open: the profile's (or the default) still decides
                # it, for another profile or model too
                result = result.left_to_profile(
                    [
                        key
                        for key in OPEN_KEYS
                        if getattr(self.settings, key) is None and getattr(result, key) == getattr(shown, key)
                    ]
                )
            self.apply_settings(result)

        sources = self.settings.sources(session.tuned(), self.app.sampling_flags)
        self.app.push_screen(
            SettingsDialog(
                shown, self.available_modes(), session.model, sources=sources, profile=session.profile_name, reset=reset
            ),
            done,
        )

    def action_reset_to_profile(self) -> None:
        """Leave every value a profile can tune to the active profile again (else to the defaults)."""
        self.apply_settings(self.settings.left_to_profile())
        self.notify(
            "the profile's values apply" if self.app.session.profile_name else "the default values apply", timeout=3
        )

    def profile_activated(self) -> None:
        """A profile was made active: its tuned values win over the user's remembered ones (the user changed
        them before this tuning existed), and the user is told which of theirs gave way."""
        session = self.app.session
        if session.model is None:
            self._profile_pending = True
            return
        self._profile_pending = False
        tuned = session.tuned()
        replaced = self.settings.overrides(tuned)
        self.apply_settings(self.settings.left_to_profile([key for key in OPEN_KEYS if key in tuned]))
        if replaced:
            self.notify(
                "the profile's tuned values replace yours: "
                + ", ".join(
                    f"{SHORT_NAMES[key]} {value_text(theirs)} (was {value_text(mine)})"
                    for key, (mine, theirs) in replaced.items()
                ),
                timeout=8,
            )
