"""Errors the user can act on. The CLI prints their message on one line and exits with code 2.

An error about one setting names it as the engine does (`draft_topk`, `n_ctx`, …) through `option`; the
CLI and the app word it with their own names for it (a flag, a field) through `worded`.
"""

from __future__ import annotations

from collections.abc import Mapping

OPTION = "{option}"  # where a message names its setting


class S2MoEError(Exception):
    """Base for every error whose message is meant for the user."""

    def __init__(self, message: str, *, option: str | None = None):
        super().__init__(message)
        self.message, self.option = message, option

    def worded(self, names: Mapping[str, str] | None = None) -> str:
        """The message with its setting called by `names` (the engine's own name where names has none)."""
        if self.option is None:
            return self.message
        return self.message.replace(OPTION, (names or {}).get(self.option, self.option))

    def __str__(self) -> str:
        return self.worded()


class ModelError(S2MoEError):
    """The model file is missing, not a GGUF, damaged, or unsuitable for the request."""


class ConfigError(S2MoEError):
    """Invalid option values or combinations."""


class ContextError(S2MoEError):
    """The prompt does not fit the context window."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C is, so that the same clean-up runs (a budget's cgroup
    and worker, a profile's temporary file); the CLI then exits with 143, the code of death by SIGTERM."""
