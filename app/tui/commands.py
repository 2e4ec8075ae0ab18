"""The command palette (Ctrl+P): every action of the app by name."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

from .chat_settings import engine_modes, mode_help

# other words a command is looked for by, where its name does not hold them
SYNONYMS = {
    "Save transcript…": "export chat markdown jsonl write",
    "Save bench results…": "export json csv write",
    "Generation settings…": "options preferences sampling temperature",
    "Toggle light/dark theme": "colours colors",
    "Open model…": "load gguf file",
    "Show keys": "help bindings shortcuts",
    "New chat": "clear reset conversation",
}


class S2MoECommands(Provider):
    def _commands(self) -> list[tuple[str, object, str]]:
        app = self.app
        cmds: list[tuple[str, object, str]] = [
            ("Go to Chat", partial(app.action_switch_mode, "chat"), "Chat with the model (F2)"),
            (
                "Go to Calibrate",
                partial(app.action_switch_mode, "calibrate"),
                "Measure this device's cost constants (F3)",
            ),
            ("Go to Profiles", partial(app.action_switch_mode, "profiles"), "List and select device profiles (F4)"),
            ("Go to Bench", partial(app.action_switch_mode, "bench"), "Compare decoding modes on a prompt set (F5)"),
            (
                "Go to Device",
                partial(app.action_switch_mode, "device"),
                "Memory, page cache, storage reads, CPU per core, the budget (F10)",
            ),
            ("Open model…", app.action_open_model, "Load another GGUF model"),
            ("Toggle light/dark theme", app.action_toggle_theme, "F12"),
            ("Show keys", app.action_help, "Every key binding (F1 or ?)"),
            ("Quit", app.action_quit, "Stop any job and leave (q, Ctrl+C)"),
        ]
        chat = partial(app.chat_action)
        for mode in engine_modes():
            cmds.append((f"Mode: {mode}", partial(chat, "set_mode", mode), mode_help(mode) or f"Decode with {mode}"))
        cmds += [
            ("Toggle utility expansion", partial(chat, "toggle_utility"), "Routing-aware draft length on/off (F7)"),
            (
                "Toggle reuse-aware gating",
                partial(chat, "toggle_gating"),
                "Gating on/off; on (the default) is lossy, off lossless (F8)",
            ),
            (
                "Toggle copies from the context",
                partial(chat, "toggle_lookup"),
                "s2moe drafts what followed a repeated n-gram where it pays, or never (generate's --no-lookup)",
            ),
            ("Next draft top-k", partial(chat, "cycle_topk"), "Experts per token in draft passes (F9)"),
            ("Show/hide rejected drafts", partial(chat, "toggle_rejected"), "d in the chat, off the prompt"),
            ("Toggle live panel", partial(chat, "toggle_live"), "Ctrl+L in the chat"),
            ("Generation settings…", partial(chat, "settings"), "All settings in one form (Ctrl+O)"),
            (
                "Reset settings to the profile",
                partial(chat, "reset_to_profile"),
                "Forget your k_d, cap, threshold, α, α_m and copies: the active profile's tuned values apply",
            ),
            ("Stop generation", partial(chat, "stop"), "Esc in the chat"),
            (
                "New chat",
                partial(chat, "new_chat"),
                "A new conversation: the transcript and the model's chat history cleared (Ctrl+N)",
            ),
            ("Save transcript…", partial(chat, "export"), "The chat as Markdown or JSONL (Ctrl+S in the chat)"),
            ("Save bench results…", app.bench_export, "The last bench run as JSON or CSV (Ctrl+S on Bench)"),
            (
                "Project bench traces…",
                app.bench_project,
                "The last bench's traces on a device profile (Ctrl+F on Bench)",
            ),
            ("No profile (measure at start-up)", partial(app.set_profile, None), "Clear the active profile"),
        ]
        return cmds

    async def discover(self) -> Hits:
        for name, callback, help_text in self._commands():
            yield DiscoveryHit(name, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, callback, help_text in self._commands():
            score = matcher.match(name)
            also = SYNONYMS.get(name, "")
            if also and score == 0:
                # found by a word the user may type for it ("export"), ranked under the names that match
                score = 0.9 * max(matcher.match(word) for word in also.split())
            if score > 0:
                yield Hit(score, matcher.highlight(name), callback, help=help_text)
